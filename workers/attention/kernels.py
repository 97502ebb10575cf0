"""Varlen attention kernels behind one small interface, chosen by a string.

Legend (shapes in names): T = packed query tokens, K = packed key tokens, H = query heads,
G = key/value heads (H % G == 0: GQA when G < H), D = head dim, B1 = number of segments + 1.

    q_THD  = [ seq0 tokens | seq1 tokens | ... ]      cu_q_B1 = [0, len_q0, len_q0 + len_q1, ...]
    k_KGD  = [ seq0 keys   | seq1 keys   | ... ]      cu_k_B1 = [0, len_k0, ...]

Segment i's queries attend only to segment i's keys. `causal=True` requires len_q_i == len_k_i (the
only causal shape the ring ever needs: a diagonal block). Each kernel returns the output and the
natural-log log-sum-exp of the scaled scores, lse_HT in fp32, which the ring merges across blocks.
`backward` takes the *final* (merged) out and lse, as flash-attention's backward does, so a block's
gradient is exact even though its own softmax was only a partial one.

Backends:
- "torch" (CPU): one call of aten's flash-attention-for-CPU op per segment (O(len^2) per segment,
  never a dense T x T mask over the packed stream). GQA is expanded per segment inside the kernel
  only; what travels over the ring stays G-headed.
- "torch-flash" (CUDA, bf16/fp16): PyTorch's own FlashAttention-2 varlen op (aten._flash_attention_forward
  / _backward), one call for all segments, GQA native; needs nothing beyond a CUDA build of torch.
- "flash" (CUDA): the flash-attn 2 package's varlen forward/backward, imported lazily (`[gpu]` extra,
  flash-attn FLASH_ATTN_VERSIONS). Its backward is flash-attn's private `_flash_attn_varlen_backward`,
  called by keyword only (FLASH_VARLEN_BACKWARD_KWARGS): 2.6 took `window_size` as one tuple, 2.7 split
  it into window_size_left / window_size_right, and 2.7.3 appended `zero_tensors` (defaulted): a
  positional call binds values to the wrong parameters on another version, a keyword call cannot.
- "auto": flash when flash-attn is installed and the device is CUDA, torch-flash on CUDA otherwise,
  torch on CPU.

`make_kernel(name, device)` resolves the name once (a worker builds its kernel when it builds its
process groups, see workers/attention/runtime.py), never per attention call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, Protocol

import torch

Cu = Sequence[int]

BACKENDS = ("auto", "torch", "torch-flash", "flash")
"""Values of `model.attention_backend`."""

FLASH_ATTN_VERSIONS = ">=2.7,<2.9"
"""flash-attn releases whose `_flash_attn_varlen_backward` accepts FLASH_VARLEN_BACKWARD_KWARGS (checked
against the 2.6.3, 2.7.0-2.7.4 and 2.8.0-2.8.3 sources; 2.6 has `window_size` instead): the `gpu` extra."""

FLASH_VARLEN_BACKWARD_KWARGS = (
    "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
    "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
    "window_size_right", "softcap", "alibi_slopes", "deterministic",
)
"""Exactly the keywords FlashAttnKernel.backward passes: every parameter of the 2.7+ signature without a
default (the optional rng_state and zero_tensors keep their defaults)."""


class VarlenKernel(Protocol):
    def forward(
        self, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
        cu_q: Cu, cu_k: Cu, *, causal: bool, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
        out_THD: torch.Tensor, lse_HT: torch.Tensor, cu_q: Cu, cu_k: Cu, *, causal: bool, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _segments(cu_q: Cu, cu_k: Cu, causal: bool) -> list[tuple[int, int, int, int]]:
    """Non-empty (q_start, q_end, k_start, k_end) pairs; empty key segments contribute nothing."""
    if len(cu_q) != len(cu_k):
        raise AssertionError(f"cu_q has {len(cu_q)} entries, cu_k {len(cu_k)}")
    spans = []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if causal and q1 - q0 != k1 - k0:
            raise AssertionError("causal varlen blocks must be square")
        if q1 > q0 and k1 > k0:
            spans.append((q0, q1, k0, k1))
    return spans


def _to_bhsd(x_SHD: torch.Tensor, heads: int) -> torch.Tensor:
    """[S, G, D] -> [1, H, S, D], repeating each KV head H/G times (GQA) for the aten op."""
    rep = heads // x_SHD.shape[1]
    x = x_SHD.transpose(0, 1)
    if rep > 1:
        x = x.repeat_interleave(rep, dim=0)
    return x.unsqueeze(0)


class TorchCpuKernel:
    """aten._scaled_dot_product_flash_attention_for_cpu per segment (returns lse; ~5e-7 fp32 error)."""

    def forward(self, q_THD, k_KGD, v_KGD, cu_q, cu_k, *, causal, scale):
        num_t, heads, _ = q_THD.shape
        out_THD = torch.zeros_like(q_THD)
        # Rows that see no key keep lse = -inf so a log-sum-exp merge ignores them (the aten op
        # would report 0 there: the lse = 0 trap, docs/design.md section 9).
        lse_HT = torch.full((heads, num_t), float("-inf"), dtype=torch.float32, device=q_THD.device)
        for q0, q1, k0, k1 in _segments(cu_q, cu_k, causal):
            q = q_THD[q0:q1].transpose(0, 1).unsqueeze(0)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, _to_bhsd(k_KGD[k0:k1], heads), _to_bhsd(v_KGD[k0:k1], heads),
                0.0, causal, scale=scale,
            )[:2]
            out_THD[q0:q1] = out[0].transpose(0, 1)
            lse_HT[:, q0:q1] = lse[0]
        return out_THD, lse_HT

    def backward(self, dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, cu_q, cu_k, *, causal, scale):
        heads, groups = q_THD.shape[1], k_KGD.shape[1]
        dq_THD = torch.zeros_like(q_THD)
        dk_KGD = torch.zeros_like(k_KGD)
        dv_KGD = torch.zeros_like(v_KGD)
        for q0, q1, k0, k1 in _segments(cu_q, cu_k, causal):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout_THD[q0:q1].transpose(0, 1).unsqueeze(0).contiguous(),
                q_THD[q0:q1].transpose(0, 1).unsqueeze(0),
                _to_bhsd(k_KGD[k0:k1], heads), _to_bhsd(v_KGD[k0:k1], heads),
                out_THD[q0:q1].transpose(0, 1).unsqueeze(0).contiguous(),
                lse_HT[:, q0:q1].unsqueeze(0).contiguous(),
                0.0, causal, scale=scale,
            )
            dq_THD[q0:q1] = dq[0].transpose(0, 1)
            # Fold the repeated heads back onto their KV head: [H, S, D] -> [G, H/G, S, D] -> sum.
            n = k1 - k0
            dk_KGD[k0:k1] = dk[0].view(groups, heads // groups, n, -1).sum(1).transpose(0, 1)
            dv_KGD[k0:k1] = dv[0].view(groups, heads // groups, n, -1).sum(1).transpose(0, 1)
        return dq_THD, dk_KGD, dv_KGD


def _cu_tensor(cu: Cu, device: torch.device) -> tuple[torch.Tensor, int]:
    """cu_seqlens as int32 on `device`, and the longest segment (both varlen CUDA ops want them)."""
    cu_t = torch.tensor(list(cu), dtype=torch.int32, device=device)
    max_len = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)
    return cu_t, max_len


def _empty_forward(q_THD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """No queries or no keys: zero output and lse = -inf (an empty block that a merge ignores)."""
    lse_HT = torch.full((q_THD.shape[1], q_THD.shape[0]), float("-inf"), dtype=torch.float32,
                        device=q_THD.device)
    return torch.zeros_like(q_THD), lse_HT


class TorchFlashKernel:
    """PyTorch's built-in FlashAttention-2 varlen kernel (CUDA). lse_HT is [H, total_q] fp32.

    With dropout 0 the op's RNG state is never read, so backward passes an empty one.
    """

    @staticmethod
    def _check(q_THD: torch.Tensor) -> None:
        if not q_THD.is_cuda or q_THD.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the 'torch-flash' attention backend needs bf16/fp16 CUDA tensors, got {q_THD.dtype} on "
                f"{q_THD.device}: set model.dtype=bf16 (or use the 'torch' backend on CPU)"
            )

    def forward(self, q_THD, k_KGD, v_KGD, cu_q, cu_k, *, causal, scale):
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return _empty_forward(q_THD)
        self._check(q_THD)
        cq, mq = _cu_tensor(cu_q, q_THD.device)
        ck, mk = _cu_tensor(cu_k, q_THD.device)
        out, lse = torch.ops.aten._flash_attention_forward(
            q_THD, k_KGD, v_KGD, cq, ck, mq, mk, 0.0, causal, False, scale=scale,
        )[:2]
        if lse.shape != (q_THD.shape[1], q_THD.shape[0]):
            # The ring's merge relies on the unpadded [H, total_q] layout; older builds padded it.
            raise RuntimeError(f"aten._flash_attention_forward returned lse of shape {tuple(lse.shape)}, "
                               f"expected [H, total_q]: use the 'flash' backend (pip install '.[gpu]')")
        return out, lse.float()

    def backward(self, dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, cu_q, cu_k, *, causal, scale):
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return torch.zeros_like(q_THD), torch.zeros_like(k_KGD), torch.zeros_like(v_KGD)
        self._check(q_THD)
        cq, mq = _cu_tensor(cu_q, q_THD.device)
        ck, mk = _cu_tensor(cu_k, q_THD.device)
        unused = torch.empty(0, dtype=torch.int64, device=q_THD.device)
        rng_state = torch.zeros(2, dtype=torch.int64, device=q_THD.device)
        return torch.ops.aten._flash_attention_backward(
            dout_THD.contiguous(), q_THD, k_KGD, v_KGD, out_THD.contiguous(), lse_HT.contiguous(), cq, ck,
            mq, mk, 0.0, causal, rng_state, unused, scale=scale,
        )


def flash_backward_parameters(fai: Any) -> dict[str, inspect.Parameter] | None:
    """Parameters of `fai._flash_attn_varlen_backward`, or None when they cannot be read.

    From 2.7 on the function is wrapped by torch.library.custom_op, whose own signature is
    (*args, **kwargs); the wrapped Python function (`_init_fn`) carries the real one.
    """
    fn = fai._flash_attn_varlen_backward
    try:
        params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return dict(params)


def flash_backward_mismatch(params: dict[str, inspect.Parameter]) -> list[str]:
    """What our keyword call gets wrong against `params`: keywords it lacks, required ones we omit."""
    unknown = [f"unknown keyword {n!r}" for n in FLASH_VARLEN_BACKWARD_KWARGS if n not in params]
    omitted = [f"required parameter {n!r} not passed" for n, p in params.items()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in FLASH_VARLEN_BACKWARD_KWARGS]
    return unknown + omitted


class FlashAttnKernel:
    """flash-attn 2 varlen (CUDA). lse_HT is flash-attn's softmax_lse layout [H, total_q], fp32.

    `fai` is the flash_attn.flash_attn_interface module (imported when not given; tests pass a stand-in).
    The installed backward's signature is checked once here, so a flash-attn outside
    FLASH_ATTN_VERSIONS fails when the worker builds its kernel, not in the first backward step.
    """

    def __init__(self, fai: Any = None) -> None:
        if fai is None:
            try:
                from flash_attn import flash_attn_interface as fai
            except ImportError as err:
                raise ImportError(
                    "the 'flash' attention backend needs flash-attn on a CUDA machine: "
                    "pip install 'skrull-on-ray[gpu]' (or use the 'torch' backend on CPU)"
                ) from err
            params = flash_backward_parameters(fai)
            problems = flash_backward_mismatch(params) if params is not None else []
            if problems:
                raise ImportError(f"the installed flash-attn's _flash_attn_varlen_backward does not match "
                                  f"our call ({'; '.join(problems)}): install "
                                  f"flash-attn{FLASH_ATTN_VERSIONS} (pip install 'skrull-on-ray[gpu]')")
        self._fai = fai

    def forward(self, q_THD, k_KGD, v_KGD, cu_q, cu_k, *, causal, scale):
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return _empty_forward(q_THD)
        cq, mq = _cu_tensor(cu_q, q_THD.device)
        ck, mk = _cu_tensor(cu_k, q_THD.device)
        # Public API, same keywords in 2.6-2.8; return_attn_probs adds (softmax_lse, S_dmask) to out.
        out, lse, _ = self._fai.flash_attn_varlen_func(
            q=q_THD, k=k_KGD, v=v_KGD, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk,
            dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True,
        )
        return out, lse.float()

    def backward(self, dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, cu_q, cu_k, *, causal, scale):
        dq, dk, dv = torch.zeros_like(q_THD), torch.zeros_like(k_KGD), torch.zeros_like(v_KGD)
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return dq, dk, dv
        cq, mq = _cu_tensor(cu_q, q_THD.device)
        ck, mk = _cu_tensor(cu_k, q_THD.device)
        # Writes dq, dk, dv in place. Keywords only, exactly FLASH_VARLEN_BACKWARD_KWARGS (module docstring).
        self._fai._flash_attn_varlen_backward(
            dout=dout_THD.contiguous(), q=q_THD, k=k_KGD, v=v_KGD, out=out_THD,
            softmax_lse=lse_HT.contiguous(), dq=dq, dk=dk, dv=dv, cu_seqlens_q=cq, cu_seqlens_k=ck,
            max_seqlen_q=mq, max_seqlen_k=mk, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
        )
        return dq, dk, dv


_KERNELS: dict[str, type] = {"torch": TorchCpuKernel, "torch-flash": TorchFlashKernel,
                              "flash": FlashAttnKernel}


@functools.cache
def _flash_attn_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("flash_attn") is not None


def resolve_backend(name: str, device: torch.device) -> str:
    """A `model.attention_backend` value -> a concrete kernel name for `device`.

    auto: flash (flash-attn installed) or torch-flash on CUDA, torch elsewhere. An explicit kernel that
    cannot run on `device` is refused here, at worker start, rather than at the first attention call.
    """
    if name not in BACKENDS:
        raise ValueError(f"model.attention_backend={name!r} is not one of: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        return "flash" if _flash_attn_installed() else "torch-flash"
    if (name == "torch") != (device.type != "cuda"):
        need = "a non-CUDA device (it is aten's CPU op)" if name == "torch" else "a CUDA device"
        raise ValueError(f"model.attention_backend={name!r} needs {need}, but this worker computes on "
                         f"{device}: use 'auto'")
    return name


def make_kernel(name: str, device: torch.device) -> VarlenKernel:
    """Build the kernel `name` (a BACKENDS value, "auto" resolved for `device`) once."""
    return _KERNELS[resolve_backend(name, device)]()
