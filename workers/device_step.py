"""train.optimizer_impl=fused: the optimizer step that runs on the device alone, one implementation per
DeepSpeed optimizer class (DeepSpeed's ZeRO-1/2 optimizer: workers/zero_step.py; its BF16_Optimizer, the
ZeRO-1 with bf16 weights that one worker runs: workers/bf16_step.py), installed in place of the class's own
`step`, and what a step's `applied` reads."""

from __future__ import annotations

import types
from typing import Any

import torch

from workers import bf16_step, zero_step


def install_device_step(engine: Any) -> str | None:
    """Replace the engine's optimizer step by the device step of its class; returns why not (None:
    installed)."""
    optimizer = engine.optimizer
    kind = bf16_step if bf16_step.owns(optimizer) else zero_step
    problem = kind.device_step_problem(optimizer)
    if problem is None:
        optimizer.step = types.MethodType(kind.device_step, optimizer)
        optimizer.skrull_applied = None
    return problem


def applied_flag(engine: Any) -> torch.Tensor | bool:
    """The last step's `applied`: a device bool tensor under the device step, else DeepSpeed's host bool."""
    flag = getattr(engine.optimizer, "skrull_applied", None)
    return bool(engine.was_step_applied()) if flag is None else flag
