"""The measurements behind `python -m app profile`, run on every worker of a Ray Train worker group.

`profile_loop_per_worker` is a Ray Train loop: `profile` starts the same TorchTrainer as `train`
(app/train/components.py `make_trainer`: same resources per worker, process group backend and timeouts),
so every number below is taken in the process tree training runs in. That matters on a small host: Ray
starts its workers at a lower scheduling priority than its own daemons (raylet's worker_niceness, 15) and
beside them, and the same planned steps took 11-29% longer in Ray Train workers than in plain
torch.distributed processes (docs/benchmarks.md §0b).

Every rank builds the configured model (same spec, dtype and attention backend as a training worker)
and, all ranks at once as in training (on a CPU host they share its cores, as training workers do):

    compute     forward+backward of packed single-rank streams over a grid of sizes, sequence mixes and
                label fractions through the DeepSpeed engine, as a training micro-batch runs (ZeRO-2's
                hooks and per-micro-batch gradient all-reduce included; workers/tools/profile_compute.py);
                per case the slowest rank's median
    ring        one ring step of the CP group (the DACP attention's RingComm) over message sizes
    overlap     a ring step of a layer's K/V shard beside the local attention of a packed stream, as the
                DACP attention runs them (started ring, local attention, wait)
    reduce      one micro-batch's ZeRO-2 gradient reduction of the model's parameters over all ranks
    optimizer   DeepSpeed's `engine.step()` (ZeRO-2 partitioned Adam + parameter all-gather)
    memory      peak memory of forward+backward above the memory before it, per stream size, with no
                layer recomputed ("memory"), every layer recomputed ("memory_checkpointed") and, on CUDA,
                recomputed with the saved inputs in host memory ("memory_offloaded"): one model, built
                as a worker builds it (its kernel set, its layers compiled under train.compile), its
                transformers checkpointing switched between the passes; on CUDA also the device memory the
                run's tensors can have (free + what the caching allocator holds: the total less the CUDA
                context, NCCL and other processes), the least over ranks, read after everything else ran
    steps       whole training steps (`run_step`: every micro-batch of a planned payload, then the
                optimizer step) of the payloads app/profiling/steps.py planned, after one untimed step;
                per step the median over rounds of the slowest rank's time

The returned rows are raw: app/commands/profile.py fits them into a hardware profile.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scheduling.payload import RankPayload, spare_payload
from workers.attention.index import VarlenBlock
from workers.distributed import ParallelGroups
from workers.engine import DeepSpeedConfig, ZeroGroups, build_engine
from workers.models import ModelSpec, enable_checkpointing
from workers.step import run_step, synchronize
from workers.tools.profile_comm import measure_grad_reduce, measure_overlap, measure_ring
from workers.tools.profile_compute import label_tokens, time_micro_batch
from workers.tools.profile_memory import allocator_capacity_bytes, measure_activation_memory

WHOLE_STEP_ROUNDS = 3
"""Timings of every planned whole step (the median is kept). One timing each left the step scale to a
single window of host noise: the same 6 steps measured up to 14% apart between two profiles 10 minutes
apart, moving the scale from 1.18 to 1.11 (docs/benchmarks.md §0)."""

RING_REPEATS = 50
"""Timed ring steps per message size (each well under a millisecond on any host)."""


def ring_sizes(layer_kv_bytes: int) -> tuple[int, ...]:
    """Messages from 1/256 to 4x a full bucket's per-layer K/V shard (at least 4 KiB): the sizes the DACP
    ring of this model moves, from latency-bound to bandwidth-bound."""
    return tuple(sorted({max(4096, int(layer_kv_bytes * 4.0**k)) for k in range(-4, 2)}))


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileSettings:
    model: ModelSpec
    deepspeed: DeepSpeedConfig
    cp_size: int
    cases: tuple[tuple[tuple[int, ...], float], ...]
    """(sequence lengths of one packed stream, label fraction) per compute case."""
    memory_cases: tuple[tuple[int, ...], ...]
    kv_hidden_size: int
    repeats: int = 3
    loss_chunk_tokens: int = 4096
    timeout_s: float = 600.0
    seed: int = 0
    steps: tuple[dict[tuple[int, int], RankPayload], ...] = ()
    """Per whole step to time, the payload of every (dp_rank, cp_rank)."""
    overlap_comm: str = "auto"
    """train.overlap_comm (workers/engine.py for_world_size)."""
    one_rank_zero1: bool = True
    """train.one_rank_zero1 (workers/engine.py for_world_size)."""


def _slowest(seconds: float, device: torch.device) -> float:
    """The max over all ranks: a step waits for its slowest rank."""
    return _over_ranks(seconds, device, dist.ReduceOp.MAX)


def _over_ranks(value: float, device: torch.device, op: dist.ReduceOp) -> float:
    """`value` reduced by `op` over all ranks (collective)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def _compute_rows(engine: Any, s: ProfileSettings, groups: ParallelGroups,
                  device: torch.device) -> list[dict]:
    """Per case, the slowest rank's median micro-batch time through the DeepSpeed engine (what a training
    micro-batch costs: forward, backward, ZeRO-2's hooks and gradient reduction over all ranks).

    The cases are interleaved, one pass of each per round (A B C ... A B C ...), as `bench train`
    interleaves its policies: a slow spell of a shared host (a daemon waking up, a frequency change) then
    lands in one pass of many cases, which the median drops, instead of in every pass of the case that
    happened to run then (run back to back, one case measured 15% slower than a case with more work)."""
    times: list[list[float]] = [[] for _ in s.cases]
    for round_ in range(s.repeats):
        for case, (lengths, fraction) in enumerate(s.cases):
            times[case] += time_micro_batch(engine.module, lengths, repeats=1, warmup=int(round_ == 0),
                                            loss_chunk_tokens=s.loss_chunk_tokens,
                                            runtime=groups.attention.single_rank(), label_fraction=fraction,
                                            seed=s.seed, engine=engine)
    return [{"lengths": list(lengths), "labels": label_tokens(lengths, fraction), "tokens": int(sum(lengths)),
             "label_fraction": fraction, "seconds_median": _slowest(statistics.median(seconds), device)}
            for (lengths, fraction), seconds in zip(s.cases, times, strict=True)]


def _overlap_row(model: torch.nn.Module, s: ProfileSettings, groups: ParallelGroups, device: torch.device,
                 ring: list[dict]) -> dict:
    """The ring beside the local attention of the largest compute stream, with a message sized so that
    the ring alone takes about as long as the attention alone: the overlap share is min-normalized, so a
    ring far shorter than the compute would leave it to timing noise."""
    tokens = max(sum(lengths) for lengths, _ in s.cases)
    heads = model.config.num_attention_heads
    head_dim = model.config.hidden_size // heads
    kv_heads = model.config.num_key_value_heads
    q = torch.randn(tokens, heads, head_dim, dtype=_dtype(model), device=device)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=_dtype(model), device=device)
    block = VarlenBlock.build((0, tokens), (0, tokens), causal=True, device=device)  # once, as a batch does
    kernel = groups.attention.kernel

    def local_attention() -> None:
        kernel.forward(q, k, k, block, scale=head_dim**-0.5)

    kv_bytes = 2 * (tokens // s.cp_size) * s.kv_hidden_size * _element_size(model)
    repeats = 2 * s.repeats + 1
    first = measure_overlap(groups.attention.comm, kv_bytes, local_attention, repeats=repeats, device=device)
    big, small = ring[-1], ring[0]
    bandwidth = (big["bytes"] - small["bytes"]) / max(big["seconds_p25"] - small["seconds_p25"], 1e-9)
    matched = int(min(max(first["compute_s"] * bandwidth, kv_bytes), ring[-1]["bytes"]))
    row = measure_overlap(groups.attention.comm, matched, local_attention, repeats=repeats, device=device)
    return {**row, "bytes": matched, "layer_kv_bytes": kv_bytes}


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _element_size(model: torch.nn.Module) -> int:
    return torch.empty((), dtype=_dtype(model)).element_size()


def _optimizer_step_s(engine: Any, s: ProfileSettings, device: torch.device) -> dict:
    """Median seconds of engine.step() after one micro-batch (gradients present, as in training)."""
    params = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    times = []
    for _ in range(1 + s.repeats):
        ids = torch.randint(0, engine.module.config.vocab_size, (1, 64), device=device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss)
        synchronize(device)
        started = time.perf_counter()
        engine.step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return {"params": params, "seconds_median": _slowest(statistics.median(times[1:]), device)}


def _whole_steps(engine: Any, s: ProfileSettings, groups: ParallelGroups,
                 device: torch.device) -> tuple[list[float], list[dict[str, Any]]]:
    """Per planned step, the median over WHOLE_STEP_ROUNDS rounds of the slowest rank's seconds, and this
    rank's laps (workers/laps.py: each micro-batch, then the optimizer step; medians over the rounds),
    which the online calibration's fit reads (scheduling/refit.py; the ranks' laps agree: the gradient
    reduction ends every micro-batch on all of them).

    The first step runs once untimed first (warm-up); then every round trains each step once, in order,
    so a slow spell of the host lands in one round of many steps rather than on every timing of one.
    """
    def payload(step: dict[tuple[int, int], RankPayload]) -> RankPayload:
        return spare_payload(step[0, 0], 0) if groups.is_spare else step[groups.dp_rank, groups.cp_rank]

    def timed(step: dict[tuple[int, int], RankPayload]) -> tuple[float, list[float]]:
        stats = run_step(engine, payload(step), groups, device=device, loss_chunk_tokens=s.loss_chunk_tokens,
                         sync=True)
        return _slowest(stats.compute_s, device), stats.laps.seconds()

    if s.steps:
        timed(s.steps[0])
    rounds = [[timed(step) for step in s.steps] for _ in range(WHOLE_STEP_ROUNDS)]
    seconds = [statistics.median(t for t, _ in runs) for runs in zip(*rounds, strict=True)]
    laps = [[statistics.median(parts) for parts in zip(*(laps for _, laps in runs), strict=True)]
            for runs in zip(*rounds, strict=True)]
    return seconds, [{"micro_batch_s": step[:-1], "optimizer_s": step[-1]} for step in laps if step]


def profile_rank(rank: int, world_size: int, s: ProfileSettings) -> dict:
    """Every measurement on this rank (a `workers.tools.launch.run_workers` function)."""
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed's launcher check; one node, so equal
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    timeout = timedelta(seconds=s.timeout_s)
    groups = ParallelGroups.create(s.cp_size, device=device, attention_backend=s.model.attention_backend,
                                   timeout=timeout)
    zero = ZeroGroups.create(timeout)
    said = _Progress(rank)
    torch.manual_seed(s.seed)
    # The memory cases' model is built as the workers build theirs (kernel set applied, layers compiled
    # under train.compile): app/commands/profile.py models its peaks with that kernel set.
    model = s.model.build_on(device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = build_engine(s.model, s.deepspeed, device, s.seed, zero, overlap_comm=s.overlap_comm,
                          one_rank_zero1=s.one_rank_zero1)
    said("model and engine built")
    result: dict[str, Any] = {
        "world_size": world_size, "cp_size": s.cp_size, "params": params,
        "compute": _compute_rows(engine, s, groups, device),
    }
    said(f"{len(s.cases)} compute cases")
    if groups.cp_group is not None and s.cp_size > 1:
        bucket = max(sum(lengths) for lengths, _ in s.cases)
        layer_kv = 2 * bucket * s.kv_hidden_size * _element_size(model)
        # Ring steps take well under a millisecond: many repeats cost nothing, and the fit reads the
        # fastest, which a 2-core host reaches only in some of them (too few left 57% residuals).
        result["ring"] = measure_ring(groups.attention.comm, ring_sizes(layer_kv), repeats=RING_REPEATS,
                                      warmup=3, dtype=_dtype(model), device=device)
        result["overlap"] = _overlap_row(model, s, groups, device, result["ring"])
        said("ring and overlap")
    if world_size > 1:
        bucket = int(s.deepspeed["zero_optimization"]["reduce_bucket_size"])
        result["reduce"] = measure_grad_reduce(params, zero.data, dtype=_dtype(model), repeats=s.repeats,
                                               device=device, bucket_elements=bucket)
    result["optimizer"] = _optimizer_step_s(engine, s, device)
    said("gradient reduction and optimizer step")
    if s.steps:
        result["steps"], result["step_laps"] = _whole_steps(engine, s, groups, device)
        said(f"{len(s.steps)} whole steps")
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" \
        else f"{platform.machine()} cpu x{os.cpu_count() or 1}"
    result.update(_memory_rows(model, s, groups, device))
    said("memory cases")
    del model
    if device.type == "cuda":
        capacity = allocator_capacity_bytes(device)  # the least over ranks: what every rank can count on
        result["device_memory_bytes"] = _over_ranks(capacity, device, dist.ReduceOp.MIN)
    return result


class _Progress:
    """World rank 0 says when each measurement ended, and its seconds, in the worker's log (Ray's session
    logs): what a time-boxed profile that was stopped had done (scripts/gpu_check.sh prints these lines)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.last = rank, time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        if self.rank == 0:
            print(f"[skrull] profile: {what} in {now - self.last:.1f} s", flush=True)
        self.last = now


def _memory_rows(model: torch.nn.Module, s: ProfileSettings, groups: ParallelGroups,
                 device: torch.device) -> dict[str, list[dict]]:
    """The memory cases per checkpointing setting (app/profiling/memory.py models each from them)."""
    def measure() -> list[dict]:
        return measure_activation_memory(model, s.memory_cases, device=device,
                                         loss_chunk_tokens=s.loss_chunk_tokens,
                                         runtime=groups.attention.single_rank())

    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()
    rows = {"memory": measure()}
    enable_checkpointing(model)
    rows["memory_checkpointed"] = measure()
    if device.type == "cuda":  # on CPU the saved inputs are in host memory already
        enable_checkpointing(model, offload=True)
        rows["memory_offloaded"] = measure()
    return rows


def profile_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """`profile_rank` in a Ray Train worker (the torch backend made the world group); every rank reports,
    and world rank 0's rows reach the driver as the one record of app/train/run_monitor.py's RunMonitor."""
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    if torch.cuda.is_available():
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())
    raw = profile_rank(rank, context.get_world_size(), loop_config["settings"])
    ray.train.report({"history": [raw]} if rank == 0 else {})
