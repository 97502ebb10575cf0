"""ZeRO-3: one step over DP 2 x CP 2 gloo ranks equals the single-process step over the same global batch.

The check of tests/test_train_step.py (same samples, same reference nobody here wrote: the Hugging Face
model's own forward with `labels` per sequence, autograd; plain SGD with lr 2^20, so the parameter change
read back is the gradient; fp32, same tolerance), with `train.zero_stage: 3` in the generated DeepSpeed
JSON: every weight is partitioned over the 4 ranks (the persistence threshold of a hidden size of 64 keeps
only norms and biases whole) and gathered by DeepSpeed's module hooks, the LM head's for the chunked loss
too (workers/loss.py LossHead). Each rank runs its own sequence lengths; ZeRO-3 needs the same module
forwards and backwards on every rank, which the plans' equal micro-batch counts and the idle micro-batch
give (workers/step.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from scheduling import DacpPlan, StepPlan, plan_step
from scheduling.payload import Cursor, build_rank_payloads
from tests.test_train_step import COST, LENGTHS, LR, MODEL, _reference_grads, _samples

# DP rank 0's first micro-batch has nothing for CP rank 1 (an idle micro-batch on it); its second shards
# sequence 3 over both CP ranks. DP rank 1 holds the other four, one micro-batch all sharded.
IDLE_PLAN = StepPlan(micro_batches=(
    (DacpPlan(local=((0, 1, 2), ()), distributed=()), DacpPlan(local=((), (4,)), distributed=(3,))),
    (DacpPlan(local=((5,), (6,)), distributed=()), DacpPlan(local=((), ()), distributed=(7,))),
))
CASES = {"skrull": None, "balanced_packed": None, "idle_cp_rank": IDLE_PLAN}


def _ds_config() -> dict:
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config

    train = load_config(None, ["train.grad_clip=0", "train.zero_stage=3"]).train
    config = deepspeed_config(train, dtype="fp32", on_gpu=False, hidden_size=64)
    del config["optimizer"]  # plain SGD below, so that the update is the gradient
    config["zero_allow_untested_optimizer"] = True
    return config


def _worker(rank: int, world: int, out_dir: str) -> dict[str, int]:
    """One of 4 ranks (DP 2 x CP 2); returns the elements of the weights this rank held after the step."""
    import torch.distributed as dist

    from workers.distributed import ParallelGroups
    from workers.engine import import_deepspeed, prepare_for_zero
    from workers.models import build_model
    from workers.step import run_step

    deepspeed = import_deepspeed()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    samples = _samples()
    held = {}
    for name, plan in CASES.items():
        groups = ParallelGroups.create(2)
        plan = plan or plan_step(name, LENGTHS, dp_size=2, cp_size=2, bucket_size=40, cost=COST)
        payloads = build_rank_payloads(plan, samples, step=1, epoch=0, cursor=Cursor(epoch=0, rows=8),
                                       plan_ms=0.0)
        model = build_model(**MODEL)
        model.train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = _ds_config()
        prepare_for_zero(model, config)
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        run_step(engine, payloads[groups.dp_rank, groups.cp_rank], groups, device=torch.device("cpu"),
                 loss_chunk_tokens=16)
        params = list(engine.module.named_parameters())
        held[name] = sum(p.numel() for _, p in params)  # gathered now: 0 for every partitioned weight
        with deepspeed.zero.GatheredParameters([p for _, p in params]):  # collective
            if rank == 0:
                grads = {n: (before[n] - p.detach()) / LR for n, p in params}
                torch.save(grads, Path(out_dir, f"{name}.pt"))
        dist.barrier()
    return held


@pytest.fixture(scope="module")
def zero3_grads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, int]]]:
    from workers.tools.launch import run_workers

    out_dir = tmp_path_factory.mktemp("zero3")
    return out_dir, run_workers(_worker, 4, args=(str(out_dir),), backend="gloo")


@pytest.mark.parametrize("case", list(CASES))
def test_one_zero3_step_equals_the_single_process_step(zero3_grads, case: str) -> None:
    out_dir, held = zero3_grads
    reference = _reference_grads()
    ours = torch.load(out_dir / f"{case}.pt")
    assert set(ours) == set(reference)
    for name, ref in reference.items():
        scale = ref.abs().max().item() + 1e-12  # tolerance: tests/test_train_step.py's, same reasoning
        diff = (ours[name] - ref).abs().max().item()
        assert diff <= 1e-5 * scale + 1e-9, f"{case}: {name} differs by {diff:.3g} (scale {scale:.3g})"
    # Partitioned: between steps a rank holds only the weights under the persistence threshold whole.
    total = sum(t.numel() for t in reference.values())
    assert all(rank[case] < total / 10 for rank in held), held
