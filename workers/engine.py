"""The DeepSpeed engine a worker trains with, and the typed shape of the config the driver generates.

The driver generates the DeepSpeed JSON from the config tree (app/model/deepspeed_config.py); the TypedDicts
here are the contract between the two, so a misspelled key is a type error rather than a setting DeepSpeed
silently ignores.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from workers import bf16_accumulate, bf16_step
from workers.deepspeed_import import import_deepspeed
from workers.device_step import install_device_step
from workers.loss import LOSS_HEAD
from workers.lr_schedule import LrSchedule, scheduler_factory
from workers.models import ModelSpec
from workers.phase_clock import PhaseClock


class _AdamWRequired(TypedDict):
    lr: float
    weight_decay: float
    betas: list[float]
    eps: float
    torch_adam: bool


class AdamWParams(_AdamWRequired, total=False):
    foreach: bool
    fused: bool


class OptimizerSection(TypedDict):
    type: str
    params: AdamWParams


class _ZeroRequired(TypedDict):
    stage: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_scatter: bool
    reduce_bucket_size: float
    allgather_bucket_size: float


class ZeroSection(_ZeroRequired, total=False):
    """Stage 3 only: DeepSpeed's parameter-partitioning knobs (app/model/deepspeed_config.py)."""

    stage3_prefetch_bucket_size: float
    stage3_param_persistence_threshold: float
    stage3_max_live_parameters: float
    stage3_max_reuse_distance: float


class EnabledFlag(TypedDict):
    enabled: bool


class Bf16Section(EnabledFlag, total=False):
    immediate_grad_update: bool


class DataTypesSection(TypedDict):
    grad_accum_dtype: str


class ThroughputTimerSection(TypedDict):
    enabled: bool


class TimersSection(TypedDict):
    throughput: ThroughputTimerSection


class DeepSpeedConfig(TypedDict, total=False):
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    steps_per_print: int
    optimizer: OptimizerSection
    zero_optimization: ZeroSection
    gradient_clipping: float
    bf16: Bf16Section
    data_types: DataTypesSection
    wall_clock_breakdown: bool
    timers: TimersSection


@dataclass(frozen=True, slots=True)
class ZeroGroups:
    """The process groups DeepSpeed runs ZeRO over (stage 2 or 3), each with the run's collective timeout.

    Passed to `deepspeed.initialize(mpu=...)`, DeepSpeed's interface for a caller's own groups (the
    Megatron "model parallel unit"). Without it DeepSpeed reduces gradients over its own clone of the
    world group, made by `new_group` without a timeout, so a stopped peer would hang the step for torch's
    default 30 minutes instead of `train.collective_timeout_s`. Data parallel here means every rank (DP x
    CP and spares: ZeRO partitions over all of them); there is no tensor or pipeline parallelism, so the
    model-parallel group is this rank alone (DeepSpeed all-reduces norms over it unconditionally in places,
    so it must be a real group: None would mean the world).
    """

    data: dist.ProcessGroup
    solo: dist.ProcessGroup

    @classmethod
    def create(cls, timeout: timedelta) -> ZeroGroups:
        """Collective: every rank calls it alike (new_group and new_subgroups are collective)."""
        data = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
        solo, _ = dist.new_subgroups(group_size=1, timeout=timeout)
        return cls(data, solo)

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.data

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.data)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.data)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.data)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.solo

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


def use_extensions_cache_per_environment() -> str:
    """Point TORCH_EXTENSIONS_DIR at this Python environment's own directory unless it is set; returns it.

    DeepSpeed JIT-builds its ops (none in a run since skip_cpu_shm_comm_op; a user's config may ask) into
    torch's extensions cache, ~/.cache/torch_extensions/<python>_<device>/<op>, keyed by op name only,
    while the cached build.ninja holds the environment's paths. Two virtualenvs on one machine (a second
    checkout, a CI clone beside a working tree) therefore rebuild the op on every switch: 40-70 s of g++ on
    2 cores (measured 2026-11-25), paid by the first step of a run while its peers wait.
    """
    digest = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    default = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", f"venv-{digest}")
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", default)


def for_world_size(ds_config: DeepSpeedConfig, overlap_comm: str, world_size: int,
                   one_rank_zero1: bool = True) -> DeepSpeedConfig:
    """ds_config adapted to this worker group's size:
    - train.overlap_comm=auto: off on a single worker (nothing to overlap; with it DeepSpeed synchronizes
      the device after every backward), as generated otherwise;
    - train.one_rank_zero1: ZeRO stage 2 runs as stage 1 on a single worker. One rank's partition is the
      whole model either way, so both hold the same state; stage 2 still sends every parameter's gradient of
      every micro-batch through its bucket (copy, division by the world size, accumulate into the fp32
      partition) in Python hooks, where stage 1 adds it to the fp32 gradient directly (DeepSpeed's
      BF16_Optimizer under bf16). Measured in docs/benchmarks.md "One rank: ZeRO-1 for ZeRO-2"."""
    zero = ds_config["zero_optimization"]
    if overlap_comm == "auto" and world_size == 1 and zero["overlap_comm"]:
        zero = {**zero, "overlap_comm": False}
    if one_rank_zero1 and world_size == 1 and zero["stage"] == 2:
        zero = {**zero, "stage": 1}
    return ds_config if zero is ds_config["zero_optimization"] else {**ds_config, "zero_optimization": zero}


BUILD_PHASES = "skrull_build_phases"
"""Attribute of a built engine: {phase: wall seconds} of build_engine (PhaseClock), in the order they ran."""


def build_phases(engine: Any) -> dict[str, float]:
    """The build phases build_engine attached to `engine` ({} for an engine built otherwise)."""
    return dict(getattr(engine, BUILD_PHASES, {}))


def engine_phases(engine: Any, total_s: float) -> dict[str, float]:
    """build_engine's phases of `engine`, then "other": the rest of `total_s`, the caller's own timing of the
    engine's making (its process groups; a checkpoint loaded into it)."""
    phases = build_phases(engine)
    return {**phases, "other": max(0.0, total_s - sum(phases.values()))}


def phases_text(phases: dict[str, float]) -> str:
    """`model 3.1 s, device 0.4 s, ...`: the phases in their order, for a log line."""
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())


def build_engine(spec: ModelSpec, ds_config: DeepSpeedConfig, device: torch.device, seed: int,
                 groups: ZeroGroups | None = None, lr_schedule: LrSchedule | None = None,
                 overlap_comm: str = "auto", one_rank_zero1: bool = True) -> Any:
    """The model on `device` (its kernels and compilation applied, ModelSpec.build_on), wrapped in a
    DeepSpeed engine: ZeRO (ds_config's stage) over `groups` (default: the world; at stage 3 the model is
    built partitioned over them, workers/sharded.py: no rank ever holds it whole), its learning rate
    following `lr_schedule` (workers/lr_schedule.py; None: constant). `overlap_comm`, `one_rank_zero1`:
    train.overlap_comm and train.one_rank_zero1 (for_world_size). With torch's fused AdamW the ZeRO-1/2
    step runs on the device alone (workers/zero_step.py, workers/bf16_step.py), when the engine allows it
    (else DeepSpeed's own step, said once).

    The engine's `skrull_build_phases` (BUILD_PHASES) holds the wall seconds of each phase, ended on the
    device (PhaseClock): "import" (DeepSpeed imported), then ModelSpec.build_on's "model", "device",
    "kernels" (and "compile" with train.compile), then "deepspeed" (deepspeed.initialize: the engine, its
    ZeRO or BF16 optimizer with the fp32 master weights, the LR scheduler; then this project's optimizer
    hooks: bf16_accumulate, the device step)."""
    clock = PhaseClock(wait=(lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None)
    use_extensions_cache_per_environment()  # before DeepSpeed builds its ops
    deepspeed = import_deepspeed()
    world = dist.get_world_size() if dist.is_initialized() else 1
    asked = ds_config["zero_optimization"]["stage"]
    ds_config = for_world_size(ds_config, overlap_comm, world, one_rank_zero1)
    if ds_config["zero_optimization"]["stage"] != asked:
        print(f"[skrull] one worker: ZeRO stage {asked} runs as stage 1 (the same state on one rank, without "
              "ZeRO-2's per-micro-batch bucket work; train.one_rank_zero1=false keeps it)", flush=True)

    clock.lap("import")
    torch.manual_seed(seed)  # identical initial weights on every rank for random-init models
    zero3 = dict(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None
    model = spec.build_on(device, zero3=zero3, group=groups.data if groups is not None else None,
                          lap=clock.lap)
    prepare_for_zero(model, ds_config)
    engine, *_ = deepspeed.initialize(model=model, config=dict(ds_config), mpu=groups,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      lr_scheduler=scheduler_factory(lr_schedule or LrSchedule()))
    if bf16_step.owns(engine.optimizer) and not bf16_accumulate.lean_accumulation_problem(engine.optimizer):
        bf16_accumulate.install(engine.optimizer)  # else DeepSpeed's own hooks: the same sums, slower
    if ds_config["optimizer"]["params"].get("fused"):
        problem = install_device_step(engine)
        if problem and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"[skrull] train.optimizer_impl=fused: DeepSpeed's own (host-synchronizing) step runs, "
                  f"because {problem}", flush=True)
    if world == 1 and bf16_step.owns(engine.optimizer):
        # One rank has nothing to all-reduce; DeepSpeed would still flatten every gradient into a copy (4
        # bytes per parameter at the step) to reduce it with itself. BF16_Optimizer needs nothing else of
        # that call (ZeRO's optimizers do: their gradients arrive through it).
        engine.enable_backward_allreduce = False
    clock.lap("deepspeed")
    setattr(engine, BUILD_PHASES, clock.phases)
    return engine


def prepare_for_zero(model: torch.nn.Module, ds_config: DeepSpeedConfig) -> None:
    """Before `deepspeed.initialize`: at ZeRO stage 3, register the LM head's parameters as external
    parameters of the model's LossHead (workers/loss.py), DeepSpeed's interface for a parameter used
    outside its own module's forward, so that the loss's forward and backward find it gathered."""
    if ds_config["zero_optimization"]["stage"] != 3:
        return
    deepspeed = import_deepspeed()
    head = getattr(model, LOSS_HEAD)
    for param in head.head.parameters():
        deepspeed.zero.register_external_parameter(head, param)
