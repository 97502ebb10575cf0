"""Helpers for the multi-process attention and model tests: references nobody here wrote, tolerances."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def excess(ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> float:
    """max(|ours - ref| - (atol + rtol * |ref|)): > 0 means out of tolerance (allclose's rule)."""
    if ours.numel() == 0:
        return 0.0
    diff = (ours.double() - ref.double()).abs() - (atol + rtol * ref.double().abs())
    return float(diff.max())


def sdpa_reference(q_SHD: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, dout_SHD: torch.Tensor,
                   scale: float) -> dict[str, torch.Tensor]:
    """PyTorch SDPA (causal, GQA) on one whole sequence in fp32: out, lse, and dq/dk/dv by autograd."""
    q, k, v = (x.detach().float().transpose(0, 1).requires_grad_() for x in (q_SHD, k_SGD, v_SGD))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    out.backward(dout_SHD.float().transpose(0, 1))
    rep = q.shape[0] // k.shape[0]
    scores = scale * q.detach() @ k.detach().repeat_interleave(rep, 0).transpose(1, 2)
    n = q.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1).T  # [S, H]
    return {"out": out.detach().transpose(0, 1), "lse": lse, "dq": q.grad.transpose(0, 1),
            "dk": k.grad.transpose(0, 1), "dv": v.grad.transpose(0, 1)}
