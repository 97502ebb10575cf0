"""The ZeRO-1/2 optimizer step without a host synchronization (train.optimizer_impl: fused).

DeepSpeed's own step (deepspeed/runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.step`) reads the
device three times per step, each a host synchronization that leaves the GPU idle while Python catches up:
its overflow scan (`has_overflow`: one inf/NaN reduction per gradient tensor, then `.item()`), the
validity test of the norm (`is_invalid_grad_norm`: `bool(tensor)`), and the clipping's norm check
(`unscale_and_clip_grads`, again `bool(tensor)`); its norm runs one `vector_norm` per parameter. This step
computes the same update on the device alone:

    per param group i:   g_i = this rank's flat fp32 gradient partition (DeepSpeed's own buffers)
    norm  = sqrt(all_reduce_sum(sum_i ||g_i||^2))        one kernel per group, one collective
    bad   = not isfinite(norm)                            the non-finite guard's flag (a device tensor)
    clip  = max(1, (norm + 1e-6) / grad_clip)             DeepSpeed's formula, on the device
    g_i  /= clip;  torch's fused AdamW with found_inf = bad   (skips the update on the device when bad,
                                                              step counters included: torch's GradScaler
                                                              contract for fused optimizers)
    bit16 params <- fp32 master; all-gather of the partitions   as DeepSpeed does

A step whose loss was inf/NaN has NaN gradients (workers/nonfinite.py), so `bad` covers a bad loss as well
as a bad gradient; nothing of it reaches the weights or the optimizer state, exactly as DeepSpeed's overflow
path. DeepSpeed's engine then sees a step without overflow and steps the learning-rate schedule, which the
product wants anyway (workers/lr_schedule.py `skip` advances it past a step DeepSpeed skipped). What the
host learns later, on log steps: `applied` (not bad) and the norm (reported as inf when bad).

Installed on an engine whose optimizer is DeepSpeed's ZeRO-1/2 optimizer around torch's fused AdamW,
without CPU offload, fp16 loss scaling, Muon, ZenFlow or MoE (workers/device_step.py `install_device_step`
says why not otherwise, and the engine keeps DeepSpeed's step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

REQUIRED = ("averaged_gradients", "all_grad_tensors", "bit16_groups", "params_in_partition",
            "params_not_in_partition", "partition_size", "single_partition_of_fp32_groups",
            "parallel_partitioned_bit16_groups", "bit16_groups_flat", "real_dp_process_group",
            "dp_process_group", "free_grad_in_param_list", "_get_preflattened_grad_partition",
            "_release_preflattened_grad_buffers", "flatten_dense_tensors_aligned", "flatten",
            "_optimizer_step", "_update_model_bit16_weights", "clip_grad", "loss_scale",
            "nccl_start_alignment_factor", "allgather_bucket_size")
"""The DeepSpeed ZeRO-1/2 optimizer internals this step uses (checked when it is installed)."""


def device_step_problem(zero_optimizer: Any) -> str | None:
    """Why the device step cannot replace `zero_optimizer.step` (None: it can)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(zero_optimizer, DeepSpeedZeroOptimizer):
        return f"the engine's optimizer is {type(zero_optimizer).__name__}, not DeepSpeed's ZeRO-1/2 one"
    problem = unfit_optimizer(zero_optimizer, REQUIRED, "ZeRO optimizer")
    if problem:
        return problem
    for flag in ("cpu_offload", "zenflow", "has_moe_layers"):
        if getattr(zero_optimizer, flag, False):
            return f"DeepSpeed's {flag} is on"
    if getattr(zero_optimizer, "torch_autocast_gradscaler", None) is not None:
        return "DeepSpeed runs torch autocast's gradient scaler"
    if float(zero_optimizer.loss_scale) != 1.0:
        return "fp16 loss scaling is on"
    return None


def unfit_optimizer(optimizer: Any, required: tuple[str, ...], kind: str) -> str | None:
    """Why no device step fits `optimizer` by its make-up: DeepSpeed internals it lacks (another DeepSpeed
    version), or a wrapped optimizer other than torch's fused AdamW (None: neither)."""
    missing = [name for name in required if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's {kind} lacks {', '.join(missing)}"
    inner = optimizer.optimizer
    if not isinstance(inner, torch.optim.AdamW) or not all(g.get("fused") for g in inner.param_groups):
        return f"the wrapped optimizer is {type(inner).__name__} without fused=True"
    return None


def global_norm(opt: Any, grads: list[torch.Tensor], group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm, bad) of `grads` on the device: one norm kernel per tensor, their squares summed (and summed
    over `group` when given: partitions), bad = not finite; records what the engine and the host read on
    `opt` (`_global_grad_norm`, inf when bad; `skrull_applied`)."""
    squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
    if group is not None:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    norm = squares.sqrt()
    bad = ~torch.isfinite(norm)
    opt._global_grad_norm = torch.where(bad, torch.full_like(norm, float("inf")), norm)
    opt.skrull_applied = ~bad
    return norm, bad


def _partition_grad(opt: Any, i: int) -> torch.Tensor:
    """This rank's flat gradient partition of group i in the master dtype, as DeepSpeed's step builds it."""
    flat = opt._get_preflattened_grad_partition(i)
    if flat is None:
        partition_id = dist.get_rank(group=opt.real_dp_process_group[i])
        if partition_id == dist.get_world_size(group=opt.real_dp_process_group[i]) - 1:
            flat = opt.flatten_dense_tensors_aligned(opt.averaged_gradients[i], int(opt.partition_size[i]))
        else:
            flat = opt.flatten(opt.averaged_gradients[i])
    return flat.to(opt.single_partition_of_fp32_groups[i].dtype)


def device_step(opt: Any, closure: Any = None) -> None:
    """`DeepSpeedZeroOptimizer.step` without host synchronization (module docstring); bound as a method."""
    from deepspeed.runtime.utils import all_gather_dp_groups
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    opt.micro_step_id = INITIAL_MICRO_STEP_ID  # the next backward starts a new step
    opt.overflow = False  # the engine's view: the skip happens on the device
    groups = range(len(opt.bit16_groups))
    for i in groups:
        opt.free_grad_in_param_list(opt.params_not_in_partition[i])
    grads = [_partition_grad(opt, i) for i in groups]
    norm, bad = global_norm(opt, grads, group=opt.dp_process_group)
    if opt.clip_grad > 0:
        clip = torch.clamp((norm + 1e-6) / opt.clip_grad, min=1.0)
        for g in grads:
            g.div_(clip)
    found_inf = bad.to(torch.float32)
    for i, grad in zip(groups, grads, strict=True):
        master = opt.single_partition_of_fp32_groups[i]
        master.grad = grad
        opt.free_grad_in_param_list(opt.params_in_partition[i])
        opt._release_preflattened_grad_buffers(i)
        opt.averaged_gradients[i] = None
        opt.all_grad_tensors[i] = None
        opt.optimizer.found_inf = found_inf  # torch's fused AdamW skips the update where it is nonzero
        opt._optimizer_step(i)
        master.grad = None
        partition_id = dist.get_rank(group=opt.real_dp_process_group[i])
        opt.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(master.data)
    opt.optimizer.found_inf = None
    all_gather_dp_groups(groups_flat=opt.bit16_groups_flat,
                         partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                         dp_process_group=opt.real_dp_process_group,
                         start_alignment_factor=opt.nccl_start_alignment_factor,
                         allgather_bucket_size=opt.allgather_bucket_size)
    for i in groups:
        opt._update_model_bit16_weights(i)


def place_step_counters(engine: Any) -> None:
    """Put fused AdamW's `step` counters on their parameters' device, as fp32 scalars.

    torch's fused AdamW keeps `step` on the parameters' device (torch/optim/adam.py), which its own
    load_state_dict arranges; DeepSpeed's universal-checkpoint loader (resuming on another world size)
    restores it as the CPU tensor ds_to_universal saved, and the fused kernel then refuses the mix of
    devices. Called after every checkpoint load; a no-op for other implementations.
    """
    zero_optimizer = getattr(engine, "optimizer", None)
    inner = getattr(zero_optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return
    for group in inner.param_groups:
        if not group.get("fused"):
            continue
        for param in group["params"]:
            state = inner.state.get(param, {})
            step = state.get("step")
            if step is None:
                continue
            if not torch.is_tensor(step):  # a number, as a checkpoint may hold it
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=param.device)
            elif step.device != param.device or step.dtype != torch.float32:
                state["step"] = step.to(device=param.device, dtype=torch.float32)
