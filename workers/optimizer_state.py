"""The optimizer's state allocated before the warm-up micro-batch, so that the warm-up holds what every
later micro-batch holds.

torch's AdamW creates its state (exp_avg and exp_avg_sq, 8 bytes per trained parameter of this rank's fp32
master partition, and a step counter) in its first `step`, and DeepSpeed's ZeRO and BF16 optimizers leave
it so. The warm-up micro-batch of C tokens (workers/warmup.py) then runs without it: its peak is the memory
model's less the optimizer's bytes (5 GB for a 0.5B model on one rank), a C that does not fit shows only at
step 2, and the state is carved out of the allocator's cache after the warm-up's activation blocks
(DeepSpeed's fp16 optimizer, by contrast, allocates it at construction). Here it is allocated as torch's own
`torch.distributed.checkpoint` does (`_init_optim_state`), with the step counters put back:

    if the optimizer already has state (a resumed run): nothing
    every fp32 master tensor's .grad <- a view of one zero buffer (AdamW only reads gradients)
    every param group's lr <- 0;  optimizer.step()      (torch allocates the state; with zero gradients and
                                                          lr 0 exp_avg, exp_avg_sq and the weights stay
                                                          exactly as they were, weight decay included)
    lr and .grad put back; every state's "step" <- 0    (the first real step is step 1, as without this)

The masters are the inner torch optimizer's parameters: DeepSpeed's ZeRO-1/2 and BF16 optimizers keep
them in its param groups; ZeRO-3 keeps its sub-groups' flat partitions outside them between steps
(`fp32_partitioned_groups_flat`, put into their group only for the step), so they are put in for this one.
With the optimizer offloaded to the host the state does not live on the device: nothing is done.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

OFFLOAD_FLAGS = ("cpu_offload", "offload_optimizer", "swap_optimizer")
"""DeepSpeed's flags (ZeRO-1/2; ZeRO-3) for an optimizer whose state lives in host memory or on NVMe."""


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under DeepSpeed's wrapper (or `optimizer` itself), None when there is none."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def masters_by_group(optimizer: Any, inner: torch.optim.Optimizer) -> dict[int, list[torch.Tensor]]:
    """Param-group index -> the fp32 master tensors the inner optimizer steps for it (module docstring)."""
    sub_groups = getattr(optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3
    if sub_groups is None:
        return {i: list(group["params"]) for i, group in enumerate(inner.param_groups)}
    masters: dict[int, list[torch.Tensor]] = defaultdict(list)
    for index, flat in enumerate(sub_groups):
        masters[optimizer.sub_group_to_group_id[index]].append(flat)
    return dict(masters)


def allocate_optimizer_state(optimizer: Any) -> bool:
    """Allocate `optimizer`'s state now, without changing weights or state values (module docstring);
    returns whether it did."""
    inner = inner_optimizer(optimizer)
    if inner is None or inner.state or any(getattr(optimizer, flag, False) for flag in OFFLOAD_FLAGS):
        return False
    masters = masters_by_group(optimizer, inner)
    if not any(masters.values()):
        return False
    _zero_step(inner, masters)
    for state in inner.state.values():
        if "step" in state:
            state["step"] = state["step"].zero_() if torch.is_tensor(state["step"]) else 0
    return True


def _zero_step(inner: torch.optim.Optimizer, masters: dict[int, list[torch.Tensor]]) -> None:
    """One `inner.step()` over `masters` with zero gradients at lr 0; param lists, lr and .grad put back."""
    tensors = [t for group in masters.values() for t in group]
    zeros = torch.zeros(max(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    saved = [(group["params"], group["lr"]) for group in inner.param_groups]
    grads = [t.grad for t in tensors]
    try:
        for index, group in enumerate(inner.param_groups):
            group["params"] = masters.get(index, [])
            group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        for tensor in tensors:
            tensor.grad = zeros[:tensor.numel()].view_as(tensor)
        inner.step()
    finally:
        for group, (params, lr) in zip(inner.param_groups, saved, strict=True):
            group["params"], group["lr"] = params, lr
        for tensor, grad in zip(tensors, grads, strict=True):
            tensor.grad = grad
