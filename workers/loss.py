"""Chunked linear + cross-entropy: the LM head and the loss without ever holding all logits.

    hidden_TE --(chunk of C tokens)--> logits_CV (fp32) --> CE sum, d_logits = softmax - onehot
                                                        --> d_hidden_CE, d_weight_VE accumulated

Forward computes the gradients chunk by chunk right away (as fused linear-CE kernels do), so peak
memory is one chunk's logits [C, V] plus the gradient buffers, never [T, V]. Backward only scales the
stored gradients by the upstream gradient of the loss sum.
"""

from __future__ import annotations

import torch

from scheduling.payload import IGNORE_INDEX


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TE, weight_VE, bias_V, targets_T, chunk):
        loss = torch.zeros((), dtype=torch.float32, device=hidden_TE.device)
        d_hidden = torch.zeros_like(hidden_TE)
        d_weight = torch.zeros(weight_VE.shape, dtype=torch.float32, device=weight_VE.device)
        d_bias = None if bias_V is None else torch.zeros(bias_V.shape, dtype=torch.float32,
                                                          device=bias_V.device)
        for start in range(0, hidden_TE.shape[0], chunk):
            tgt = targets_T[start:start + chunk]
            keep = tgt != IGNORE_INDEX
            if not bool(keep.any()):
                continue
            h = hidden_TE[start:start + chunk][keep]
            logits = torch.nn.functional.linear(h, weight_VE, bias_V).float()
            loss += torch.nn.functional.cross_entropy(logits, tgt[keep], reduction="sum")
            d_logits = torch.softmax(logits, dim=-1)
            d_logits[torch.arange(d_logits.shape[0], device=h.device), tgt[keep]] -= 1.0
            rows = torch.nonzero(keep).flatten() + start
            d_hidden[rows] = (d_logits.to(weight_VE.dtype) @ weight_VE).to(d_hidden.dtype)
            d_weight += d_logits.T @ h.float()
            if d_bias is not None:
                d_bias += d_logits.sum(0)
        ctx.save_for_backward(d_hidden, d_weight, *(() if d_bias is None else (d_bias,)))
        ctx.has_bias = d_bias is not None
        ctx.param_dtype = weight_VE.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        d_hidden, d_weight, *rest = ctx.saved_tensors
        d_bias = (rest[0] * grad_loss).to(ctx.param_dtype) if ctx.has_bias else None
        return (d_hidden * grad_loss.to(d_hidden.dtype), (d_weight * grad_loss).to(ctx.param_dtype),
                d_bias, None, None)


def linear_cross_entropy_sum(
    hidden_TE: torch.Tensor, head: torch.nn.Linear, targets_T: torch.Tensor, chunk_tokens: int = 4096
) -> torch.Tensor:
    """fp32 sum of CE(head(hidden[t]), targets[t]) over targets != -100, in chunks of chunk_tokens."""
    if chunk_tokens < 1:
        raise ValueError("train.loss_chunk_tokens must be >= 1")
    return _ChunkedLinearCE.apply(hidden_TE, head.weight, head.bias, targets_T, chunk_tokens)
