"""DACP attention: local sequences by varlen attention, distributed shards by the ring, overlapped.

    stream  [ local part (L tokens) | distributed part (2 * sum c_i tokens) ]
    forward : post K/V transfer #1 -> local attention (no comm) -> diagonal block -> ring steps
    backward: post K/V transfer #1 -> local backward            -> diagonal block -> ring steps

The local and distributed parts share no keys, so the local attention is the work that hides the
first ring transfer (docs/design.md section 7). `overlap=False` runs the same work serialized (local
first, then the ring posts its first transfer), which only the benchmark uses as a comparison.

The stream's segments and shard rows come as a DacpIndex (workers/attention/index.py), built once per
micro-batch and shared by every layer; a plain DacpLayout is indexed here, once for this call.
"""

from __future__ import annotations

import torch

from workers.attention.index import DacpIndex
from workers.attention.layout import DacpLayout
from workers.attention.ring import ring_backward, ring_forward
from workers.attention.runtime import AttentionRuntime, default_runtime


def _check(runtime: AttentionRuntime, index: DacpIndex, q_THD: torch.Tensor) -> None:
    layout, num_tokens = index.layout, q_THD.shape[0]
    if index.device != q_THD.device:
        raise ValueError(f"the DacpIndex was built for {index.device}, the attention runs on {q_THD.device}")
    if layout.cp_size != runtime.cp_size:
        raise ValueError(f"batch built for cp_size={layout.cp_size} but the CP group has "
                         f"{runtime.cp_size} ranks")
    if layout.num_tokens != num_tokens:
        raise ValueError(f"layout describes {layout.num_tokens} tokens but the stream has {num_tokens}")


class _DacpAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_KGD, v_KGD, index, comm, scale, kernel, overlap):
        layout = index.layout
        num_local = layout.num_local_tokens
        parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def local() -> None:
            parts["local"] = kernel.forward(q_THD[:num_local], k_KGD[:num_local], v_KGD[:num_local],
                                            index.local, scale=scale)

        has_dist = layout.num_dist_tokens > 0
        if not (overlap and has_dist):
            local()
        if has_dist:
            d = slice(num_local, None)
            parts["dist"] = ring_forward(kernel, q_THD[d], k_KGD[d], v_KGD[d], index, comm, scale,
                                         overlap=local if overlap else None)
        out_THD = torch.cat([parts["local"][0], *([parts["dist"][0]] if has_dist else [])])
        lse_HT = torch.cat([parts["local"][1], *([parts["dist"][1]] if has_dist else [])], dim=1)
        ctx.save_for_backward(q_THD, k_KGD, v_KGD, out_THD, lse_HT)
        ctx.setup = (index, comm, scale, kernel, overlap)
        ctx.mark_non_differentiable(lse_HT)
        return out_THD, lse_HT

    @staticmethod
    def backward(ctx, dout_THD, _dlse):
        q_THD, k_KGD, v_KGD, out_THD, lse_HT = ctx.saved_tensors
        index, comm, scale, kernel, overlap = ctx.setup
        layout = index.layout
        num_local = layout.num_local_tokens
        dout_THD = dout_THD.contiguous()
        grads: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        loc = slice(0, num_local)

        def local() -> None:
            grads["local"] = kernel.backward(dout_THD[loc], q_THD[loc], k_KGD[loc], v_KGD[loc], out_THD[loc],
                                             lse_HT[:, loc], index.local, scale=scale)

        has_dist = layout.num_dist_tokens > 0
        if not (overlap and has_dist):
            local()
        if has_dist:
            d = slice(num_local, None)
            grads["dist"] = ring_backward(kernel, dout_THD[d], q_THD[d], k_KGD[d], v_KGD[d], out_THD[d],
                                          lse_HT[:, d], index, comm, scale,
                                          overlap=local if overlap else None)
        names = ["local", "dist"] if has_dist else ["local"]
        dq, dk, dv = (torch.cat([grads[n][i] for n in names]) for i in range(3))
        return dq, dk, dv, None, None, None, None, None


def dacp_attention(
    q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor, layout: DacpLayout | DacpIndex,
    runtime: AttentionRuntime | None = None, *, scale: float | None = None, overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one CP rank's packed DACP stream; returns (out [T,H,D], lse [H,T] fp32).

    q [T, H, D]; k, v [T, G, D] with H % G == 0. `layout`: the micro-batch's DacpIndex on q's device
    (what a model's layers share), or a DacpLayout, indexed here for this call alone. `runtime` carries the
    kernel and the CP group's ring communicator (None: the single-rank "auto" runtime of q's device).
    Differentiable in q, k, v (lse is not). Every rank of the group must call it with layouts built from the
    same plan (the distributed part has the same shape on all ranks).
    """
    if runtime is None:
        runtime = default_runtime(q_THD.device)
    elif not isinstance(runtime, AttentionRuntime):
        # The old signature took the CP process group here.
        raise TypeError(f"dacp_attention takes an AttentionRuntime (AttentionRuntime.create(cp_group, "
                        f"device, backend)), got {type(runtime).__name__}")
    if q_THD.shape[1] % k_KGD.shape[1]:
        raise ValueError(f"query heads {q_THD.shape[1]} not divisible by key/value heads {k_KGD.shape[1]}")
    index = layout if isinstance(layout, DacpIndex) else DacpIndex.build(layout, q_THD.device)
    _check(runtime, index, q_THD)
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    return _DacpAttention.apply(q_THD, k_KGD, v_KGD, index, runtime.comm, scale, runtime.kernel, overlap)
