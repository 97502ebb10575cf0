"""The device side of `python -m app bench step`: the workers' own engine and step, one process, one device.

    one-rank process group (gloo on CPU, NCCL on CUDA; a FileStore: no socket)
    per variant: build_engine (its kernels, compile, optimizer, DeepSpeed JSON) -> warm_up (C tokens);
                 its build's phases (workers/engine.py engine_phases) -> `engine_phases_s`
    for step in 1 .. warmup + steps:
        for variant in that step's order (rotated by one each step, as bench train's policies):
            activate its kernel set; synchronize; run_step(sync=True)        (the training step itself)
            -> step_s (wall), laps (micro-batch busy time, optimizer), loss, peak memory
    --trace: one more step per variant under torch.profiler -> <dir>/<variant>.json + its 15 top ops, and on
             CUDA the device's busy and idle time in that step (`device_time`)
    --max-seconds: no build or step starts past it; what was measured is returned (stopped_early says so)

What a step's time splits into (StepReading):
    micro_batch_s  sum over micro-batches of the device's time from each one's first kernel to the end of its
                   backward (workers/laps.py `busy`)
    optimizer_s    the optimizer step's lap
    gap_s          step_s minus both: the host work before the first kernel, the device idle between
                   micro-batches, and the end of the step (what an async step without host waits hides)

Every variant keeps its engine on the device for the whole run, so the peak of one step is measured against
the memory the other variants hold: `peak_bytes` is the step's rise over what was allocated before it, plus
what this variant's engine holds (its build's allocations, Adam's state allocated before the warm-up, and
what its steps kept): the peak the variant would reach alone.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scheduling.payload import RankPayload
from workers.distributed import ParallelGroups
from workers.engine import DeepSpeedConfig, ZeroGroups, build_engine, engine_phases, phases_text
from workers.kernels import kernel_set
from workers.models import ModelSpec
from workers.step import run_step, synchronize
from workers.warmup import warm_up

TOP_OPS = 15


@dataclass(frozen=True, slots=True, kw_only=True)
class StepVariant:
    """One variant of the config: what its engine is built from and the steps it trains (warm-up first)."""

    name: str
    model: ModelSpec
    deepspeed: DeepSpeedConfig
    overlap_comm: str
    one_rank_zero1: bool
    loss_chunk_tokens: int
    warmup_tokens: int
    attention_backend: str
    payloads: tuple[RankPayload, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReading:
    step: int
    step_s: float
    micro_batch_s: float
    optimizer_s: float
    gap_s: float
    loss: float
    applied: bool
    peak_bytes: float | None
    micro_batches: int


@dataclass
class _Live:
    variant: StepVariant
    engine: Any
    groups: ParallelGroups
    resident: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    """engine_phases_s: build_engine's phases and "other" (this variant's process groups), wall seconds."""
    readings: list[StepReading] = field(default_factory=list)


def bench_steps(variants: list[StepVariant], *, device: torch.device, seed: int = 0,
                trace_dir: str | None = None, max_seconds: float | None = None) -> dict[str, Any]:
    """Every variant's StepReadings (interleaved, module docstring), its kernel set and, with `trace_dir`,
    its top ops; initializes (and destroys) a one-rank process group unless one exists.

    `max_seconds` (builds included): no build or step starts after it, and the readings so far are returned
    under "variants" with "stopped_early" saying why (a time-boxed run reports what it measured instead of
    being killed with nothing)."""
    owns_group = not dist.is_initialized()
    if owns_group:
        _init_single_rank(device)
    for name, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size()), ("LOCAL_RANK", 0)):
        os.environ.setdefault(name, str(value))  # DeepSpeed reads them, as a launcher would have set them
    failed: dict[str, str] = {}
    clock = _Budget(max_seconds)
    try:
        live = [entry for v in variants
                if not clock.spent() and (entry := _guarded(failed, v.name, _build, v, device, seed))]
        steps = len(variants[0].payloads)
        for step in range(steps):
            if clock.spent():
                break
            shift = step % max(len(live), 1)
            for entry in live[shift:] + live[:shift]:
                if clock.spent():
                    break
                reading = _guarded(failed, entry.variant.name, _timed_step, entry, step, device)
                if reading is None:
                    _drop(live, entry)
                else:
                    entry.readings.append(reading)
            _progress(f"step {step + 1}/{steps}: " + ", ".join(
                f"{e.variant.name} {e.readings[-1].step_s:.3f} s" for e in live if e.readings))
        traces = ({e.variant.name: _trace(e, device, trace_dir) for e in live}
                  if trace_dir and not clock.spent() else {})
        measured = {e.variant.name: {"readings": e.readings, "kernels": e.engine.module.skrull_kernels,
                                     "optimizer": _optimizer_name(e.engine),
                                     "zero_stage": e.engine.zero_optimization_stage(),
                                     "engine_phases_s": e.phases,
                                     **traces.get(e.variant.name, {})} for e in live}
        unbuilt = {v.name: {"error": clock.reason("before its engine was built")} for v in variants
                   if v.name not in measured and v.name not in failed}
        return {"variants": {**measured, **unbuilt, **{name: {"error": e} for name, e in failed.items()}},
                "stopped_early": clock.reason("") if clock.spent() else None}
    finally:
        if owns_group:
            dist.destroy_process_group()


class _Budget:
    """The run's time budget from its start (None: unlimited)."""

    def __init__(self, max_seconds: float | None) -> None:
        self.max_seconds = max_seconds
        self.started = time.monotonic()

    def spent(self) -> bool:
        return self.max_seconds is not None and time.monotonic() - self.started >= self.max_seconds

    def reason(self, what: str) -> str:
        return f"--max-seconds {self.max_seconds:g} reached{' ' + what if what else ''}"


def _guarded(failed: dict[str, str], name: str, call: Any, *args: Any) -> Any:
    """call(*args), or None with the variant's error recorded: one variant that cannot run (a kernel the
    machine lacks, a compile error, out of memory) leaves the others measured."""
    try:
        return call(*args)
    except Exception as err:  # any failure of one variant; the run goes on without it
        failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(f"[skrull] bench step: variant {name} failed: {failed[name]}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _drop(live: list[_Live], entry: _Live) -> None:
    """Take a failed variant out of the rotation and free its engine's memory."""
    live.remove(entry)
    entry.engine = None


def _init_single_rank(device: torch.device) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    store = dist.FileStore(tempfile.mktemp(prefix="skrull-bench-step-"), 1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(minutes=30))


def _allocated(device: torch.device) -> float:
    return float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0.0


def _progress(line: str) -> None:
    """One line on stderr as the measurement goes (a long run shows where its time goes)."""
    print(f"[bench step] {line}", file=sys.stderr, flush=True)


def _build(variant: StepVariant, device: torch.device, seed: int) -> _Live:
    started = time.perf_counter()
    before = _allocated(device)
    groups = ParallelGroups.create(1, device=device, attention_backend=variant.attention_backend)
    zero = ZeroGroups.create(timedelta(minutes=30))
    engine = build_engine(variant.model, variant.deepspeed, device, seed, zero,
                          overlap_comm=variant.overlap_comm, one_rank_zero1=variant.one_rank_zero1)
    built = time.perf_counter()
    phases = engine_phases(engine, built - started)
    warm_up(engine, groups, device, tokens=variant.warmup_tokens, loss_chunk_tokens=variant.loss_chunk_tokens)
    synchronize(device)
    live = _Live(variant=variant, engine=engine, groups=groups, resident=_allocated(device) - before,
                 phases=phases)
    _progress(f"{variant.name}: engine built in {built - started:.1f} s ({phases_text(phases)}; "
              f"{engine.module.skrull_kernels} kernels, {_optimizer_name(engine)}), warm-up micro-batch "
              f"{time.perf_counter() - built:.1f} s")
    return live


def _activate(entry: _Live) -> None:
    """The variant's kernel set owns the process's module-level RoPE for its step (workers/kernels)."""
    kernel_set(entry.engine.module.skrull_kernels).activate(entry.engine.module)


def _timed_step(entry: _Live, index: int, device: torch.device) -> StepReading:
    payload = entry.variant.payloads[index]
    _activate(entry)
    synchronize(device)
    before = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    stats = run_step(entry.engine, payload, entry.groups, device=device,
                     loss_chunk_tokens=entry.variant.loss_chunk_tokens, sync=True)
    step_s = time.perf_counter() - started
    peak = None
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device)) - before + entry.resident
        entry.resident += _allocated(device) - before  # what the step kept
    busy, laps = stats.laps.busy(), stats.laps.seconds()
    micro = float(sum(busy[:-1]))
    return StepReading(step=index + 1, step_s=step_s, micro_batch_s=micro, optimizer_s=float(laps[-1]),
                       gap_s=max(0.0, step_s - micro - float(laps[-1])),
                       loss=float(stats.loss_sum) / max(payload.global_label_tokens, 1),
                       applied=bool(stats.applied), peak_bytes=peak, micro_batches=len(payload.micro_batches))


def _optimizer_name(engine: Any) -> str:
    """What steps the weights: the device step (workers/zero_step.py) or DeepSpeed's, and the AdamW kind."""
    inner = engine.optimizer.optimizer
    kind = next((k for k in ("fused", "foreach") if inner.defaults.get(k)), "for-loop")
    own = hasattr(engine.optimizer, "skrull_applied")
    return f"{kind} AdamW, {'device step' if own else 'DeepSpeed step'}"


def _trace(entry: _Live, device: torch.device, trace_dir: str) -> dict[str, Any]:
    """One more step of the variant under torch.profiler: a Chrome trace, its TOP_OPS ops by self time
    ("top_ops") and, on CUDA, the device's busy and idle time in that step ("device_time")."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _activate(entry)
    synchronize(device)
    with profile(activities=activities) as prof:
        run_step(entry.engine, entry.variant.payloads[-1], entry.groups, device=device,
                 loss_chunk_tokens=entry.variant.loss_chunk_tokens, sync=True)
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(trace_dir) / f"{entry.variant.name}.json"))
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:TOP_OPS]
    on_device = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    top = [{"op": e.key, "self_ms": getattr(e, key, 0.0) / 1e3, "calls": e.count} for e in events]
    return {"top_ops": top, "device_time": device_time(on_device) if on_device else None}


def device_time(intervals: list[tuple[float, float]]) -> dict[str, float]:
    """The device's span (first start to last end), busy time (the union of the intervals: kernels,
    copies and fills, in microseconds) and idle time, in milliseconds: idle is where it waited for the
    host (a launch-bound step) or for a synchronization."""
    ordered = sorted(intervals)
    busy, end = 0.0, ordered[0][0]
    for start, stop in ordered:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - ordered[0][0]
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3}
