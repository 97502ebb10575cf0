"""Validation loss: the held-out split (pure), the eval plans (pure), config errors, and one Ray run.

The Ray run is the suite's shared tiny run (tests/conftest.py `tiny_run`: DP 1 x CP 2, skrull,
data.eval_fraction=0.4, train.eval_every=2, train.log_every=3, 6 steps). It checks that held-out samples
never train, that eval_loss is reported exactly on the eval steps (2, 4 and the last, 6: steps 2 and 4 are
not log steps, so the eval forced their report), and that the last eval_loss equals the Hugging Face model's
own loss (standard attention, one unsharded sequence at a time) on the eval set with the run's final
weights, read back with DeepSpeed's zero_to_fp32.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from app.config import ConfigError, load_config
from app.data.resolved import resolve_data
from app.data.split import split_counts
from app.train.preflight import check_eval_every
from scheduling.eval_plan import plan_eval
from scheduling.holdout import held_out, splitmix64
from scheduling.payload import Sample
from tests.conftest import TINY_RUN_STEPS
from tests.run_configs import NO_EXPORT

NUM_SAMPLES = 24  # as the shared run's (tests/test_train_e2e.py)
BATCH = 4  # the pure and planning tests'; the shared run's global batches hold 8
FRACTION = 0.4


def test_splitmix64_matches_the_reference_implementation() -> None:
    """Vigna's splitmix64.c seeded with 1234567: its first five next() values (state += golden, mix)."""
    golden = 0x9E3779B97F4A7C15
    states = np.array([(1234567 + i * golden) % 2**64 for i in range(5)], dtype=np.uint64)
    assert splitmix64(states).tolist() == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                           4593380528125082431, 16408922859458223821]


def test_the_split_is_deterministic_disjoint_and_resumable() -> None:
    ids = np.arange(20000)
    mask = held_out(ids, seed=7, fraction=0.2)
    assert np.array_equal(mask, held_out(ids.copy(), seed=7, fraction=0.2))  # deterministic
    # Resume / another worker count: the planner asks id by id from any cursor; chunks give the same split.
    chunks = np.concatenate([held_out(ids[a:a + 997], seed=7, fraction=0.2) for a in range(0, len(ids), 997)])
    assert np.array_equal(mask, chunks)
    assert held_out([12345], seed=7, fraction=0.2)[0] == mask[12345]
    # Train and eval partition the ids; the eval share is binomial(n, 0.2): 4 sigma = 0.011.
    train, evaluation = set(ids[~mask].tolist()), set(ids[mask].tolist())
    assert not train & evaluation and len(train | evaluation) == len(ids)
    assert abs(mask.mean() - 0.2) < 0.011
    # Raising the fraction only adds eval samples; another seed draws an independent split (overlap ~ f^2).
    assert not (mask & ~held_out(ids, seed=7, fraction=0.3)).any()
    other = held_out(ids, seed=8, fraction=0.2)
    assert abs((mask & other).mean() - 0.04) < 0.006
    assert not held_out(ids, seed=7, fraction=0.0).any()


def _sample(sample_id: int, length: int) -> Sample:
    labels = np.arange(length, dtype=np.int64)
    labels[: length // 3] = -100  # a prompt without loss
    return Sample(sample_id=sample_id, input_ids=np.arange(length, dtype=np.int64) % 50, labels=labels)


@pytest.mark.parametrize("policy", ["skrull", "static_cp", "chunkflow"])
def test_the_eval_plan_covers_every_eval_sample_once_per_rank_group(policy: str) -> None:
    from app.config import SkrullConfig
    from app.profiling.hardware import cost_model

    samples = [_sample(i, n) for i, n in enumerate([30, 700, 12, 90, 5, 300, 41, 64, 1500, 8, 77])]
    planned = plan_eval(samples, policy=policy, batch_size=4, dp_size=2, cp_size=2, bucket_size=1024,
                        cost=cost_model(SkrullConfig()), spares=1)
    assert set(planned) == {(0, 0), (0, 1), (1, 0), (1, 1), (-1, 0)}
    for rank, payloads in planned.items():  # 11 samples in batches of 4: 4 + 4 + 3
        assert [p.step for p in payloads] == [1, 2, 3], rank
        assert [len(p.micro_batches) for p in payloads] == [len(q.micro_batches) for q in planned[0, 0]]
    ids = [i for p in planned[0, 0] for per_dp in p.sample_ids_by_dp_rank for i in per_dp]
    assert sorted(ids) == list(range(len(samples)))
    assert sum(p.global_label_tokens for p in planned[0, 0]) == sum(s.num_label_tokens for s in samples)
    assert all(not mb.input_ids for p in planned[-1, 0] for mb in p.micro_batches)  # a spare: nothing


def _config(tmp_path: Path, name: str, *overrides: str):
    return load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={tmp_path}", f"run.name={name}", f"data.num_samples={NUM_SAMPLES}",
        "data.length_scale=0.1", f"scheduling.global_batch_size={BATCH}", "train.steps=5", NO_EXPORT,
        *overrides,
    ])


@pytest.mark.parametrize("overrides, key", [
    (["data.eval_fraction=1.0"], "data.eval_fraction"),
    (["data.eval_fraction=-0.1"], "data.eval_fraction"),
    (["data.eval_fraction=0.1", "data.eval_path=x.jsonl"], "data.eval_fraction and data.eval_path"),
    (["train.eval_every=-1"], "train.eval_every"),
])
def test_bad_eval_keys_are_rejected_on_load(tmp_path: Path, overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        _config(tmp_path, "bad", *overrides)


def test_eval_every_needs_an_eval_set_and_eval_path_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.eval_every=2 needs an eval set"):
        check_eval_every(_config(tmp_path, "bad", "train.eval_every=2"))
    with pytest.raises(ConfigError, match="data.eval_path='/nonexistent/eval.jsonl' does not exist"):
        config = _config(tmp_path, "bad", "data.eval_path=/nonexistent/eval.jsonl", "train.eval_every=2")
        resolve_data(config.data, max_length=config.max_sequence_length)
    check_eval_every(_config(tmp_path, "ok", "data.eval_fraction=0.1", "train.eval_every=2"))


def test_an_eval_set_without_a_sample_is_an_error(tmp_path: Path) -> None:
    data = _config(tmp_path, "x", "data.eval_fraction=0.01").data
    with pytest.raises(ConfigError, match=r"data.eval_fraction=0.01 holds out no sample of the 5 usable"):
        split_counts(np.arange(5), data)
    counts = split_counts(np.arange(NUM_SAMPLES), dataclasses.replace(data, eval_fraction=FRACTION))
    expected = int(held_out(np.arange(NUM_SAMPLES), seed=0, fraction=FRACTION).sum())
    assert (counts.train_rows, counts.eval_rows) == (NUM_SAMPLES - expected, expected)


# ------------------------------------------------------------------------------------------ the Ray run


@pytest.fixture(scope="module")
def eval_run(tiny_run, local_ray):
    """The shared run: (its config, read back from its snapshot, its summary, its eval rows)."""
    summary, _ = tiny_run
    config = load_config(Path(summary.run_dir) / "skrull_config.json")
    assert config.data.eval_fraction == FRACTION and config.train.eval_every == 2
    return config, summary, _eval_rows(config)


def _eval_rows(config) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(sample id, input_ids, labels) of the held-out usable rows, from the run's own pipeline."""
    from app.data.pipeline import tokenized_dataset
    from scheduling.payload import USABLE_STATUSES

    data = resolve_data(config.data, max_length=config.max_sequence_length)
    rows = tokenized_dataset(data, num_cpus=0.5).iter_rows()
    usable = [(i, row) for i, row in enumerate(rows) if row["status"] in USABLE_STATUSES]
    mask = held_out([i for i, _ in usable], seed=config.data.seed, fraction=FRACTION)
    return [(i, np.asarray(row["input_ids"]), np.asarray(row["labels"]))
            for (i, row), out in zip(usable, mask, strict=True) if out]


def test_held_out_samples_never_train(eval_run) -> None:
    _, summary, eval_rows = eval_run
    eval_ids = {i for i, _, _ in eval_rows}
    assert len(eval_ids) == int(held_out(np.arange(NUM_SAMPLES), seed=0, fraction=FRACTION).sum()) == 7
    records = [json.loads(line) for line in Path(summary.run_dir, "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, TINY_RUN_STEPS + 1))
    trained = [i for r in records for i in r["sample_ids"]]
    assert not eval_ids & set(trained)
    # 48 trained samples out of 17 training rows: the whole rest trains (two epochs, then 14 of the next).
    assert len(trained) == TINY_RUN_STEPS * 8 and set(trained) == set(range(NUM_SAMPLES)) - eval_ids


def test_eval_loss_is_reported_on_eval_steps_and_equals_the_hf_models_loss(eval_run) -> None:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from app.model.spec import model_spec
    from workers.models import build_model

    config, summary, eval_rows = eval_run
    evals = {h["step"]: h["eval_loss"] for h in summary.history if "eval_loss" in h}
    assert sorted(evals) == [2, 4, TINY_RUN_STEPS], summary.history
    assert [h["step"] for h in summary.history] == list(range(1, TINY_RUN_STEPS + 1))

    spec = dataclasses.asdict(model_spec(config.model, config.train, tokenizer=config.data.tokenizer))
    for runtime_choice in ("attention_backend", "kernels", "compile"):  # ModelSpec.build's own exclusions
        del spec[runtime_choice]
    model = build_model(**spec, attn_implementation="eager")  # transformers' own attention, unsharded
    state = get_fp32_state_dict_from_zero_checkpoint(summary.checkpoint, tag=f"step{TINY_RUN_STEPS}")
    model.load_state_dict(state, strict=True)
    model.eval()
    loss_sum, label_tokens = 0.0, 0
    with torch.no_grad():
        for _, ids, labels in eval_rows:
            targets = int(np.count_nonzero(labels[1:] != -100))
            out = model(input_ids=torch.as_tensor(ids)[None], labels=torch.as_tensor(labels)[None])
            loss_sum += float(out.loss) * targets  # HF: the mean CE over the shifted label tokens
            label_tokens += targets
    # fp32 on both sides; only the summation order differs (chunked CE, ring attention merge): measured
    # 4.5e-8 relative here (2026-11-24).
    assert evals[TINY_RUN_STEPS] == pytest.approx(loss_sum / label_tokens, rel=1e-4)
    assert evals[2] != pytest.approx(evals[TINY_RUN_STEPS], rel=1e-3)  # each eval: the weights of its step


def test_an_eval_path_dataset_is_read_apart_and_planned_whole(eval_run, tmp_path: Path) -> None:
    """data.eval_path: tokenized by the run's pipeline, kept out of the training rows, planned in full."""
    import io

    import ray

    from app.train.components import planner_actor
    from app.train.dataset import prepared_data
    from app.train.preflight import preflight
    from scheduling.actor import PlannerData

    chats = [[{"role": "user", "content": f"question {i} " * (i + 1)},
              {"role": "assistant", "content": f"answer {i} " * (2 * i + 1)}] for i in range(5)]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    config = _config(tmp_path, "path", f"data.eval_path={path}", "train.eval_every=2")
    out = io.StringIO()
    data = prepared_data(config, preflight(config), progress=True, out=out, embedded=True)
    assert (data.usable_rows, data.eval_rows) == (NUM_SAMPLES, 5), out.getvalue()  # nothing held out
    eval_rows = list(data.eval_dataset.iter_rows())
    planner = planner_actor(config, PlannerData.put(data.dataset, data.eval_dataset), 1, "eval-path")
    try:
        payloads = [ray.get(ray.get(planner.eval_payloads.remote(1, 0, 0, cp))[0]) for cp in (0, 1)]
    finally:
        ray.kill(planner)
    # 5 samples in global batches of 4: 4 + 1, the ids are positions in the eval file.
    assert [len(p.sample_ids_by_dp_rank[0]) for p in payloads[0]] == [4, 1]
    assert sorted(i for p in payloads[0] for i in p.sample_ids_by_dp_rank[0]) == list(range(5))
    expected = sum(int(np.count_nonzero(np.asarray(r["labels"])[1:] != -100)) for r in eval_rows)
    assert sum(p.global_label_tokens for p in payloads[1]) == expected > 0
