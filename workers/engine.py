"""The DeepSpeed engine a worker trains with, and the typed shape of the config the driver generates.

The driver generates the DeepSpeed JSON from the config tree (app/deepspeed_config.py); the TypedDicts here
are the contract between the two, so a misspelled key is a type error rather than a setting DeepSpeed
silently ignores.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from workers.models import ModelSpec


class AdamWParams(TypedDict):
    lr: float
    weight_decay: float
    betas: list[float]
    eps: float
    torch_adam: bool


class OptimizerSection(TypedDict):
    type: str
    params: AdamWParams


class ZeroSection(TypedDict):
    stage: int
    overlap_comm: bool
    contiguous_gradients: bool
    reduce_scatter: bool
    reduce_bucket_size: float
    allgather_bucket_size: float


class WarmupParams(TypedDict):
    warmup_min_lr: float
    warmup_max_lr: float
    warmup_num_steps: int
    warmup_type: str


class SchedulerSection(TypedDict):
    type: str
    params: WarmupParams


class EnabledFlag(TypedDict):
    enabled: bool


class DeepSpeedConfig(TypedDict, total=False):
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    steps_per_print: int
    optimizer: OptimizerSection
    zero_optimization: ZeroSection
    gradient_clipping: float
    bf16: EnabledFlag
    wall_clock_breakdown: bool
    scheduler: SchedulerSection


def build_engine(spec: ModelSpec, ds_config: DeepSpeedConfig, device: torch.device, seed: int) -> Any:
    """The model on `device`, wrapped in a DeepSpeed engine (ZeRO-2 over the default process group)."""
    import deepspeed  # lazy: the driver and Ray Data workers never need it

    torch.manual_seed(seed)  # identical initial weights on every rank for random-init models
    model = spec.build().to(device)
    model.train()  # from_pretrained returns eval mode, which would also silently skip activation recompute
    engine, *_ = deepspeed.initialize(model=model, config=dict(ds_config),
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine
