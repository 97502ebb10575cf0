"""liger-kernel's fused linear cross-entropy with a backward that never waits for the device.

liger's forward (`liger_kernel.ops.fused_linear_cross_entropy.fused_linear_cross_entropy_forward`) computes,
chunk by chunk, the logits, the loss and both gradients (the hidden rows' and the head weight's), so its
backward only scales those by the incoming gradient. liger's own backward first asks the host whether that
gradient is exactly 1 (`torch.equal` against a tensor it copies to the device), a device synchronization in
every micro-batch's backward. In a torch.profiler trace of the 0.5B shape at C = 16,384 on one H200
(docs/benchmarks.md), the host waited 9.4-10.8 ms there per micro-batch, with the GPU busy running the head's
GEMMs the whole time. The rest of each backward then left the GPU idle 30-44 ms, waiting for the host's
kernel launches, which could have been queued during that wait.

`LinearCrossEntropySum` runs liger's forward and, in its backward, always scales with liger's own in-place
kernel (`element_mul_kernel`: the multiply in fp32, one rounding to the gradient's dtype). That is what
liger's backward does whenever the gradient is not 1, and the product's never is (workers/step.py scales
each micro-batch's loss by W / G). The gradients are the same, and the host never reads the device.
"""

from __future__ import annotations

import torch


class LinearCrossEntropySum(torch.autograd.Function):
    """sum over rows of CE(hidden @ weight.T + bias, targets), fp32 accumulation of the weight's gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_mem_const: int) -> torch.Tensor:
        from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

        outputs = fused_linear_cross_entropy_forward(
            _input=hidden, weight=weight, target=targets, bias=bias, reduction="sum",
            accum_dtype=torch.float32, chunk_mem_const=chunk_mem_const)
        loss, gradients = outputs[0], outputs[-3:]  # (loss, ..., grad_input, grad_weight, grad_bias)
        ctx.save_for_backward(*(None if g is None else g.detach() for g in gradients))
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        for gradient in (grad_input, grad_weight, grad_bias):
            if gradient is not None:
                scale_in_place(gradient, grad_output)
        return grad_input, grad_weight, grad_bias, None, None


def scale_in_place(gradient: torch.Tensor, grad_output: torch.Tensor) -> None:
    """gradient *= grad_output (a device scalar) with liger's element_mul_kernel, one program per row (a
    1-D gradient: one per element), the launch liger's own backward uses."""
    from liger_kernel.ops.fused_linear_cross_entropy import MAX_FUSED_SIZE
    from liger_kernel.ops.utils import element_mul_kernel, is_hip

    rows = gradient.view(-1, gradient.shape[-1]) if gradient.dim() > 1 else gradient.view(-1, 1)
    columns = rows.shape[1]
    block = min(MAX_FUSED_SIZE, 1 << max(columns - 1, 0).bit_length())  # the next power of two
    element_mul_kernel[(rows.shape[0],)](rows, rows.stride(0), grad_output, columns, BLOCK_SIZE=block,
                                        X_col_stride=rows.stride(1), num_warps=16 if is_hip() else 32)
