"""`bench peer`: TRL's side trains exactly the tokens, labels and weights this project's side does.

No Ray here (quick tier): the TRL side is built as `bench peer` builds it (app/bench/peer/trl_side.py) on a
tiny model, and what TRL's own dataset preparation, collator and loss produce is compared with references
nobody here wrote for TRL: the rows of the Ray Data tokenizing function (app/data/ray_ops.py), the
workers' label shift (workers/batch.py), the planner's global label count, the workers' model build, and
transformers' own per-sequence causal-LM loss. The timed end-to-end run is `python -m app bench peer`
(docs/benchmarks.md, "Against TRL's SFTTrainer").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")

from app.__main__ import main  # noqa: E402
from app.bench.peer.rows import WARMUP_STEPS, StepBatch, check_peer_config, step_batches  # noqa: E402
from app.commands.bench_peer import summarize  # noqa: E402
from app.config import ConfigError, SkrullConfig, load_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 8
TINY = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "data.num_samples=24",
        f"scheduling.global_batch_size={GLOBAL_BATCH}", "scheduling.calibration=off",
        f"data.tokenizer={REPO / 'configs/bench/synth-bpe-773.json'}"]


@pytest.fixture(scope="module")
def config() -> SkrullConfig:
    return load_config(REPO / "configs/bench/cpu-lmsys.yaml", TINY)


@pytest.fixture(scope="module")
def batches(config: SkrullConfig) -> list[StepBatch]:
    return step_batches(config, steps=1)


@pytest.fixture(scope="module")
def trainer(config: SkrullConfig, batches: list[StepBatch], tmp_path_factory: pytest.TempPathFactory):
    import torch

    from app.bench.peer.trl_side import build_trainer

    torch.set_num_threads(1)
    return build_trainer(config, batches, micro_batch=2, out_dir=tmp_path_factory.mktemp("trl"))


def _trl_steps(trainer, steps: int) -> list[list[dict]]:
    """The collated micro-batches of each optimizer step, in the order TRL's training loop takes them."""
    loader = iter(trainer.get_train_dataloader())
    accumulation = trainer.args.gradient_accumulation_steps
    return [[next(loader) for _ in range(accumulation)] for _ in range(steps)]


def test_steps_are_the_rows_the_ray_data_tokenizer_makes(config: SkrullConfig,
                                                         batches: list[StepBatch]) -> None:
    import pyarrow as pa

    from app.data.ray_ops import synthesize_and_tokenize
    from app.data.resolved import template_settings

    data = config.data
    ids = pa.table({"id": np.arange(data.num_samples, dtype=np.int64)})
    synthesize = (data.tokenizer, data.distribution, data.num_samples, data.seed, data.length_scale)
    settings = template_settings(data, config.max_sequence_length)
    table = synthesize_and_tokenize(ids, synthesize, (data.tokenizer, settings)).to_pylist()
    assert [b.sample_ids for b in batches] == [list(range(n * GLOBAL_BATCH, (n + 1) * GLOBAL_BATCH))
                                                for n in range(WARMUP_STEPS + 1)]
    for batch in batches:
        for row in batch.rows:
            assert row.input_ids == table[row.index]["input_ids"]
            assert row.labels == table[row.index]["labels"]


def test_with_online_calibration_both_sides_train_its_window_uncounted(config: SkrullConfig) -> None:
    """bench train leaves out the warm-up step and the calibration window (the planner tries its candidates
    there): TRL trains the same batches, marked warm-up, so that both sides count the same global batches."""
    from app.bench.driver import uncounted_steps

    online = dataclasses.replace(config, scheduling=dataclasses.replace(
        config.scheduling, calibration="online", calibration_window=2))
    online = dataclasses.replace(online, data=dataclasses.replace(online.data, num_samples=5 * GLOBAL_BATCH))
    assert uncounted_steps(online) == WARMUP_STEPS + 2
    batches = step_batches(online, steps=2)
    assert [b.warmup for b in batches] == [True, True, True, False, False]
    assert [b.sample_ids[0] for b in batches] == [n * GLOBAL_BATCH for n in range(5)]
    with pytest.raises(ConfigError, match="1 warm-up \\+ 2 calibration window \\+ 3 counted steps"):
        step_batches(online, steps=3)


def test_trl_trains_our_tokens_and_shifted_labels(trainer, batches: list[StepBatch]) -> None:
    from workers.batch import shifted_targets

    for batch, micro_batches in zip(batches, _trl_steps(trainer, len(batches)), strict=True):
        ids = np.concatenate([np.asarray(mb["input_ids"][0]) for mb in micro_batches])
        labels = [np.asarray(mb["labels"][0]) for mb in micro_batches]
        # The causal-LM loss predicts labels[t + 1] at t over the packed row (transformers' ForCausalLMLoss).
        trl_targets = np.concatenate([np.append(lab[1:], -100) for lab in labels])
        assert ids.tolist() == [t for row in batch.rows for t in row.input_ids]
        ours = [shifted_targets(np.asarray(row.labels)) for row in batch.rows]
        assert trl_targets.tolist() == np.concatenate(ours).tolist()
        positions = np.concatenate([np.asarray(mb["position_ids"][0]) for mb in micro_batches])
        assert positions.tolist() == [p for row in batch.rows for p in range(row.num_tokens)]


def test_trl_normalizes_by_the_global_batch_label_tokens(trainer, batches: list[StepBatch]) -> None:
    from scheduling.payload import Sample

    first = _trl_steps(trainer, 1)[0]
    counted = trainer._get_num_items_in_batch(first, trainer.args.device)
    planner = sum(Sample(sample_id=r.index, input_ids=np.asarray(r.input_ids), labels=np.asarray(r.labels))
                  .num_label_tokens for r in batches[0].rows)
    assert int(counted) == planner


def test_trl_packed_loss_is_the_per_sequence_loss_over_global_label_tokens(trainer,
                                                                           batches: list[StepBatch]) -> None:
    """No sequence attends into another in TRL's padding-free rows: the loss of step 1 through TRL's own
    compute_loss equals transformers' causal-LM loss of each sequence alone, summed, / the step's label
    tokens (this project's loss, tests/test_train_step.py)."""
    import torch

    first = _trl_steps(trainer, 1)[0]
    total = trainer._get_num_items_in_batch(first, trainer.args.device)
    model = trainer.model
    with torch.no_grad():
        trl_loss = sum(float(trainer.compute_loss(model, dict(mb), num_items_in_batch=total)) for mb in first)
        alone = sum(float(model(input_ids=torch.tensor([row.input_ids]), labels=torch.tensor([row.labels]),
                                num_items_in_batch=total).loss) for row in batches[0].rows)
    assert trl_loss == pytest.approx(alone, rel=1e-5)


def test_trl_model_starts_from_the_workers_weights(config: SkrullConfig, trainer) -> None:
    import torch

    from app.model.spec import model_spec

    torch.manual_seed(12345)  # the build seeds itself (train.seed), whatever the global RNG state
    workers = model_spec(config.model, config.train, tokenizer=config.data.tokenizer).build()
    theirs = trainer.model.state_dict()
    assert trainer.model.config._attn_implementation == "sdpa"
    for name, tensor in workers.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize(("argv", "knob"), [
    (["--steps", "0"], "--steps=0"),
    (["--rounds", "0"], "--rounds=0"),
    (["--trl-micro-batch", "3"], "--trl-micro-batch=3"),
    (["--trl-micro-batch", "0"], "--trl-micro-batch=0"),
    (["--steps", "3"], "--steps=3"),  # 24 rows: 1 warm-up + 2 steps of 8 at most
])
def test_bad_arguments_exit_2_naming_the_argument(argv: list[str], knob: str, capsys) -> None:
    sets = [part for item in TINY for part in ("--set", item)]
    assert main(["bench", "peer", "--config", str(REPO / "configs/bench/cpu-lmsys.yaml"), *sets, *argv]) == 2
    assert knob in capsys.readouterr().err


def test_configs_whose_order_cannot_be_rebuilt_are_refused(config: SkrullConfig) -> None:
    from_file = dataclasses.replace(config.data, source="path", path="x.jsonl", shuffle=True)
    shuffled = dataclasses.replace(config, data=from_file)
    with pytest.raises(ConfigError, match="data.shuffle"):
        check_peer_config(shuffled)
    held_out = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_fraction=0.1))
    with pytest.raises(ConfigError, match="data.eval_fraction"):
        check_peer_config(held_out)


def _step(step: int, step_s: float, tokens: int, ids: list[int], loss: float = 2.0) -> dict:
    return {"step": step, "warmup": step <= WARMUP_STEPS, "step_s": step_s, "cpu_s": 2 * step_s, "loss": loss,
            "grad_norm": 1.0,
            "tokens": tokens, "trl_tokens": float(tokens), "sample_ids": ids}


def _round(trl_s: list[float], ours_s: list[float], tokens: list[int], ids: list[list[int]]) -> dict:
    trl = [_step(i + 1, s, t, x) for i, (s, t, x) in enumerate(zip(trl_s, tokens, ids, strict=True))]
    ours = [_step(i + 1, s, t, sorted(x))
            for i, (s, t, x) in enumerate(zip(ours_s, tokens, ids, strict=True))]
    setup = {"processes": 2, "dp_size": 1, "cp_size": 2, "bucket_size": 512, "torch_threads": 1,
             "attention_backend": "auto", "run_dir": "r"}
    trl_setup = {"trl": "x", "transformers": "y", "processes": 1, "torch_threads": 2, "micro_batch": 8,
                 "gradient_accumulation_steps": 4, "attention": "sdpa", "padding_free": True}
    return {"trl": {**trl_setup, "per_step": trl},
            "ours": {**setup, "per_step": {"skrull": ours, "balanced_packed": ours}}}


def test_summary_ratios_leave_out_the_warm_up_and_compare_the_same_batches() -> None:
    tokens, ids = [100, 300, 200], [[0, 1], [2, 3], [4, 5]]
    rounds = [_round([50.0, 3.0, 2.0], [40.0, 1.0, 1.0], tokens, ids),
              _round([50.0, 3.0, 2.0], [40.0, 1.5, 1.0], tokens, ids)]
    summary = summarize(rounds, wall_s=1.0, machine={}, out_dir="d")
    trl, skrull = summary["sides"]["trl"], summary["sides"]["skrull"]
    counted_tokens = np.median([300, 200, 300, 200])
    assert trl["tokens_per_s"] == pytest.approx(counted_tokens / np.median([3.0, 2.0, 3.0, 2.0]))
    assert skrull["tokens_per_s"] == pytest.approx(counted_tokens / np.median([1.0, 1.0, 1.5, 1.0]))
    assert skrull["vs_trl"] == pytest.approx(skrull["tokens_per_s"] / trl["tokens_per_s"])
    assert skrull["paired_vs_trl"] == pytest.approx(np.median([3.0, 2.0, 2.0, 2.0]))
    assert summary["same_samples"] and summary["same_tokens"] and summary["steps"] == 2
    rounds[1]["ours"]["per_step"]["skrull"][2]["sample_ids"] = [4, 6]
    assert summarize(rounds, wall_s=1.0, machine={}, out_dir="d")["same_samples"] is False


def test_the_checkpointing_switch_is_the_installed_transformers_own() -> None:
    """transformers 5.17 (a GPU image's) names it gradient_checkpointing, later versions
    activation_checkpointing: SFTConfig gets the one its TrainingArguments has."""
    from trl import SFTConfig

    from app.bench.peer.trl_side import _checkpointing_field

    @dataclasses.dataclass
    class Older:
        gradient_checkpointing: bool = False

    @dataclasses.dataclass
    class Newer:
        activation_checkpointing: bool = False

    assert _checkpointing_field(Older) == "gradient_checkpointing"
    assert _checkpointing_field(Newer) == "activation_checkpointing"
    assert _checkpointing_field(SFTConfig) in {field.name for field in dataclasses.fields(SFTConfig)}


def test_device_cuda_without_a_gpu_is_refused_before_anything_runs(capsys) -> None:
    """--device cuda puts both sides on GPUs in bf16; without one it is exit 2 at once."""
    import torch

    from app.__main__ import main
    from app.bench.peer.trl_side import trl_attention

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is for machines without one")
    assert main(["bench", "peer", "--device", "cuda", "--steps", "1"]) == 2
    assert "bench peer --device cuda: no CUDA device is visible to torch" in capsys.readouterr().err
    assert trl_attention("cpu") == "sdpa"


@pytest.mark.parametrize("side", ["our_side", "trl_side"])
def test_each_side_resolves_auto_as_the_command_does(side: str, monkeypatch, tmp_path: Path) -> None:
    """The GPU configs leave BucketSize and checkpointing to `auto`: each side (its own process) resolves
    them from memory as `bench peer` did (the same C), instead of failing on the unresolved config."""
    import importlib
    import json

    from app.profiling.budget import resolve_bucket_size

    module = importlib.import_module(f"app.bench.peer.{side}")
    seen = []
    runner = "run_ours" if side == "our_side" else "run_trl"
    monkeypatch.setattr(module, runner, lambda config, *args: seen.append(config) or {"side": side})
    sets = ["model.name_or_path=tiny-qwen2", "model.random_init=true", "data.source=synthetic",
            "data.shuffle=false", "parallel.num_workers=1", "parallel.cp_size=1"]
    extra = ["--micro-batch", "2"] if side == "trl_side" else []
    out = tmp_path / "side.json"
    argv = ["--config", "configs/qwen2.5-0.5b-gpu.yaml", *[a for s in sets for a in ("--set", s)],
            "--steps", "1", "--out", str(out), *extra]
    assert module.main(argv) == 0 and json.loads(out.read_text()) == {"side": side}
    (config,) = seen
    expected, _ = resolve_bucket_size(load_config("configs/qwen2.5-0.5b-gpu.yaml", sets))
    assert isinstance(config.scheduling.bucket_size, int)
    assert config.scheduling.bucket_size == expected.scheduling.bucket_size
    assert config.train.activation_checkpointing == expected.train.activation_checkpointing != "auto"
