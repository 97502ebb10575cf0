"""Varlen attention kernels behind one small interface, chosen by a string.

Legend (shapes in names): T = packed query tokens, K = packed key tokens, H = query heads,
G = key/value heads (H % G == 0: GQA when G < H), D = head dim, B1 = number of segments + 1.

    q_THD  = [ seq0 tokens | seq1 tokens | ... ]      block.cu_q = [0, len_q0, len_q0 + len_q1, ...]
    k_KGD  = [ seq0 keys   | seq1 keys   | ... ]      block.cu_k = [0, len_k0, ...]

Segment i's queries attend only to segment i's keys. A call's segments come as a VarlenBlock
(workers/attention/index.py): int32 cu_seqlens already on the device, max lengths and per-segment spans as
Python ints, all built once per micro-batch, so a kernel call never builds a tensor from host data nor
waits for a host-to-device copy. `block.causal` requires len_q_i == len_k_i (the only causal shape the ring
ever needs: a diagonal block). Each kernel returns the output and the natural-log log-sum-exp of the scaled
scores, lse_HT in fp32, which the ring merges across blocks. `backward` takes the *final* (merged) out and
lse, as flash-attention's backward does, so a block's gradient is exact even though its own softmax was only
a partial one.

Backends:
- "torch" (CPU): one call of aten's flash-attention-for-CPU op per segment (O(len^2) per segment,
  never a dense T x T mask over the packed stream), over the block's host spans. GQA is expanded per segment
  inside the kernel only; what travels over the ring stays G-headed.
- "torch-flash" (CUDA, bf16/fp16): PyTorch's own FlashAttention-2 varlen op (aten._flash_attention_forward
  / _backward), one call for all segments, GQA native; needs nothing beyond a CUDA build of torch.
- "flash" (CUDA): the flash-attn 2 package's varlen forward/backward, imported lazily (`[gpu]` extra,
  flash-attn FLASH_ATTN_VERSIONS). Its backward is flash-attn's private `_flash_attn_varlen_backward`,
  called by keyword only (FLASH_VARLEN_BACKWARD_KWARGS): 2.6 took `window_size` as one tuple, 2.7 split
  it into window_size_left / window_size_right, and 2.7.3 appended `zero_tensors` (defaulted): a
  positional call binds values to the wrong parameters on another version, a keyword call cannot.
- "auto": on CUDA, flash when flash-attn *imports* and its backward takes our keywords, torch-flash
  otherwise (a wheel built against another torch or CUDA is installed but fails to import: a warning says
  so, and the run goes on with torch-flash); torch on CPU.

The CUDA-only rule of torch-flash and flash lives in one function, `cuda_kernels_run_on`: tests replace it
(tests/cuda_standins.py) to run these two kernels' glue on CPU against reference stand-ins of the ops they
call; nothing else in this module changes for them, and the ops are looked up where a real run looks them
up (torch.ops.aten, the flash_attn package).

`make_kernel(name, device)` resolves the name once (a worker builds its kernel when it builds its
process groups, see workers/attention/runtime.py), never per attention call.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Protocol

import torch

from workers.attention.index import VarlenBlock

log = logging.getLogger(__name__)

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


def cuda_kernels_run_on(device: torch.device) -> bool:
    """Whether the CUDA kernels (torch-flash, flash) may be given tensors on `device`: CUDA devices only.

    The one place that rule lives (resolve_backend and TorchFlashKernel ask it); tests/cuda_standins.py
    extends it to the CPU while CPU stand-ins of the kernels' ops are installed.
    """
    return device.type == "cuda"


class VarlenKernel(Protocol):
    def forward(
        self, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor, block: VarlenBlock, *,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self, dout_THD: torch.Tensor, q_THD: torch.Tensor, k_KGD: torch.Tensor, v_KGD: torch.Tensor,
        out_THD: torch.Tensor, lse_HT: torch.Tensor, block: VarlenBlock, *, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _to_bhsd(x_SHD: torch.Tensor, heads: int) -> torch.Tensor:
    """[S, G, D] -> [1, H, S, D], repeating each KV head H/G times (GQA) for the aten op."""
    rep = heads // x_SHD.shape[1]
    x = x_SHD.transpose(0, 1)
    if rep > 1:
        x = x.repeat_interleave(rep, dim=0)
    return x.unsqueeze(0)


class TorchCpuKernel:
    """aten._scaled_dot_product_flash_attention_for_cpu per segment (returns lse; ~5e-7 fp32 error)."""

    def forward(self, q_THD, k_KGD, v_KGD, block, *, scale):
        num_t, heads, _ = q_THD.shape
        # Contiguous whatever q's strides (as the CUDA kernels' outputs are): o_proj's input is then a view.
        out_THD = torch.zeros(q_THD.shape, dtype=q_THD.dtype, device=q_THD.device)
        # Rows that see no key keep lse = -inf so a log-sum-exp merge ignores them (the aten op
        # would report 0 there: the lse = 0 trap, docs/design.md section 9).
        lse_HT = torch.full((heads, num_t), float("-inf"), dtype=torch.float32, device=q_THD.device)
        for q0, q1, k0, k1 in block.spans:
            q = q_THD[q0:q1].transpose(0, 1).unsqueeze(0)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, _to_bhsd(k_KGD[k0:k1], heads), _to_bhsd(v_KGD[k0:k1], heads),
                0.0, block.causal, scale=scale,
            )[:2]
            out_THD[q0:q1] = out[0].transpose(0, 1)
            lse_HT[:, q0:q1] = lse[0]
        return out_THD, lse_HT

    def backward(self, dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, block, *, scale):
        heads, groups = q_THD.shape[1], k_KGD.shape[1]
        dq_THD = torch.zeros_like(q_THD)
        dk_KGD = torch.zeros_like(k_KGD)
        dv_KGD = torch.zeros_like(v_KGD)
        for q0, q1, k0, k1 in block.spans:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout_THD[q0:q1].transpose(0, 1).unsqueeze(0).contiguous(),
                q_THD[q0:q1].transpose(0, 1).unsqueeze(0),
                _to_bhsd(k_KGD[k0:k1], heads), _to_bhsd(v_KGD[k0:k1], heads),
                out_THD[q0:q1].transpose(0, 1).unsqueeze(0).contiguous(),
                lse_HT[:, q0:q1].unsqueeze(0).contiguous(),
                0.0, block.causal, scale=scale,
            )
            dq_THD[q0:q1] = dq[0].transpose(0, 1)
            # Fold the repeated heads back onto their KV head: [H, S, D] -> [G, H/G, S, D] -> sum.
            n = k1 - k0
            dk_KGD[k0:k1] = dk[0].view(groups, heads // groups, n, -1).sum(1).transpose(0, 1)
            dv_KGD[k0:k1] = dv[0].view(groups, heads // groups, n, -1).sum(1).transpose(0, 1)
        return dq_THD, dk_KGD, dv_KGD


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
        if not cuda_kernels_run_on(q_THD.device) or q_THD.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the 'torch-flash' attention backend needs bf16/fp16 CUDA tensors, got {q_THD.dtype} on "
                f"{q_THD.device}: set model.dtype=bf16 (or use the 'torch' backend on CPU)"
            )

    def forward(self, q_THD, k_KGD, v_KGD, block, *, scale):
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return _empty_forward(q_THD)
        self._check(q_THD)
        out, lse = torch.ops.aten._flash_attention_forward(
            q_THD, k_KGD, v_KGD, block.cu_q, block.cu_k, block.max_q, block.max_k, 0.0, block.causal, False,
            scale=scale,
        )[:2]
        if lse.shape != (q_THD.shape[1], q_THD.shape[0]):
            # The ring's merge relies on the unpadded [H, total_q] layout; older builds padded it.
            raise RuntimeError(f"aten._flash_attention_forward returned lse of shape {tuple(lse.shape)}, "
                               f"expected [H, total_q]: use the 'flash' backend (pip install '.[gpu]')")
        return out, lse.float()

    def backward(self, dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, block, *, scale):
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return torch.zeros_like(q_THD), torch.zeros_like(k_KGD), torch.zeros_like(v_KGD)
        self._check(q_THD)
        unused = torch.empty(0, dtype=torch.int64, device=q_THD.device)
        rng_state = torch.zeros(2, dtype=torch.int64, device=q_THD.device)
        return torch.ops.aten._flash_attention_backward(
            dout_THD.contiguous(), q_THD, k_KGD, v_KGD, out_THD.contiguous(), lse_HT.contiguous(),
            block.cu_q, block.cu_k, block.max_q, block.max_k, 0.0, block.causal, rng_state, unused,
            scale=scale,
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


def flash_attn_interface() -> Any:
    """flash_attn.flash_attn_interface, if it imports and its backward takes our keywords; else ImportError.

    Any exception of the import means the package is unusable here: a wheel built against another torch
    fails with an undefined symbol (ImportError), one built for another CUDA with a missing library, and a
    package's own version checks may raise anything else.
    """
    try:
        from flash_attn import flash_attn_interface as fai
    except Exception as err:  # whatever breaks the import, flash-attn cannot be used here
        missing = isinstance(err, ModuleNotFoundError) and err.name == "flash_attn"
        reason = "is not installed" if missing else f"does not import ({type(err).__name__}: {err})"
        raise ImportError(
            f"flash-attn {reason}: the 'flash' attention backend needs it on a CUDA machine "
            f"(pip install --no-build-isolation -e '.[gpu]' in the checkout), or use 'auto' / 'torch-flash'"
        ) from err
    params = flash_backward_parameters(fai)
    problems = flash_backward_mismatch(params) if params is not None else []
    if problems:
        raise ImportError(f"the installed flash-attn's _flash_attn_varlen_backward does not match "
                          f"our call ({'; '.join(problems)}): install "
                          f"flash-attn{FLASH_ATTN_VERSIONS} (pip install --no-build-isolation -e '.[gpu]' in "
                          "the checkout)")
    return fai


class FlashAttnKernel:
    """flash-attn 2 varlen (CUDA). lse_HT is flash-attn's softmax_lse layout [H, total_q], fp32.

    `fai` is the flash_attn.flash_attn_interface module (imported and checked by flash_attn_interface()
    when not given), so a flash-attn outside FLASH_ATTN_VERSIONS fails when the worker builds its kernel,
    not in the first backward step.
    """

    def __init__(self, fai: Any = None) -> None:
        self._fai = flash_attn_interface() if fai is None else fai

    def forward(self, q_THD, k_KGD, v_KGD, block, *, scale):
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return _empty_forward(q_THD)
        # Public API, same keywords in 2.6-2.8; return_attn_probs adds (softmax_lse, S_dmask) to out.
        out, lse, _ = self._fai.flash_attn_varlen_func(
            q=q_THD, k=k_KGD, v=v_KGD, cu_seqlens_q=block.cu_q, cu_seqlens_k=block.cu_k,
            max_seqlen_q=block.max_q, max_seqlen_k=block.max_k, dropout_p=0.0, softmax_scale=scale,
            causal=block.causal, return_attn_probs=True,
        )
        return out, lse.float()

    def backward(self, dout_THD, q_THD, k_KGD, v_KGD, out_THD, lse_HT, block, *, scale):
        dq, dk, dv = torch.zeros_like(q_THD), torch.zeros_like(k_KGD), torch.zeros_like(v_KGD)
        if q_THD.shape[0] == 0 or k_KGD.shape[0] == 0:
            return dq, dk, dv
        # Writes dq, dk, dv in place. Keywords only, exactly FLASH_VARLEN_BACKWARD_KWARGS (module docstring).
        self._fai._flash_attn_varlen_backward(
            dout=dout_THD.contiguous(), q=q_THD, k=k_KGD, v=v_KGD, out=out_THD,
            softmax_lse=lse_HT.contiguous(), dq=dq, dk=dk, dv=dv, cu_seqlens_q=block.cu_q,
            cu_seqlens_k=block.cu_k, max_seqlen_q=block.max_q, max_seqlen_k=block.max_k, dropout_p=0.0,
            softmax_scale=scale, causal=block.causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False,
        )
        return dq, dk, dv


_KERNELS: dict[str, type] = {"torch": TorchCpuKernel, "torch-flash": TorchFlashKernel,
                              "flash": FlashAttnKernel}


def _auto_cuda_backend() -> str:
    """flash when flash-attn imports and matches our call, else torch-flash (with a warning when it is
    installed but unusable: the user asked for nothing, but should know their flash-attn is broken)."""
    try:
        flash_attn_interface()
    except ImportError as err:
        if not (isinstance(err.__cause__, ModuleNotFoundError) and err.__cause__.name == "flash_attn"):
            log.warning("attention_backend=auto uses 'torch-flash': %s", err)
        return "torch-flash"
    return "flash"


def resolve_backend(name: str, device: torch.device) -> str:
    """A `model.attention_backend` value -> a concrete kernel name for `device`.

    auto: flash (flash-attn imports) or torch-flash on CUDA, torch elsewhere. An explicit kernel that
    cannot run on `device` is refused here, at worker start, rather than at the first attention call.
    """
    if name not in BACKENDS:
        raise ValueError(f"model.attention_backend={name!r} is not one of: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "auto":
        return _auto_cuda_backend() if device.type == "cuda" else "torch"
    if name == "torch" and device.type == "cuda":
        raise ValueError(f"model.attention_backend='torch' needs a non-CUDA device (it is aten's CPU op), "
                         f"but this worker computes on {device}: use 'auto'")
    if name != "torch" and not cuda_kernels_run_on(device):
        raise ValueError(f"model.attention_backend={name!r} needs a CUDA device, but this worker computes "
                         f"on {device}: use 'auto'")
    return name


def make_kernel(name: str, device: torch.device) -> VarlenKernel:
    """Build the kernel `name` (a BACKENDS value, "auto" resolved for `device`) once."""
    return _KERNELS[resolve_backend(name, device)]()
