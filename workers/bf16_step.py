"""The ZeRO-1 bf16 optimizer step without a host synchronization (train.optimizer_impl: fused, bf16).

At ZeRO stage 1 with bf16 weights and fp32 gradient accumulation DeepSpeed trains through its
BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py), not the ZeRO-1/2 optimizer of workers/zero_step.py:
each micro-batch's bf16 gradient is added to a flat fp32 gradient of the whole model in a hook, the engine
all-reduces those over the data-parallel ranks at the step, and the step updates this rank's partition of
the fp32 master weights. Its step reads the device to test the norm (`is_invalid_grad_norm`: a
`bool(tensor)`) and takes one norm per parameter. This step computes the same update on the device alone:

    per param group i:   g_i = the group's flat fp32 gradient (already all-reduced: every rank holds it)
    norm  = sqrt(sum_i ||g_i||^2)                         one kernel per group; no collective, as
                                                          DeepSpeed's own (the model-parallel group is
                                                          this rank alone, workers/engine.py ZeroGroups)
    bad   = not isfinite(norm)                            as workers/zero_step.py
    this rank's partition of g_i *= min(1, grad_clip / (norm + 1e-6))   DeepSpeed's clip, on the device
    torch's fused AdamW over the fp32 master partitions with found_inf = bad (no update and no step count
    where bad)
    bf16 partitions <- fp32 master; all-gather (DeepSpeed's update_lp_params); fp32 gradients zeroed

A parameter without a gradient this step holds zeros in g_i (DeepSpeed zeroes g_i after every step), so
the norm over the flat g_i equals DeepSpeed's over the parameters that had one. What the host learns, on
log steps: `applied` (not bad) and the norm (inf when bad), as workers/zero_step.py.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.zero_step import global_norm, unfit_optimizer

REQUIRED = ("fp32_groups_gradients_flat", "fp32_groups_flat_partition", "fp32_groups_gradient_flat_partition",
            "update_lp_params", "clear_hp_grads", "_lazy_init_hp_params_optimizer_state", "clip_grad",
            "grad_acc_dtype", "optimizer")
"""The BF16_Optimizer internals this step uses (checked when it is installed)."""


def owns(optimizer: Any) -> bool:
    """Whether `optimizer` is DeepSpeed's BF16_Optimizer (this module's step may replace its step)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(optimizer, BF16_Optimizer)


def device_step_problem(optimizer: Any) -> str | None:
    """Why `device_step` cannot replace `optimizer.step` (None: it can)."""
    problem = unfit_optimizer(optimizer, REQUIRED, "BF16_Optimizer")
    if problem:
        return problem
    if optimizer.grad_acc_dtype is not torch.float32:
        return f"gradients accumulate in {optimizer.grad_acc_dtype}, not fp32"
    return extension_problem(optimizer)


def extension_problem(optimizer: Any) -> str | None:
    """The DeepSpeed feature on `optimizer` whose gradients take more than BF16_Optimizer's plain path (MoE
    layers, Muon, expert-parallel folding), which this module and workers/bf16_accumulate.py do not
    replace (None: none is on)."""
    for flag in ("has_moe_layers", "_uses_muon"):
        if getattr(optimizer, flag, False):
            return f"DeepSpeed's {flag} is on"
    if getattr(optimizer, "autoep_folding_tp_group", None) is not None:
        return "DeepSpeed's expert-parallel gradient folding is on"
    return None


def device_step(opt: Any, closure: Any = None) -> None:
    """`BF16_Optimizer.step` without host synchronization (module docstring); bound as a method."""
    opt.overflow = False  # the engine's view: the skip happens on the device
    norm, bad = global_norm(opt, list(opt.fp32_groups_gradients_flat))  # all-reduced already: no group
    # DeepSpeed's clip_tensors_by_global_norm (x * max_norm / (norm + 1e-6) when that is < 1), on the device
    coef = torch.clamp(opt.clip_grad / (norm + 1e-6), max=1.0) if opt.clip_grad > 0 else None
    for master, grad in zip(opt.fp32_groups_flat_partition, opt.fp32_groups_gradient_flat_partition,
                            strict=True):
        if coef is not None:
            grad.mul_(coef)
        master.grad = grad  # a view of the flat gradient, as DeepSpeed's step leaves it
    opt.optimizer.found_inf = bad.to(torch.float32)  # torch's fused AdamW skips the update where nonzero
    opt.optimizer.step()
    opt.optimizer.found_inf = None
    opt._lazy_init_hp_params_optimizer_state()  # links the optimizer state for universal checkpoints
    opt.update_lp_params()
    opt.clear_hp_grads()
