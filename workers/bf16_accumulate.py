"""BF16_Optimizer's gradient accumulation with one kernel and a few Python lines per parameter.

DeepSpeed's BF16_Optimizer (ZeRO-1 in bf16: one worker, workers/engine.py for_world_size) adds every
parameter's bf16 gradient to its slice of a flat fp32 gradient in a hook that runs as soon as autograd has
accumulated it (`bf16.immediate_grad_update`), then frees the bf16 gradient. Its hook goes through
`accumulate_hp_grads_and_remove_lp` -> `_update_hp_grad`: checks, `lp.grad.data.to(fp32).view(shape)` (an
fp32 copy: an allocation and a kernel) and `add_` (a second kernel). On a GPU that is launch-bound, as the
0.5B shape is at C = 16,384 tokens, this is the largest host cost of the backward: 78 ms of one 0.52 s step's
backward-thread time for 291 parameters x 3 micro-batches (H200 torch.profiler trace, 2026-11-28,
docs/benchmarks.md), while the device idled 107 ms in backward.

This module replaces those hooks with one per parameter that does (autograd runs it with gradients off)

    fp32_slice.view(shape).add_(bf16_grad)      one kernel: the in-place add computes in fp32 (each bf16
                                                element is widened exactly), so the sum is bit for bit the
                                                one of DeepSpeed's copy-then-add
    has_gradient[j] = True; param.grad = None   DeepSpeed's bookkeeping, and the bf16 gradient freed

The fp32 views are made once, at install. `_hp_grad` (what DeepSpeed's hook sets on every call) is set
then too: it is the same tensor every time.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.bf16_step import extension_problem


def lean_accumulation_problem(optimizer: Any) -> str | None:
    """Why `install` cannot replace `optimizer`'s hooks (None: it can). Only DeepSpeed's plain path is
    replaced: no MoE, Muon or expert-parallel folding, whose hooks do more."""
    needed = ("bf16_groups", "fp32_groups_gradients", "fp32_groups_has_gradients", "_grad_acc_hooks",
              "immediate_grad_update")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"DeepSpeed's BF16_Optimizer lacks {', '.join(missing)} (another DeepSpeed version)"
    if not optimizer.immediate_grad_update:
        return "bf16.immediate_grad_update is off"
    return extension_problem(optimizer)


def install(optimizer: Any) -> None:
    """Replace every gradient-accumulation hook of `optimizer` (a BF16_Optimizer with no
    `lean_accumulation_problem`) with the lean one of the module docstring."""
    for handle in optimizer._grad_acc_hooks:
        handle.remove()
    optimizer._grad_acc_hooks = []
    flags = optimizer.fp32_groups_has_gradients  # its inner lists are replaced at every step: index from here
    for group, (params, slices) in enumerate(zip(optimizer.bf16_groups, optimizer.fp32_groups_gradients,
                                                 strict=True)):
        for index, (param, flat) in enumerate(zip(params, slices, strict=True)):
            if param.requires_grad:
                param._hp_grad = flat
                hook = _accumulator(flat.view(param.shape), flags, group, index)
                optimizer._grad_acc_hooks.append(param.register_post_accumulate_grad_hook(hook))


def _accumulator(target: torch.Tensor, flags: list[list[bool]], group: int, index: int) -> Any:
    """The hook of one parameter: add its bf16 gradient into `target` (its fp32 slice), mark, free."""

    def accumulate(param: torch.Tensor) -> None:
        target.add_(param.grad)
        flags[group][index] = True
        param.grad = None

    return accumulate
