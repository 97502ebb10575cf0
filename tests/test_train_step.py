"""One DeepSpeed ZeRO-2 step over 2 gloo ranks equals one single-process step over the same global batch.

The reference nobody here wrote: the Hugging Face model's own forward with `labels` on each whole sequence
(its default attention), loss = sum of per-sequence CE sums / label tokens of the global batch, autograd.
The distributed side is our whole step: planner payloads, batch assembly, DACP attention, idle micro-batches,
loss scaling, DeepSpeed's gradient averaging over all DP x CP ranks. With plain SGD (no clipping)
the parameter change is the gradient times lr, so the check reads gradients out of a ZeRO-2 engine; lr is a
large power of two so that fp32 rounding of `p - lr * g` (half an ulp of p ~ 6e-8 for p ~ 1) is negligible
against lr * g, and dividing by it is exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from scheduling import CostModel, DacpPlan, StepPlan, plan_step
from scheduling.payload import IGNORE_INDEX, Cursor, Sample, build_rank_payloads

LENGTHS = [5, 17, 2, 33, 9, 1, 24, 12]
VOCAB = 128
MODEL = {"name_or_path": "tiny-qwen2", "vocab_size": VOCAB, "dtype": "fp32", "seed": 3}
LR = 2.0**20
COST = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=32, num_layers=2)

# (dp_size, cp_size, plan, activation checkpointing): skrull's own plan, a hand-made CP plan where CP rank 1
# has nothing in the first micro-batch (an idle micro-batch) and rank 0 holds only shards in the second, and
# skrull's plan again with every decoder layer recomputed in backward (the ring runs twice per layer).
HAND_PLAN = StepPlan(micro_batches=((
    DacpPlan(local=((0, 1, 2), ()), distributed=()),
    DacpPlan(local=((), (4, 5)), distributed=(3, 6, 7)),
),))
CASES = {
    "dp2_cp1_skrull": (2, 1, None, False),
    "dp1_cp2_skrull": (1, 2, None, False),
    "dp1_cp2_idle_rank": (1, 2, HAND_PLAN, False),
    "dp1_cp2_recompute": (1, 2, None, True),
}
# 3 workers with cp_size 2 (an elastic run offered a size that is not a multiple of CP): DP 1 x CP 2 train,
# world rank 2 is a spare that runs only idle micro-batches; the gradient must be the same.
SPARE_CASES = {"dp1_cp2_one_spare": (1, 2, None, False)}


def _samples() -> list[Sample]:
    rng = np.random.default_rng(7)
    samples = []
    for i, length in enumerate(LENGTHS):
        ids = rng.integers(1, VOCAB, size=length)
        labels = ids.copy()
        labels[: length // 3] = IGNORE_INDEX  # an unlabeled "prompt"
        samples.append(Sample(sample_id=i, input_ids=ids, labels=labels))
    return samples


def _ds_config() -> dict:
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config

    config = deepspeed_config(load_config(None, ["train.grad_clip=0"]).train, dtype="fp32", on_gpu=False)
    del config["optimizer"]  # the test passes plain SGD so that the update is the gradient
    config["zero_allow_untested_optimizer"] = True
    return config


def _reference_grads() -> dict[str, torch.Tensor]:
    from workers.models import build_model

    model = build_model(**MODEL, attn_implementation="sdpa")
    samples = _samples()
    label_tokens = sum(s.num_label_tokens for s in samples)
    total = 0.0
    for s in samples:
        ids = torch.as_tensor(s.input_ids)[None]
        out = model(input_ids=ids, labels=torch.as_tensor(s.labels)[None], use_cache=False)
        total = total + out.loss * s.num_label_tokens if s.num_label_tokens else total
    (total / label_tokens).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _worker(rank: int, world: int, out_dir: str, cases: dict) -> None:
    """One rank (workers/tools/launch.py run_workers: the gloo world group is up)."""
    import torch.distributed as dist

    from scheduling.payload import spare_payload
    from workers.distributed import ParallelGroups
    from workers.engine import import_deepspeed
    from workers.models import build_model
    from workers.step import run_step

    deepspeed = import_deepspeed()  # as a train worker imports it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as Ray Train sets them
    samples = _samples()
    for name, (dp, cp, plan, recompute) in cases.items():
        groups = ParallelGroups.create(cp)
        assert (groups.dp_size, groups.spares) == (dp, world - dp * cp)
        plan = plan or plan_step("skrull", LENGTHS, dp_size=dp, cp_size=cp, bucket_size=40, cost=COST)
        payloads = build_rank_payloads(plan, samples, step=1, epoch=0, cursor=Cursor(epoch=0, rows=8),
                                       plan_ms=0.0)
        model = build_model(**MODEL, activation_checkpointing=recompute)
        model.train()  # transformers only recomputes in training mode
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine, *_ = deepspeed.initialize(model=model, config=_ds_config(),
                                          optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        payload = (spare_payload(payloads[0, 0], 0) if groups.is_spare
                   else payloads[groups.dp_rank, groups.cp_rank])
        run_step(engine, payload, groups, device=torch.device("cpu"), loss_chunk_tokens=16)
        if rank == 0:
            grads = {n: (before[n] - p.detach()) / LR for n, p in engine.module.named_parameters()}
            torch.save(grads, Path(out_dir, f"{name}.pt"))
        dist.barrier()


@pytest.fixture(scope="module")
def distributed_grads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tools.launch import run_workers

    out_dir = tmp_path_factory.mktemp("step")
    run_workers(_worker, 2, args=(str(out_dir), CASES), backend="gloo")
    run_workers(_worker, 3, args=(str(out_dir), SPARE_CASES), backend="gloo")
    return out_dir


@pytest.mark.parametrize("case", list(CASES) + list(SPARE_CASES))
def test_one_step_equals_the_single_process_step(distributed_grads: Path, case: str) -> None:
    reference = _reference_grads()
    ours = torch.load(distributed_grads / f"{case}.pt")
    assert set(ours) == set(reference)
    for name, ref in reference.items():
        # fp32: the sharded run sums the same terms in another order (ring LSE merges, chunked CE, gloo
        # reductions), ~1e-7 relative per op; 1e-5 of the tensor's scale leaves room for 2 layers of that.
        scale = ref.abs().max().item() + 1e-12
        diff = (ours[name] - ref).abs().max().item()
        assert diff <= 1e-5 * scale + 1e-9, f"{case}: {name} differs by {diff:.3g} (scale {scale:.3g})"


def test_deepspeed_ops_are_cached_per_python_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine import use_extensions_cache_per_environment

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    mine = use_extensions_cache_per_environment()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == mine
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr("sys.prefix", "/opt/another-venv")
    other = use_extensions_cache_per_environment()
    assert other != mine and Path(other).parent == Path(mine).parent
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/users/choice")
    assert use_extensions_cache_per_environment() == "/users/choice"  # a user's setting is kept
