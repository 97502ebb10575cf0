"""Measure activation memory per token: the peak of one forward+backward above the memory before it.

Each case is a list of sequence lengths packed into one stream and run as a worker runs a micro-batch
with every sequence local (DACP attention, chunked loss, backward), like profile_compute's cases. Per
case:

    warm-up pass                     lazily created state (gradients, kernel workspaces, thread pools)
                                     exists afterwards, so it is not charged to the measured pass
    zero the gradients in place      they stay allocated: part of the baseline, not of the peak
    baseline = memory now
    measured pass, peak sampled      peak_bytes = peak - baseline

CUDA: the caching allocator's counters (reset_peak_memory_stats, max_memory_allocated) are exact.
CPU: there is no allocator counter, so the process RSS is sampled by a background thread (psutil,
about every millisecond) during the pass; ru_maxrss is useless because it can never be reset. Freed
memory that malloc keeps cached would hide part of the pass's growth from RSS, so before the baseline
the heap is trimmed (glibc malloc_trim, where available): what the pass needs then shows up as RSS
growth. A sampled peak can miss a spike shorter than the sampling period; activations live through the
whole forward and into the backward, so their peak is not such a spike.

`allocator_capacity_bytes(device)` is the device memory the run's tensors can have on CUDA: the free memory
plus what the caching allocator holds, i.e. the device's total less what lives outside the allocator (the
CUDA context, NCCL's buffers, other processes), read when those exist (at the end of `profile`).

`activation_bytes_per_token(rows)` fits peak_bytes = slope * tokens + intercept (scheduling.calibrate):
the slope is the activation bytes per token of this model, the intercept the fixed part.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from scheduling import DacpPlan
from scheduling.calibrate import LinearFit, fit_linear
from workers.attention.runtime import AttentionRuntime
from workers.batch import RankBatch, build_rank_batch
from workers.forward import micro_batch_loss_sum

SAMPLE_PERIOD_S = 0.001


def _packed_batch(model: torch.nn.Module, lengths: Sequence[int], seed: int) -> RankBatch:
    """One stream of random-token sequences of `lengths`, all local to a single rank."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, size=n).tolist() for n in lengths]
    plan = DacpPlan(local=(tuple(range(len(lengths))),), distributed=())
    return build_rank_batch(plan, ids, ids, cp_rank=0, cp_size=1)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim (returns freed heap memory to the OS), or None off glibc."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def _release_freed_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class _RssPeak:
    """Context manager: the highest RSS (bytes) seen by a thread polling it every `period` seconds."""

    def __init__(self, period: float = SAMPLE_PERIOD_S) -> None:
        import psutil  # only the CPU path needs it (a dependency of deepspeed and ray)

        self._process = psutil.Process()
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.peak = 0

    def rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self._period)

    def __enter__(self) -> _RssPeak:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def _pass(model: torch.nn.Module, batch: RankBatch, runtime: AttentionRuntime | None,
          loss_chunk_tokens: int) -> None:
    micro_batch_loss_sum(model, batch, runtime=runtime, loss_chunk_tokens=loss_chunk_tokens).backward()


def _peak_above_baseline(model: torch.nn.Module, batch: RankBatch, device: torch.device,
                         runtime: AttentionRuntime | None, loss_chunk_tokens: int) -> int:
    """Bytes: the measured pass's peak minus the memory right before it (see the module docstring)."""
    model.zero_grad(set_to_none=False)
    _release_freed_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        _pass(model, batch, runtime, loss_chunk_tokens)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - baseline)
    with _RssPeak() as sampler:
        baseline = sampler.peak
        _pass(model, batch, runtime, loss_chunk_tokens)
    return max(0, sampler.peak - baseline)


def measure_activation_memory(model: torch.nn.Module, cases: Sequence[Sequence[int]], *,
                              device: torch.device, loss_chunk_tokens: int,
                              runtime: AttentionRuntime | None = None, seed: int = 0) -> list[dict]:
    """Per case, {"tokens", "lengths", "peak_bytes"}: the peak memory of one forward+backward over the
    packed stream of `lengths` above the memory before it (one warm-up pass first, see the module
    docstring). `model` must already be on `device`; `runtime`: the single-rank attention runtime
    (None: the "auto" kernel of the device)."""
    device = torch.device(device)
    rows = []
    for i, lengths in enumerate(cases):
        batch = _packed_batch(model, lengths, seed + i).to(device)
        _pass(model, batch, runtime, loss_chunk_tokens)  # warm-up
        peak = _peak_above_baseline(model, batch, device, runtime, loss_chunk_tokens)
        rows.append({"tokens": int(sum(lengths)), "lengths": list(lengths), "peak_bytes": peak})
    model.zero_grad(set_to_none=True)
    return rows


def allocator_capacity_bytes(device: torch.device) -> int:
    """On CUDA: free + reserved bytes of `device` (module docstring), the M of the memory model."""
    torch.cuda.synchronize(device)
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def activation_bytes_per_token(rows: Sequence[dict]) -> LinearFit:
    """Least-squares line peak_bytes = slope * tokens + intercept; slope = activation bytes/token."""
    return fit_linear([r["tokens"] for r in rows], [r["peak_bytes"] for r in rows])
