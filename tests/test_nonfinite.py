"""The non-finite guard (workers/nonfinite.py): a step with an inf/NaN loss or gradient norm never updates the
model, and the run says so in one line.

In process (no Ray): a 1-rank gloo group and a tiny ZeRO-2 engine built as the workers build it
(workers/engine.py, the product's DeepSpeed JSON with a warmup LR schedule). A poisoned step (its loss made
inf, or one parameter's gradient made inf with a finite loss) must leave the fp32 master weights, the module
weights, AdamW's state and the LR schedule exactly as they were, while a good step changes them.

End to end (slow, one Ray run each): `train.lr=1.0e+30` on a tiny run diverges at step 2 (step 1's update
makes every weight ~1e30): `python -m app train` exits 1 with one line naming the step and the knobs, only
step 1's checkpoint exists, metrics.jsonl is strict JSON and `report` shows the step as non-finite. With
`train.nonfinite=skip` and `train.max_skipped_steps=2`, steps 2 and 3 are skipped (warned) and step 4 stops
the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import ConfigError, load_config
from scheduling import CostModel, plan_step
from scheduling.payload import Cursor, Sample, build_rank_payloads
from tests.run_configs import NO_EXPORT, SMALL_VOCAB
from workers.lr_schedule import LrSchedule

VOCAB = 64
SPEC = {"name_or_path": "tiny-qwen2", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64}


# ------------------------------------------------------------------------------------ config (unit)


def test_config_choices_of_the_guard() -> None:
    assert load_config(None, []).train.nonfinite == "error"
    skip = load_config(None, ["train.nonfinite=skip", "train.max_skipped_steps=5"]).train
    assert (skip.nonfinite, skip.max_skipped_steps) == ("skip", 5)
    with pytest.raises(ConfigError, match="train.nonfinite"):
        load_config(None, ["train.nonfinite=ignore"])
    with pytest.raises(ConfigError, match="train.max_skipped_steps"):
        load_config(None, ["train.max_skipped_steps=0"])
    # ZeRO stage 0 applies inf/NaN gradients (no overflow check): the guard could not hold.
    with pytest.raises(ConfigError, match="train.zero_stage must be 1, 2 or 3"):
        load_config(None, ["train.zero_stage=0"])


# ------------------------------------------------------------------- one engine, in process (unit)


@pytest.fixture(scope="module")
def engine():
    """A 1-rank gloo world and a tiny ZeRO-2 engine (fp32, AdamW, 4 warmup steps), torn down after the
    module."""
    import torch.distributed as dist

    from app.model.deepspeed_config import deepspeed_config
    from workers.engine import build_engine
    from workers.models import ModelSpec
    from workers.tools.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    ds = deepspeed_config(load_config(None, ["train.lr=0.01"]).train, dtype="fp32", on_gpu=False)
    try:
        yield build_engine(ModelSpec(**SPEC), ds, torch.device("cpu"), seed=0,
                           lr_schedule=LrSchedule("constant", warmup_steps=4, total_steps=10))
    finally:
        dist.destroy_process_group()


def _payload(step: int):
    rng = np.random.default_rng(step)
    lengths = [9, 14, 5]
    samples = [Sample(sample_id=i, input_ids=rng.integers(1, VOCAB, n), labels=rng.integers(1, VOCAB, n))
               for i, n in enumerate(lengths)]
    cost = CostModel.from_model_dims(hidden_size=32, kv_hidden_size=16, num_layers=1)
    plan = plan_step("skrull", lengths, dp_size=1, cp_size=1, bucket_size=16, cost=cost)
    return build_rank_payloads(plan, samples, step=step, epoch=0, cursor=Cursor(epoch=0, rows=3 * step),
                               plan_ms=0.0)[0, 0]


def _state(engine) -> dict[str, torch.Tensor | object]:
    """Everything an update touches: module weights, ZeRO's fp32 master partition, AdamW state, LR
    schedule."""
    state: dict[str, object] = {f"module.{n}": p.detach().clone()
                                for n, p in engine.module.named_parameters()}
    master = engine.optimizer.single_partition_of_fp32_groups
    state |= {f"fp32.{i}": t.detach().clone() for i, t in enumerate(master)}
    for i, per_param in enumerate(engine.optimizer.optimizer.state.values()):
        state |= {f"adam.{i}.{k}": (v.clone() if torch.is_tensor(v) else v) for k, v in per_param.items()}
    state["lr_schedule"] = engine.lr_scheduler.state_dict()
    state["lr"] = engine.get_lr()
    return state


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _step(engine, step: int, groups, guard):
    from workers.step import run_step

    stats = run_step(engine, _payload(step), groups, device=torch.device("cpu"), loss_chunk_tokens=16)
    return stats, guard.after_step(step, stats.applied, stats.loss_sum, groups.world_group)


def test_a_non_finite_step_leaves_weights_adam_state_and_lr_schedule_untouched(engine, monkeypatch) -> None:
    import workers.step
    from workers.distributed import ParallelGroups
    from workers.nonfinite import NonFiniteGuard, NonFinitePolicy

    groups = ParallelGroups.create(1)
    guard = NonFiniteGuard(NonFinitePolicy("skip", max_skipped_steps=2), "train.lr=0.01")
    stats, what = _step(engine, 1, groups, guard)
    assert stats.applied and what is None
    before = _state(engine)

    real = workers.step.micro_batch_loss_sum
    monkeypatch.setattr(workers.step, "micro_batch_loss_sum", lambda *a, **k: real(*a, **k) * float("inf"))
    stats, what = _step(engine, 2, groups, guard)
    assert not stats.applied and what == "loss (on 1 rank)" and guard.stop is None
    assert _same(_state(engine), before)
    monkeypatch.undo()

    # A finite loss with a non-finite gradient (one parameter's): DeepSpeed's norm check drops it too.
    weight = next(engine.module.parameters())
    hook = weight.register_hook(lambda grad: grad * float("inf"))
    stats, what = _step(engine, 3, groups, guard)
    hook.remove()
    assert not stats.applied and what == "gradient norm" and torch.isfinite(stats.loss_sum)
    assert _same(_state(engine), before)
    assert guard.skipped_in_a_row == 2 and guard.stop is None  # train.max_skipped_steps=2: still going

    stats, what = _step(engine, 4, groups, guard)  # a good step resets the count and does update
    assert stats.applied and guard.skipped_in_a_row == 0 and not _same(_state(engine), before)
    # DeepSpeed steps the schedule after applied updates only; the train loop advances it past a skipped
    # one itself (workers/lr_schedule.py: skip), so the rate follows the global step.
    assert engine.lr_scheduler.state_dict()["last_epoch"] == before["lr_schedule"]["last_epoch"] + 1

    # train.nonfinite=error stops at the first bad step, naming it, what was non-finite and the knobs.
    knobs = "train.lr=0.01, train.grad_clip=1, model.dtype=fp32"
    error = NonFiniteGuard(NonFinitePolicy("error"), knobs, last_checkpoint_step=4)
    monkeypatch.setattr(workers.step, "micro_batch_loss_sum", lambda *a, **k: real(*a, **k) * float("nan"))
    stats, what = _step(engine, 5, groups, error)
    assert not stats.applied
    assert error.stop is not None and error.stop.startswith("step 5: the loss (on 1 rank) was non-finite")
    for knob in ("lower train.lr", "train.grad_clip", "model.dtype=fp32", knobs, "checkpoint (step 4)"):
        assert knob in error.stop, error.stop


def test_the_knobs_are_read_back_from_the_generated_deepspeed_json() -> None:
    from app.model.deepspeed_config import deepspeed_config
    from workers.nonfinite import knob_values

    train = load_config(None, ["train.lr=1.0e+30", "train.grad_clip=0.5"]).train
    assert knob_values(deepspeed_config(train, dtype="bf16", on_gpu=False)) == \
        "train.lr=1e+30, train.grad_clip=0.5, model.dtype=bf16"


# ------------------------------------------------------------------------ report (unit, no Ray)


def _write_run(run_dir: Path, losses: list[float | None], **last: object) -> None:
    from app.rundir.files import METRICS_FILE, append_jsonl, write_json

    write_json(run_dir / "skrull_config.json", {"train": {"steps": len(losses) + 2}})
    for step, loss in enumerate(losses, start=1):
        record = {"step": step, "loss": float("nan") if loss is None else loss, "tokens": 10, "step_s": 1.0,
                  "update_skipped": loss is None}
        append_jsonl(run_dir / METRICS_FILE, record | (last if step == len(losses) else {}))


def test_report_shows_non_finite_steps_and_marks_loss_spikes(tmp_path: Path) -> None:
    from app.train.report import report_lines, run_report

    _write_run(tmp_path, [6.0, 5.0, 5.5, 70.0, 4.0, None, None], stopped="step 7: the loss was non-finite")
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
    report = run_report(tmp_path)
    # 70 > 10 x median(6, 5, 5.5) = 55; 4.0 is no spike; the NaN steps are non-finite, not spikes.
    assert report["loss_spikes"] == [{"step": 4, "loss": 70.0, "median": 5.5}]
    assert report["nonfinite_steps"] == [6, 7]
    assert (report["status"], report["loss_last"], report["loss_first"]) == ("stopped", None, 6.0)
    text = "\n".join(report_lines(report))
    assert "-> non-finite" in text and "non-finite steps 6, 7" in text
    assert "loss spikes > 10x the running median: step 4: 70 (median 5.5)" in text
    assert "stopped   step 7: the loss was non-finite" in text


def test_the_json_summary_of_a_run_whose_last_step_was_skipped_is_strict_json() -> None:
    from app.train.driver import TrainSummary

    summary = TrainSummary(steps=2, samples=16, tokens=100, loss_first=6.0, loss_last=float("nan"),
                           tokens_per_s=10.0, checkpoint=None, run_dir="r", resumed_from_step=None,
                           restarts=0, export=None, history=[])
    assert json.loads(json.dumps(summary.to_json_dict(), allow_nan=False))["loss_last"] is None


# ------------------------------------------------------------------------- end to end (slow, Ray)

COMMON = ["data.num_samples=40", "data.length_scale=0.1", "scheduling.global_batch_size=8",
          "parallel.cp_size=1", "parallel.num_workers=2", SMALL_VOCAB, NO_EXPORT, "train.checkpoint_every=1",
          "train.lr=1.0e+30"]


def _overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [f"run.storage_path={tmp_path}", f"run.name={name}", *COMMON, *extra]


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(json.loads((p / "skrull_state.json").read_text())["step"]
                  for p in run_dir.glob("checkpoint_*") if p.is_dir())


def _strict_records(run_dir: Path) -> list[dict]:
    def refuse(name: str) -> None:
        pytest.fail(f"{name} in metrics.jsonl")

    return [json.loads(line, parse_constant=refuse)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_divergence_stops_the_run_at_that_step_with_one_line(local_ray, tmp_path: Path, capsys) -> None:
    """`python -m app train --json` with train.lr=1e30: step 1 is fine, its update makes the loss of step
    2 non-finite; exit 1, one line on stderr, no JSON on stdout, only step 1's checkpoint, no restart."""
    from app.__main__ import main
    from app.train.report import report_lines, run_report

    args = ["train", "--config", "configs/tiny-cpu.yaml", "--json", "--no-progress"]
    for override in _overrides(tmp_path, "diverged", "train.steps=4", "train.max_failures=2"):
        args += ["--set", override]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = [line for line in err.splitlines() if line.startswith("skrull train: error:")]
    assert line.startswith("skrull train: error: step 2: the loss (on 2 ranks) was non-finite")
    for knob in ("train.lr=1e+30", "train.grad_clip=1", "model.dtype=fp32", "newest checkpoint (step 1)"):
        assert knob in line
    run_dir = tmp_path / "diverged"
    assert _checkpoint_steps(run_dir) == [1]
    records = _strict_records(run_dir)
    assert [(r["step"], r["loss"] is None, r["update_skipped"]) for r in records] == [(1, False, False),
                                                                                       (2, True, True)]
    report = run_report(run_dir)
    assert (report["status"], report["nonfinite_steps"], report["loss_last"]) == ("stopped", [2], None)
    assert report["starts"] == 1  # train.max_failures=2 never restarted the group into the same divergence
    assert any(text.startswith("non-finite steps 2") for text in report_lines(report))


def test_skip_drops_non_finite_steps_and_stops_after_max_skipped_steps(local_ray, tmp_path: Path,
                                                                        capsys) -> None:
    from app.train.driver import train
    from app.train.failures import RunFailed

    config = load_config("configs/tiny-cpu.yaml", _overrides(
        tmp_path, "skipping", "train.steps=6", "train.nonfinite=skip", "train.max_skipped_steps=2"))
    with pytest.raises(RunFailed, match=r"^step 4: 3 steps in a row had a non-finite loss .*"
                                        r"train.max_skipped_steps=2"):
        train(config, progress=False)
    warned = capsys.readouterr().err
    assert "warning: step 2: non-finite loss" in warned and "warning: step 3: non-finite loss" in warned
    run_dir = tmp_path / "skipping"
    records = _strict_records(run_dir)
    assert [(r["step"], r["update_skipped"]) for r in records] == [(1, False), (2, True), (3, True),
                                                                    (4, True)]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2, 3]
    # Skipped steps are steps (their data was consumed): their checkpoints hold step 1's model; the step
    # that stopped the run has none. keep_checkpoints=2 leaves 2 and 3.
    assert _checkpoint_steps(run_dir) == [2, 3]
