"""The optimizer's state allocated before the warm-up (workers/optimizer_state.py) is the state torch's AdamW
would have created in its first step, and training from it is bit for bit training without it.

For each DeepSpeed optimizer the product runs, gloo ranks on CPU, the workers' own engine (build_engine from
the product's DeepSpeed JSON) and step (workers/step.py run_step), four planned global batches:

    bf16_zero1   one rank, bf16: DeepSpeed's BF16_Optimizer under the device step (fused AdamW)
    zero2        two ranks (CP 2), fp32: DeepSpeed's ZeRO-2 optimizer under the device step (fused AdamW)
    zero3        two ranks (CP 2), fp32: DeepSpeed's ZeRO-3 optimizer, its own step (torch's AdamW)

Each is built twice from the same seed and runs the warm-up micro-batch (workers/warmup.py) and the
steps: once as DeepSpeed leaves the optimizer (the state created lazily in step 1, the reference: torch's
and DeepSpeed's own code; the warm-up's allocation patched out) and once as the product runs it. The step
losses and the fp32 master weights after the last step must be identical (torch.equal); the state must be
AdamW's first (exp_avg and exp_avg_sq zero, of every master's shape, step 0), held before step 1 and not
grown by it; and the tensor ledger (workers/tools/tensor_ledger.py) must find all of it live at the
warm-up's peak.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.planned_steps import planned_steps
from tests.test_fast_step import LENGTHS, SPEC, STEPS, VOCAB

WARMUP_TOKENS = 48
KINDS = {  # name: (world size, dtype, config overrides)
    "bf16_zero1": (1, "bf16", ["train.optimizer_impl=fused"]),
    "zero2": (2, "fp32", ["train.optimizer_impl=fused"]),
    "zero3": (2, "fp32", ["train.zero_stage=3"]),
}


def _state_bytes(inner: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if torch.is_tensor(t))


def _masters(optimizer, clone: bool = True) -> list[torch.Tensor]:
    from workers.optimizer_state import inner_optimizer, masters_by_group

    groups = masters_by_group(optimizer, inner_optimizer(optimizer))
    return [t.detach().clone() if clone else t for index in sorted(groups) for t in groups[index]]


def _train(kind: str, eager: bool, groups, payloads: list) -> dict:
    import workers.warmup
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from workers.engine import build_engine
    from workers.models import ModelSpec
    from workers.optimizer_state import allocate_optimizer_state, inner_optimizer
    from workers.step import run_step
    from workers.tools.tensor_ledger import DeviceLedger

    _, dtype, overrides = KINDS[kind]
    # weight decay, so that the allocating step's lr of 0 is what keeps the weights
    config = load_config(None, [*overrides, "train.lr=0.003", "train.weight_decay=0.1"])
    ds = deepspeed_config(config.train, dtype=dtype, on_gpu=False, hidden_size=SPEC["hidden_size"])
    engine = build_engine(ModelSpec(**SPEC, dtype=dtype), ds, torch.device("cpu"), seed=0)
    inner = inner_optimizer(engine.optimizer)
    out: dict = {"optimizer": type(engine.optimizer).__name__, "inner": type(inner).__name__}
    before = _masters(engine.optimizer)
    allocate = workers.warmup.allocate_optimizer_state
    if not eager:  # DeepSpeed's own behaviour: the state appears in step 1
        workers.warmup.allocate_optimizer_state = lambda optimizer: False
    try:
        # The ledger counts what the warm-up holds beyond the built engine. Weights and masters are left
        # out: AdamW updates them in place, and an in-place op's output would count them as new storages.
        ledger = DeviceLedger()
        ledger.exclude([*engine.module.parameters(), *_masters(engine.optimizer, clone=False)])
        with ledger:
            workers.warmup.warm_up(engine, groups, torch.device("cpu"), tokens=WARMUP_TOKENS,
                                   loss_chunk_tokens=16)
    finally:
        workers.warmup.allocate_optimizer_state = allocate
    out["warmup_peak"] = ledger.peak
    if eager:  # the state exists: nothing to do
        out["again"] = allocate_optimizer_state(engine.optimizer)
    out["weights_kept"] = all(torch.equal(a, b) for a, b in zip(before, _masters(engine.optimizer),
                                                                strict=True))
    out["state"] = [{key: (value.clone() if torch.is_tensor(value) else value) for key, value in s.items()}
                    for s in inner.state.values()]
    out["shapes"] = [tuple(t.shape) for t in before]
    out["state_bytes"] = [_state_bytes(inner)]
    losses = []
    for payload in payloads:
        mine = payload[0, groups.cp_rank]
        stats = run_step(engine, mine, groups, device=torch.device("cpu"), loss_chunk_tokens=16)
        losses.append(float(stats.loss_sum))
        out["state_bytes"].append(_state_bytes(inner))
    out["losses"] = losses
    out["masters"] = _masters(engine.optimizer)
    return out


def _worker(rank: int, world: int, kinds: list[str]) -> dict:
    from workers.distributed import ParallelGroups

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(world)
    payloads = planned_steps(LENGTHS, vocab=VOCAB, bucket_size=64, cp_size=world)
    return {kind: {eager: _train(kind, eager, groups, payloads) for eager in (False, True)} for kind in kinds}


@pytest.fixture(scope="module")
def runs() -> dict:
    from workers.tools.launch import run_workers

    by_world: dict[int, list[str]] = {}
    for kind, (world, _, _) in KINDS.items():
        by_world.setdefault(world, []).append(kind)
    results: dict = {}
    for world, kinds in by_world.items():
        results.update(run_workers(_worker, world, args=(kinds,), backend="gloo")[0])
    return results


@pytest.mark.parametrize("kind", list(KINDS))
def test_allocated_state_trains_bit_for_bit_as_lazy_state(runs: dict, kind: str) -> None:
    lazy, eager = runs[kind][False], runs[kind][True]
    expected = {"bf16_zero1": "BF16_Optimizer", "zero2": "DeepSpeedZeroOptimizer",
                "zero3": "DeepSpeedZeroOptimizer_Stage3"}[kind]
    assert lazy["optimizer"] == eager["optimizer"] == expected and eager["inner"] == "AdamW"
    assert len(lazy["losses"]) == STEPS == len(LENGTHS)
    assert eager["losses"] == lazy["losses"], (eager["losses"], lazy["losses"])
    assert all(torch.equal(a, b) for a, b in zip(eager["masters"], lazy["masters"], strict=True))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_warm_up_holds_adamws_first_state(runs: dict, kind: str) -> None:
    lazy, eager = runs[kind][False], runs[kind][True]
    assert not eager["again"] and eager["weights_kept"] and lazy["weights_kept"]
    assert lazy["state"] == [] and len(eager["state"]) == len(eager["shapes"])
    for state, shape in zip(eager["state"], eager["shapes"], strict=True):
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == 0.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert tuple(state[key].shape) == shape and state[key].dtype == torch.float32
            assert not state[key].any()
    # Lazily the state appears in step 1; allocated, it is all there before and step 1 adds nothing.
    state_bytes = eager["state_bytes"][0]
    assert lazy["state_bytes"][0] == 0 and state_bytes == lazy["state_bytes"][1]
    assert len(set(eager["state_bytes"])) == 1
    assert state_bytes >= 8 * sum(torch.Size(s).numel() for s in eager["shapes"])
    # The tensor ledger over the warm-up: its peak holds the whole state beside the micro-batch's own.
    assert eager["warmup_peak"] - lazy["warmup_peak"] == state_bytes, (eager["warmup_peak"],
                                                                      lazy["warmup_peak"], state_bytes)
