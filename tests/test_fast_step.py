"""The GPU-speed knobs train the same losses as today's path, and a training step never waits on the host.

Two gloo ranks (DP 1 x CP 2: the ring runs, ZeRO reduces over both ranks), fp32, the workers' own engine
(workers/engine.py build_engine from the product's DeepSpeed JSON) and step (workers/train_loop.py
fetch_and_step with its metrics window and non-finite guard; a stub stands in for the planner actor), four
planned global batches, metrics flushed on step 4 only (train.log_every=4):

    today     DeepSpeed's own ZeRO step, torch's default AdamW, no warm-up micro-batch (the path before)
    foreach   torch's foreach AdamW under DeepSpeed's step, with the warm-up micro-batch
    fused     torch's fused AdamW under the device step (workers/zero_step.py), warm-up
    compiled  fused + every decoder layer compiled, the DACP attention as the custom op (workers/compile.py;
              the AOT-autograd backend here: what dynamo captures, the op's fake and autograd; inductor's
              own code generation is checked on one process below)

Each variant's step losses and gradient norms must equal today's within 1e-5 relative (fp32: the same sums
in other orders). The host-sync counter is a TorchDispatchMode over steps 1-3 that counts every op that
makes the host wait for a device result: `_local_scalar_dense` (behind .item(), bool(t), float(t)),
`is_nonzero`, `equal`, and the data-dependent-shape ops (`nonzero`, `masked_select`, `unique`, boolean
indexing); `Tensor.tolist` and `Tensor.numpy` are counted by patching. On CPU none of them waits for
anything, but each is exactly what waits on a GPU (torch.cuda.set_sync_debug_mode flags the same calls).
Today's path makes such calls (DeepSpeed's overflow scan and norm checks): the counter sees them, so a zero
for the new path is a measurement, not an empty check.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.planned_steps import planned_steps

VOCAB = 96
SPEC = {"name_or_path": "tiny-qwen2", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "seed": 5}
STEPS = 4
LENGTHS = ([30, 7, 12, 5], [9, 40, 3, 11], [22, 6, 17, 8], [13, 28, 4, 10])
VARIANTS = {
    "today": ({"train.optimizer_impl": "auto"}, 0, False),
    "foreach": ({"train.optimizer_impl": "foreach"}, 48, False),
    "fused": ({"train.optimizer_impl": "fused"}, 48, False),
    "compiled": ({"train.optimizer_impl": "fused", "train.compile": "true"}, 48, True),
}
SYNCING_OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2",
               "unique_consecutive", "unique_dim")


def _payloads(cp_size: int) -> list:
    # bucket 32 per rank: the 40-token sequence is sharded over both ranks (the ring), short ones local
    return planned_steps(LENGTHS, vocab=VOCAB, bucket_size=32, cp_size=cp_size)


class _Planner:
    """Stands in for PlannerClient: this rank's payload of a step, already planned."""

    def __init__(self, payloads: list) -> None:
        self.payloads = payloads

    def fetch(self, step: int, dp_rank: int, cp_rank: int):
        from scheduling.actor import Fetched

        return Fetched(payload=self.payloads[step - 1][dp_rank, cp_rank], wait_s=0.0, ahead_steps=1)


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that make the host wait for the device (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        boolean_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()))
        if name in SYNCING_OPS or boolean_index:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _count_host_reads(counter: SyncCounter):
    """Tensor.tolist / Tensor.numpy also read device memory from the host: counted while patched."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def counting(name):
        def read(self, *args, **kwargs):
            counter.calls.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    for name in originals:
        setattr(torch.Tensor, name, counting(name))
    return originals


def _dynamo_on() -> None:
    """tests/conftest.py turns dynamo off for the suite (TORCHDYNAMO_DISABLE, read by torch.compile and at
    import): on again in this process."""
    import torch._dynamo

    os.environ.pop("TORCHDYNAMO_DISABLE", None)
    torch._dynamo.config.disable = False


def _compile_with_aot_eager() -> None:
    """In this test process train.compile traces with the AOT-autograd backend (no code generation)."""
    import workers.compile

    _dynamo_on()
    workers.compile.BACKEND = "aot_eager"


def _variant_run(rank: int, world: int, name: str, payloads: list) -> dict:
    import torch._dynamo

    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from workers.distributed import ParallelGroups
    from workers.engine import build_engine
    from workers.metrics import MetricsWindow
    from workers.models import ModelSpec
    from workers.nonfinite import NonFiniteGuard, NonFinitePolicy
    from workers.train_loop import WorkerSettings, fetch_and_step
    from workers.warmup import warm_up

    overrides, warmup_tokens, compiled = VARIANTS[name]
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()] + ["train.lr=0.003"])
    ds = deepspeed_config(config.train, dtype="fp32", on_gpu=False)
    groups = ParallelGroups.create(2)
    engine = build_engine(ModelSpec(**SPEC, compile=compiled), ds, torch.device("cpu"), seed=0)
    warm_up(engine, groups, torch.device("cpu"), tokens=warmup_tokens, loss_chunk_tokens=16)
    settings = WorkerSettings(model=ModelSpec(**SPEC), deepspeed=ds, cp_size=2, total_steps=STEPS,
                              loss_chunk_tokens=16, checkpoint_every=0, log_every=STEPS, run_dir="",
                              planner=None)
    device = torch.device("cpu")
    window, guard, planner = MetricsWindow(), NonFiniteGuard(NonFinitePolicy(), ""), _Planner(payloads)
    counter = SyncCounter()
    for step in range(1, STEPS + 1):
        if step < STEPS:  # the steps between log steps
            originals = _count_host_reads(counter)
            with counter:
                fetch_and_step(settings, planner, engine, groups, device, window, step, guard=guard)
            for attr, method in originals.items():
                setattr(torch.Tensor, attr, method)
        else:
            fetch_and_step(settings, planner, engine, groups, device, window, step, guard=guard)
    metrics = window.flush(groups.world_group)
    guard.review(metrics)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.utils.counters.clear()
    return {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics],
            "graphs": graphs,
            "skipped": [m["update_skipped"] for m in metrics], "syncs": counter.calls,
            "optimizer": type(engine.optimizer.optimizer).__name__,
            "device_step": hasattr(engine.optimizer, "skrull_applied")}


def _worker(rank: int, world: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _compile_with_aot_eager()
    payloads = _payloads(2)
    return {name: _variant_run(rank, world, name, payloads) for name in VARIANTS}


@pytest.fixture(scope="module")
def runs() -> dict:
    from workers.tools.launch import run_workers

    ranks = run_workers(_worker, 2, backend="gloo")
    return ranks[0]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "today"])
def test_each_knob_trains_todays_losses(runs: dict, variant: str) -> None:
    today, ours = runs["today"], runs[variant]
    assert not any(today["skipped"]) and not any(ours["skipped"])
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(today[key], ours[key], strict=True), start=1):
            assert abs(a - b) <= 1e-5 * abs(a), f"{variant}: step {step} {key} {b} vs today's {a}"
    assert ours["device_step"] == (variant in ("fused", "compiled"))
    # compiled: dynamo captured the layers (one graph for every length, one for the one-token idle batch)
    assert (ours["graphs"] > 0) == (variant == "compiled") and ours["graphs"] <= 2, ours["graphs"]


def test_no_host_sync_between_log_steps_with_the_device_step(runs: dict) -> None:
    assert runs["fused"]["syncs"] == [], runs["fused"]["syncs"]
    assert runs["compiled"]["syncs"] == [], runs["compiled"]["syncs"]
    # DeepSpeed's own step reads the device (overflow scan, norm checks): the counter sees those reads.
    assert len(runs["today"]["syncs"]) >= STEPS - 1, runs["today"]["syncs"]


def test_inductor_compiles_a_layer_once_for_every_length_and_matches_eager(monkeypatch) -> None:
    """train.compile with torch's default backend (inductor: generated C++ on CPU), one process: losses and
    gradients equal the eager model's within 1e-5, and new micro-batch lengths reuse the graph (dynamic
    shapes); the one-token idle micro-batch is torch's one specialization."""
    import torch._dynamo

    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.forward import micro_batch_loss_sum
    from workers.models import ModelSpec

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.setattr(torch._dynamo.config, "disable", False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs other tests of this process compiled
    eager = ModelSpec(**SPEC).build_on(torch.device("cpu"))
    compiled = ModelSpec(**SPEC, compile=True).build_on(torch.device("cpu"))

    def loss_and_grads(model, lengths):
        rng = np.random.default_rng(len(lengths))
        ids = [rng.integers(1, VOCAB, size=n) for n in lengths]
        plan = DacpPlan(local=(tuple(range(len(lengths))),), distributed=())
        batch = build_rank_batch(plan, ids, [i.copy() for i in ids], cp_rank=0, cp_size=1)
        model.zero_grad(set_to_none=True)
        loss = micro_batch_loss_sum(model, batch)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    for lengths in ([5, 17, 30], [41, 3], [100, 7, 9, 12]):
        (a, ga), (b, gb) = loss_and_grads(eager, lengths), loss_and_grads(compiled, lengths)
        assert abs(a - b) <= 1e-5 * abs(a)
        for x, y in zip(ga, gb, strict=True):
            assert (x - y).abs().max() <= 1e-5 * x.abs().max() + 1e-9
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, f"{frames} graphs for 3 lengths: the token count must be a dynamic size"


def test_the_warm_up_adds_exact_zeros(tmp_path: Path) -> None:
    """warm_up's micro-batch leaves ZeRO's accumulated gradient at exactly zero (its loss is multiplied by 0),
    so the first step's gradient is the step's own (today's `fused` and `today` runs agree above as well):
    ZeRO-2's fp32 partition, and the fp32 sums of the BF16_Optimizer that one worker runs in bf16; and the
    optimizer's state exists before that micro-batch runs."""
    from workers.tools.launch import run_workers

    (grads,) = run_workers(_warm_up_worker, 1, backend="gloo")
    assert grads["abs_sum"] == 0.0 and grads["micro_step_id"] == 0
    assert grads["bf16_zero1_abs_sum"] == 0.0  # one worker's ZeRO-1 in bf16: BF16_Optimizer's fp32 sums
    # the optimizer's state was allocated before the micro-batch (workers/optimizer_state.py)
    assert all(n > 0 for n in grads["optimizer_state"]), grads["optimizer_state"]


def _warm_up_worker(rank: int, world: int) -> dict:
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from workers.distributed import ParallelGroups
    from workers.engine import build_engine
    from workers.models import ModelSpec
    from workers.warmup import warm_up

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    ds = deepspeed_config(load_config(None, []).train, dtype="fp32", on_gpu=False)
    groups = ParallelGroups.create(1)
    engine = build_engine(ModelSpec(**SPEC), ds, torch.device("cpu"), seed=0, one_rank_zero1=False)
    warm_up(engine, groups, torch.device("cpu"), tokens=64, loss_chunk_tokens=16)
    flat = engine.optimizer.averaged_gradients
    total = sum(float(g.abs().sum()) for grads in flat.values() if grads is not None for g in grads)
    bf16 = deepspeed_config(load_config(None, []).train, dtype="bf16", on_gpu=False)
    zero1 = build_engine(ModelSpec(**SPEC, dtype="bf16"), bf16, torch.device("cpu"), seed=0)
    warm_up(zero1, groups, torch.device("cpu"), tokens=64, loss_chunk_tokens=16)
    sums = zero1.optimizer.fp32_groups_gradients_flat
    return {"abs_sum": total, "micro_step_id": engine.optimizer.micro_step_id,
            "bf16_zero1_abs_sum": sum(float(g.abs().sum()) for g in sums),
            "optimizer_state": [len(e.optimizer.optimizer.state) for e in (engine, zero1)]}
