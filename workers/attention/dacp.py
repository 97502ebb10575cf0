"""DACP attention: local sequences by varlen attention, each ring part by its zigzag ring, overlapped.

    stream  [ local part (L tokens) | distributed part (degree N) | partial part (degree d) | ... ]
    forward : post every ring's first K/V transfer -> local attention (no comm) -> round-robin over the
              rings: diagonal blocks, then ring step j of every ring per round
    backward: the same, with the local backward and the rings' backward steps

The local part and the ring parts share no keys, and each ring part runs on its own communicator (the CP
group, or this rank's aligned subgroup of d ranks: per-sequence CP degrees, docs/design.md §13), so the
local attention hides the first ring transfers and each ring's compute hides the other rings' transfers
(workers/attention/ring.py: run_rings); no ring waits for another to finish. `overlap=False` runs the
same work serialized (local first, then each ring alone, in order), which only the benchmark uses as a
comparison.

The stream's segments and shard rows come as a DacpIndex (workers/attention/index.py), built once per
micro-batch and shared by every layer; a plain DacpLayout is indexed here, once for this call.
"""

from __future__ import annotations

import torch

from workers.attention.index import DacpIndex
from workers.attention.layout import DacpLayout
from workers.attention.ring import ring_backward_steps, ring_forward_steps, run_rings
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
    for part in layout.partial:
        runtime.comm_for(part.degree)  # raises naming the missing subgroup before any transfer is posted


def dacp_attention_forward_parts(q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
                                 index: DacpIndex, runtime: AttentionRuntime, scale: float,
                                 overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D], lse [H, T] fp32): the local part and every ring part, overlapped (module docstring)."""
    kernel = runtime.kernel
    num_local = index.layout.num_local_tokens
    # Empty ring parts (no distributed sequence) have nothing to exchange: no ring at all.
    rings = [ring for ring in index.rings if ring.num_tokens]
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def local() -> None:
        parts["local"] = kernel.forward(q_THD[:num_local], k_KGD[:num_local], v_KGD[:num_local],
                                        index.local, scale=scale)

    steps = [ring_forward_steps(kernel, q_THD[r.rows], k_KGD[r.rows], v_KGD[r.rows], r,
                                runtime.comm_for(r.degree), scale) for r in rings]
    results = run_rings(steps, local, concurrent=overlap)  # runs local() too, rings or not
    outs = [parts["local"], *results]
    if len(outs) == 1:  # no ring: the local kernel's own tensors, contiguous as a cat would make them
        # (the custom op's fake says so), copied only where the kernel followed odd strides of q
        out_THD, lse_HT = outs[0]
        return out_THD.contiguous(), lse_HT.contiguous()
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs], dim=1)


def dacp_attention_backward_parts(dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor,
                                  v_KGD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor,
                                  index: DacpIndex, runtime: AttentionRuntime, scale: float,
                                  overlap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of dacp_attention_forward_parts: the local backward and the rings' backward steps."""
    kernel = runtime.kernel
    loc = slice(0, index.layout.num_local_tokens)
    dout_THD = dout_THD.contiguous()
    rings = [ring for ring in index.rings if ring.num_tokens]
    grads: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def local() -> None:
        grads["local"] = kernel.backward(dout_THD[loc], q_THD[loc], k_KGD[loc], v_KGD[loc], out_THD[loc],
                                         lse_HT[:, loc], index.local, scale=scale)

    steps = [ring_backward_steps(kernel, dout_THD[r.rows], q_THD[r.rows], k_KGD[r.rows], v_KGD[r.rows],
                                 out_THD[r.rows], lse_HT[:, r.rows], r, runtime.comm_for(r.degree), scale)
             for r in rings]
    results = run_rings(steps, local, concurrent=overlap)  # runs local() too, rings or not
    parts = [grads["local"], *results]
    if len(parts) == 1:  # no ring: the local gradients, copied only where not contiguous (as above)
        dq, dk, dv = parts[0]
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    dq, dk, dv = (torch.cat([p[i] for p in parts]) for i in range(3))
    return dq, dk, dv


class _DacpAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_KGD, v_KGD, index, runtime, scale, overlap):
        out_THD, lse_HT = dacp_attention_forward_parts(q_THD, k_KGD, v_KGD, index, runtime, scale, overlap)
        ctx.save_for_backward(q_THD, k_KGD, v_KGD, out_THD, lse_HT)
        ctx.setup = (index, runtime, scale, overlap)
        ctx.mark_non_differentiable(lse_HT)
        return out_THD, lse_HT

    @staticmethod
    def backward(ctx, dout_THD, _dlse):
        q_THD, k_KGD, v_KGD, out_THD, lse_HT = ctx.saved_tensors
        index, runtime, scale, overlap = ctx.setup
        dq, dk, dv = dacp_attention_backward_parts(dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, index,
                                                   runtime, scale, overlap)
        return dq, dk, dv, None, None, None, None


def dacp_attention(
    q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor, layout: DacpLayout | DacpIndex,
    runtime: AttentionRuntime | None = None, *, scale: float | None = None, overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one CP rank's packed DACP stream; returns (out [T,H,D], lse [H,T] fp32).

    q [T, H, D]; k, v [T, G, D] with H % G == 0. `layout`: the micro-batch's DacpIndex on q's device
    (what a model's layers share), or a DacpLayout, indexed here for this call alone. `runtime` carries the
    kernel and the ring communicators of the CP group and of this rank's CP subgroups (None: the
    single-rank "auto" runtime of q's device). Differentiable in q, k, v (lse is not). Every rank of a ring
    must call it with layouts built from the same plan (a ring part has the same shape on all its ranks).
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
    return _DacpAttention.apply(q_THD, k_KGD, v_KGD, index, runtime, scale, overlap)
