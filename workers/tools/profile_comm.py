"""Measure the communication half of a hardware profile over explicitly passed process groups.

    measure_ring(comm, sizes)          one ring step (start + wait, as the attention runs it) per size
    measure_grad_reduce(n, group)      the collectives ZeRO-2 issues for one micro-batch's n gradients
    measure_overlap(comm, n, compute)  ring alone, compute alone, and both as DACP runs them

Every timed repeat follows one protocol, so the numbers of all three are comparable:

    barrier(group) -> t0 -> work -> synchronize the device -> t = now - t0 -> t = max over group's ranks

The barrier lines the ranks up so that no rank's time includes waiting for a late peer to arrive; the
maximum over ranks is what the slowest rank, and so the step, pays. Both the barrier and the maximum are
small all_reduces on `group` itself: nothing here touches the default group. Medians over repeats are
reported (robust to a single slow repeat), minima where they help to judge noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from workers.attention.comm import RingComm

DEEPSPEED_DEFAULT_BUCKET = 500_000_000
"""DeepSpeed's default `zero_optimization.reduce_bucket_size` (elements; deepspeed/runtime/zero/config.py)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group: dist.ProcessGroup, device: torch.device) -> None:
    """A one-element all_reduce on `group`: a barrier on gloo and NCCL alike, on the timed device."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _sync(device)


def _group_max(seconds: float, group: dist.ProcessGroup, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def _timed(work: Callable[[], None], group: dist.ProcessGroup, device: torch.device) -> float:
    """Seconds of one `work()` under the module's protocol (barrier, sync, max over ranks)."""
    _barrier(group, device)
    start = time.perf_counter()
    work()
    _sync(device)
    return _group_max(time.perf_counter() - start, group, device)


def _buffer(nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of at least one element and about `nbytes` bytes (rounded up to whole elements)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.ones(max(1, -(-int(nbytes) // itemsize)), dtype=dtype, device=device)


def _ring_step(comm: RingComm, buf: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        comm.wait(comm.start(buf))

    return step


def measure_ring(comm: RingComm, sizes_bytes: Sequence[int], *, repeats: int = 5, warmup: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device) -> list[dict]:
    """Per size, the time of one ring step: send `bytes` to the next rank while receiving as many.

    Collective over `comm.group`: every rank calls it with the same sizes. Rows {"bytes" (actually sent,
    rounded up to whole `dtype` elements), "seconds_median", "seconds_p25" (the lower quartile),
    "seconds_min"}, in the order of the sizes.
    `warmup` untimed rounds absorb connection setup and first-touch allocation. The sizes are interleaved,
    one step of each per round: run size after size, a slow spell of a shared host took every step of the
    size it fell on (the smallest message once measured 36% slower than one of twice its bytes).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    buffers = [_buffer(nbytes, dtype, device) for nbytes in sizes_bytes]
    steps = [_ring_step(comm, buf) for buf in buffers]
    times: list[list[float]] = [[] for _ in buffers]
    for round_ in range(warmup + repeats):
        for seconds, step in zip(times, steps, strict=True):
            elapsed = _timed(step, comm.group, device)
            if round_ >= warmup:
                seconds.append(elapsed)
    return [{"bytes": buf.numel() * buf.element_size(), "seconds_median": statistics.median(seconds),
             "seconds_p25": lower_quartile(seconds), "seconds_min": min(seconds)}
            for buf, seconds in zip(buffers, times, strict=True)]


def lower_quartile(values: Sequence[float]) -> float:
    """The nearest-rank 25th percentile (the smallest value for fewer than five)."""
    if not values:
        raise ValueError("lower_quartile needs at least one value")
    return sorted(values)[(len(values) - 1) // 4]


def grad_reduce_buckets(num_params: int, bucket_elements: int) -> list[int]:
    """Element counts of the all_reduces ZeRO-2 issues for `num_params` gradients: full buckets, then
    the remainder (DeepSpeed cuts at parameter boundaries, so this is the fewest it can issue)."""
    if num_params < 1 or bucket_elements < 1:
        raise ValueError(f"num_params ({num_params}) and bucket_elements ({bucket_elements}) must be >= 1")
    full, rest = divmod(int(num_params), int(bucket_elements))
    return [int(bucket_elements)] * full + ([rest] if rest else [])


def measure_grad_reduce(num_params: int, group: dist.ProcessGroup, *, dtype: torch.dtype = torch.bfloat16,
                        repeats: int = 5, device: torch.device, warmup: int = 1,
                        bucket_elements: int = DEEPSPEED_DEFAULT_BUCKET) -> dict:
    """Time of one micro-batch's ZeRO-2 gradient reduction of `num_params` `dtype` elements over `group`.

    What DeepSpeed 0.19.8 runs (deepspeed/runtime/zero/stage_1_and_2.py, ZeRO stage 2 with
    contiguous_gradients and reduce_scatter=True, the config app/model/deepspeed_config.py generates):
    - every micro-batch, not only at the accumulation boundary: each gradient hook calls
      `reduce_ready_partitions_and_remove_grads` (l. 2293), which reduces whenever partition_gradients
      (stage 2) is on;
    - `reduce_independent_p_g_buckets_and_remove_grads` (l. 1414) copies gradients into a contiguous
      bucket and flushes it through `reduce_ipg_grads` (l. 2205) before it would exceed
      `reduce_bucket_size` elements; `independent_gradient_partition_epilogue` (l. 1016) flushes the rest;
    - `average_tensor` (l. 1590), on the reduce_scatter=True branch, groups the bucket's slices by
      owning rank, but with `use_multi_rank_bucket_allreduce` (default True, zero/config.py l. 119; the
      generated config leaves it) every slice goes to the ("allreduce", group) key (l. 1695), so
      `allreduce_and_scatter` (l. 1545) -> `allreduce_bucket` (l. 2359) issues ONE `dist.all_reduce` of
      the whole flattened bucket (l. 2384) and each rank keeps its own partition afterwards.
    So despite the name, the collective is an all_reduce (two ring passes of the data, not the one of a
    reduce-scatter), one per bucket, in the communication dtype (bf16 when bf16 is on, else fp32:
    engine.communication_data_type). On CPU the backend is gloo and `overlap_comm` is off, so the
    all_reduces run in sequence on the compute thread; that sequence is what is timed.

    Not timed: the bucket copies, the division by the world size and the flatten (compute, not
    communication). Pass the run's `reduce_bucket_size` as `bucket_elements` (the generated config uses
    5e5 on CPU, 5e7 on GPU). Returns {"params", "bytes", "seconds_median", "seconds_min", "collective",
    "buckets"}.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    counts = grad_reduce_buckets(num_params, bucket_elements)
    # One buffer of the largest bucket, reused (narrowed) for every bucket: the memory of one bucket.
    flat = torch.ones(max(counts), dtype=dtype, device=device)

    def reduce() -> None:
        for count in counts:
            dist.all_reduce(flat.narrow(0, 0, count), group=group)

    times = [_timed(reduce, group, device) for _ in range(warmup + repeats)][warmup:]
    return {"params": int(num_params), "bytes": int(num_params) * flat.element_size(),
            "seconds_median": statistics.median(times), "seconds_min": min(times),
            "collective": "all_reduce", "buckets": len(counts)}


def measure_overlap(comm: RingComm, nbytes: int, compute: Callable[[], None], *, repeats: int = 5,
                    device: torch.device, warmup: int = 1, dtype: torch.dtype = torch.float32) -> dict:
    """How much of one ring step `compute()` hides, run as DACP runs its local attention.

        comm_s    : start(kv); wait                   (the ring step alone)
        compute_s : compute()                         (alone)
        both_s    : start(kv); compute(); wait        (dacp.py: the first K/V transfer is in flight
                                                       while the local attention runs)
        overlap   = clip((comm_s + compute_s - both_s) / min(comm_s, compute_s), 0, 1)

    overlap is the time saved over running them serialized, relative to the most that could be saved
    (the shorter of the two hidden entirely): 1 = fully hidden, 0 = serialized (or worse). Each time is
    a median over `repeats` of the per-repeat maximum over ranks; the three modes are interleaved
    within a repeat so that drift of the machine affects all three alike. Collective over `comm.group`.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    buf = _buffer(nbytes, dtype, device)
    ring = _ring_step(comm, buf)

    def both() -> None:
        pending = comm.start(buf)
        compute()
        comm.wait(pending)

    modes = {"comm_s": ring, "compute_s": compute, "both_s": both}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for i in range(warmup + repeats):
        for name, work in modes.items():
            seconds = _timed(work, comm.group, device)
            if i >= warmup:
                times[name].append(seconds)
    result = {name: statistics.median(values) for name, values in times.items()}
    saved = result["comm_s"] + result["compute_s"] - result["both_s"]
    hideable = max(min(result["comm_s"], result["compute_s"]), 1e-12)
    result["overlap"] = float(min(max(saved / hideable, 0.0), 1.0))
    return result
