"""CPU stand-ins for the CUDA kernel APIs the attention calls, so their glue runs (and is tested) on CPU.

What the code calls (workers/attention/kernels.py), and what stands in for it here:

    torch-flash: torch.ops.aten._flash_attention_forward / _flash_attention_backward
        -> registered as those ops' CPU kernels (torch.library, dispatch key CPU): the real op, its real
           schema (argument binding, defaults, return arity) and its real autograd entry; only the kernel
           behind the CPU key is ours. The ops have no CPU kernel of their own.
    flash:       flash_attn.flash_attn_interface.flash_attn_varlen_func / _flash_attn_varlen_backward
        -> a fake `flash_attn` package in sys.modules whose two private ops are torch.library.custom_op
           functions (as flash-attn >= 2.7 defines them), with the same parameter names, defaults and
           mutated arguments, behind a wrapper that pads and slices the head dim as FlashAttnVarlenFunc does.

Each computes reference math, per segment in fp32: scores = scale * q k^T with GQA as repeat_interleave
(query head h reads KV head h // (H/G)), the causal mask aligned to the bottom-right corner, lse = logsumexp
of the scores, out = softmax @ v rounded to the input dtype. Backward uses the out and lse it is given (not
recomputed ones), as FlashAttention-2 does: P = exp(scores - lse), D = rowsum(dout * out), dS = P (dP - D),
dq = scale dS k, dk = scale dS^T q (summed over each KV head's query heads), dv = P^T dout. A row that sees
no key gets out 0 and lse +inf. Rows outside every segment are left unwritten by the real kernels: the
stand-ins fill them with NaN (returned tensors) or leave them untouched (the in-place dq/dk/dv), so glue that
read them would fail here too.

Checks mirrored from the real kernels (each raises RuntimeError with the real message): fp16/bf16 inputs of
one dtype; int32, contiguous cu_seqlens of B + 1 entries on the inputs' device; last dim contiguous; head
dim a multiple of 8 and <= 256; H % G == 0; max_seqlen a Python int at least the longest segment (the real
grid is sized by it: rows past it would never be computed); for max_seqlen_q == 1 with GQA, one query per
segment (the real kernel then swaps heads into the sequence dim and ignores cu_seqlens_q); options the
stand-ins do not model (dropout, windows, alibi, softcap, paged KV) refused.

Sources mirrored:
- torch 2.13 (installed): `torch.ops.aten._flash_attention_forward.default._schema` and `..._backward`;
  torch/_meta_registrations.py:6631-6708 (meta__flash_attention_forward: out empty_like(query), varlen
  logsumexp [num_heads, total_q] fp32, rng_state uint64 [2], offset uint64 [], debug mask empty(0) in
  query's dtype) and 6796-6824 (meta__flash_attention_backward: grads empty_like q, k, v);
  torch/nn/attention/varlen.py:110-126 and 554-573 (torch's own varlen calls of both ops: positional
  cu_seq/max, dropout 0.0, scale= keyword, rng_state and an empty `unused` passed back to backward).
- PyTorch's vendored FA2, aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (mha_varlen_fwd,
  mha_varlen_bwd; read at pytorch commit 03b7c19): the same checks as flash-attn's below, plus
  "head_size must be a multiple of 8, this is ensured by padding!" (the aten op does not pad).
- flash-attn v2.8.3 (github Dao-AILab/flash-attention; the 2.7.x signatures differ only by the later-added,
  defaulted `zero_tensors`): flash_attn/flash_attn_interface.py:142-190 (_flash_attn_varlen_forward,
  custom_op, returns out, softmax_lse, S_dmask, rng_state), 221/227 (fake: softmax_lse [H, total_q] fp32,
  rng_state int64 [2]), 329-390 (_flash_attn_varlen_backward, custom_op mutating dq, dk, dv, returns
  softmax_d), 429 (softmax_d [H, total_q + 128 B] fp32), 893-990 (FlashAttnVarlenFunc: pads the head dim to
  a multiple of 8, passes return_softmax only with dropout, returns (out, softmax_lse, S_dmask) when asked,
  slices dq/dk/dv back), 1370-1460 (flash_attn_varlen_func, its keywords and defaults; GQA head mapping and
  bottom-right causal alignment in its docstring); csrc/flash_attn/flash_api.cpp:20-22 (CHECK_DEVICE /
  SHAPE / CONTIGUOUS), 544-606 (mha_varlen_fwd checks, max_seqlen_q == 1 drops causal, ngroups swap),
  652 and 741-744 (lse [H, total_q]; max_seqlen_k == 0 -> out 0, lse +inf), 1016-1047 and 1100 (mha_varlen_bwd
  checks, softmax_d), 1193-1196 (GQA dk/dv summed over the group); csrc/flash_attn/src/softmax.h:180 and
  flash_fwd_kernel.h:94-125 (a row without keys: lse +inf); flash_bwd_preprocess_kernel.h:25-58
  (dot_do_o: D = rowsum(dout * out) from the given out).

The device seam: both CUDA kernels are CUDA-only in the product, and the one function that says so,
workers.attention.kernels.cuda_kernels_run_on, is widened to accept CPU tensors while the stand-ins are
installed. The real kernels' own device checks (CHECK_DEVICE: "must be on CUDA") become "on the inputs'
device" here, which is the part of them the glue can get wrong.
"""

import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from workers.attention import kernels

FLASH_VERSION = "2.8.3"


def _fail(message: str) -> None:
    raise RuntimeError(message)


def _bounds(cu: torch.Tensor, name: str, device: torch.device, batch: int) -> list[int]:
    """CHECK_DEVICE / dtype / CHECK_CONTIGUOUS / CHECK_SHAPE of a cu_seqlens, then its values (a test may
    read the device; the real kernel reads them on the device)."""
    if cu.dtype != torch.int32:
        _fail(f"{name} must have dtype int32")
    if cu.device != device:
        _fail(f"{name} must be on the inputs' device ({device}), got {cu.device}")
    if not cu.is_contiguous():
        _fail(f"{name} must be contiguous")
    if tuple(cu.shape) != (batch + 1,):
        _fail(f"{name} must have shape (batch_size + 1)")
    return [int(x) for x in cu.tolist()]


def _check_inputs(q, k, v, *extra) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        _fail("FlashAttention only support fp16 and bf16 data type")
    for x in (k, v, *extra):
        if x.dtype != q.dtype:
            _fail("query, key, value, out and dout must have the same dtype")
        if x.device != q.device:
            _fail(f"every input must be on the query's device ({q.device})")
    for x in (q, k, v, *extra):
        if x.stride(-1) != 1:
            _fail("Input tensor must have contiguous last dimension")
    heads, head_dim = q.shape[1], q.shape[2]
    if head_dim % 8 or head_dim > 256:
        _fail("head_size must be a multiple of 8 and at most 256 (flash_attn_varlen_func pads; the aten op "
              "does not)")
    if heads % k.shape[1]:
        _fail("Number of heads in key/value must divide number of heads in query")
    if k.shape != v.shape or k.shape[2] != head_dim:
        _fail("key and value must have shape (total_k, num_heads_k, head_size)")


def _segments(q, k, cu_q, cu_k, max_q, max_k) -> list[tuple[int, int, int, int]]:
    """Validated segments (q0, q1, k0, k1), the real kernels' preconditions checked."""
    if cu_q.numel() < 2:
        _fail("batch size must be positive")
    batch = cu_q.numel() - 1
    bq, bk = _bounds(cu_q, "cu_seqlens_q", q.device, batch), _bounds(cu_k, "cu_seqlens_k", q.device, batch)
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if type(value) is not int:
            _fail(f"{name} must be a Python int, got {type(value).__name__}")
    spans = list(zip(bq[:-1], bq[1:], bk[:-1], bk[1:], strict=True))
    if bq[-1] > q.shape[0] or bk[-1] > k.shape[0] or any(q1 < q0 or k1 < k0 for q0, q1, k0, k1 in spans):
        _fail("cu_seqlens out of range or decreasing")
    if max((q1 - q0 for q0, q1, _, _ in spans), default=0) > max_q:
        _fail("a query segment is longer than max_seqlen_q: the real kernel's grid would skip its tail rows")
    if max((k1 - k0 for _, _, k0, k1 in spans), default=0) > max_k:
        _fail("a key segment is longer than max_seqlen_k")
    if max_q == 1 and q.shape[1] > k.shape[1] and q.shape[0] != batch:
        _fail("max_seqlen_q == 1 with GQA takes the kernel's ngroups-swap path, which assumes exactly one "
              "query per segment (it ignores cu_seqlens_q)")
    return spans


def _refuse_unmodelled(dropout_p, window=(-1, -1), softcap=0.0, **optional) -> None:
    unset = all(value is None for value in optional.values())
    if dropout_p != 0.0 or tuple(window) != (-1, -1) or softcap != 0.0 or not unset:
        _fail(f"stand-in: dropout/window/softcap/alibi/paged options are not modelled ({optional})")


def _scores(q, k, causal, scale):
    """fp32 [H, Sq, Sk] scaled scores, GQA by repeat_interleave, causal aligned bottom-right."""
    rep = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = scale * qf @ kf.transpose(1, 2)
    if causal:
        sq, sk = q.shape[0], k.shape[0]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _probs(s, lse):
    """exp(s - lse) with the kernel's conventions: a row with lse +inf (no key) has all-zero probabilities."""
    return torch.exp(s - lse[..., None]).nan_to_num(0.0)


def reference_forward(q, k, v, spans, causal, scale, out, lse) -> None:
    """Writes each segment's out (q's dtype) and lse (fp32) in place; rows outside segments untouched."""
    for q0, q1, k0, k1 in spans:
        if q1 == q0:
            continue
        if k1 == k0:
            out[q0:q1] = 0
            lse[:, q0:q1] = float("inf")
            continue
        s = _scores(q[q0:q1], k[k0:k1], causal, scale)
        seg_lse = torch.logsumexp(s, dim=-1)
        seg_lse = torch.where(torch.isneginf(seg_lse), torch.full_like(seg_lse, float("inf")), seg_lse)
        rep = q.shape[1] // k.shape[1]
        vf = v[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        out[q0:q1] = (_probs(s, seg_lse) @ vf).transpose(0, 1).to(out.dtype)
        lse[:, q0:q1] = seg_lse


def reference_backward(dout, q, k, v, out, lse, spans, causal, scale, dq, dk, dv) -> None:
    """FlashAttention-2's backward from the given out and lse; writes dq, dk, dv (their dtype) in place."""
    heads, groups = q.shape[1], k.shape[1]
    rep = heads // groups
    for q0, q1, k0, k1 in spans:
        if k1 == k0:
            continue
        n = k1 - k0
        if q1 == q0:
            dk[k0:k1] = 0
            dv[k0:k1] = 0
            continue
        p = _probs(_scores(q[q0:q1], k[k0:k1], causal, scale), lse[:, q0:q1].float())
        do = dout[q0:q1].float().transpose(0, 1)
        kf = k[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        vf = v[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        d_sum = (do * out[q0:q1].float().transpose(0, 1)).sum(-1, keepdim=True)
        ds = p * (do @ vf.transpose(1, 2) - d_sum)
        dq[q0:q1] = (scale * ds @ kf).transpose(0, 1).to(dq.dtype)
        dk_h = scale * ds.transpose(1, 2) @ q[q0:q1].float().transpose(0, 1)
        dv_h = p.transpose(1, 2) @ do
        dk[k0:k1] = dk_h.view(groups, rep, n, -1).sum(1).transpose(0, 1).to(dk.dtype)
        dv[k0:k1] = dv_h.view(groups, rep, n, -1).sum(1).transpose(0, 1).to(dv.dtype)


def _nan_like(x: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """What the real kernels allocate with empty(): unwritten rows stay NaN here, so reading them shows."""
    return torch.full(x.shape if shape is None else shape, float("nan"), dtype=dtype or x.dtype,
                      device=x.device)


# ---- torch: aten._flash_attention_forward / _backward, as CPU kernels of the real ops -------------------

def aten_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None,
                                 window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                                 num_splits=None):
    """aten::_flash_attention_forward (varlen) -> (output, softmax_logsumexp, rng_state, unused, debug)."""
    _refuse_unmodelled(dropout_p, seqused_k=seqused_k, alibi_slopes=alibi_slopes, block_table=block_table,
                       window_size_left=window_size_left, window_size_right=window_size_right)
    if return_debug_mask or cum_seq_q is None or cum_seq_k is None:
        _fail("stand-in: only the varlen path without a debug mask is modelled")
    _check_inputs(query, key, value)
    spans = _segments(query, key, cum_seq_q, cum_seq_k, max_q, max_k)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = _nan_like(query)
    lse = _nan_like(query, (query.shape[1], query.shape[0]), torch.float32)
    reference_forward(query, key, value, spans, is_causal, scale, out, lse)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    return out, lse, rng_state, unused, torch.empty(0, dtype=query.dtype, device=query.device)


def aten_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                  max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None,
                                  window_size_left=None, window_size_right=None):
    """aten::_flash_attention_backward (varlen) -> (grad_query, grad_key, grad_value), new tensors."""
    _refuse_unmodelled(dropout_p, window_size_left=window_size_left, window_size_right=window_size_right)
    _check_inputs(query, key, value, out, grad_out)
    if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (query.shape[1], query.shape[0]):
        _fail("logsumexp must be fp32 [num_heads, total_q]")
    spans = _segments(query, key, cum_seq_q, cum_seq_k, max_q, max_k)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = _nan_like(query), _nan_like(key), _nan_like(value)
    reference_backward(grad_out, query, key, value, out, logsumexp, spans, is_causal, scale, dq, dk, dv)
    return dq, dk, dv


# ---- flash-attn: the package's varlen API -------------------------------------------------------------

@torch.library.custom_op("skrull_standin::flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _flash_attn_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
    block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None, zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse_unmodelled(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes=alibi_slopes,
                       block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k)
    _check_inputs(q, k, v)
    spans = _segments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = torch.zeros_like(q) if zero_tensors else _nan_like(q)
    lse = _nan_like(q, (q.shape[1], q.shape[0]), torch.float32)
    if zero_tensors:
        lse.fill_(float("-inf"))
    reference_forward(q, k, v, spans, causal, softmax_scale, out, lse)
    s_dmask = torch.empty(0, dtype=q.dtype, device=q.device)  # return_softmax needs dropout > 0
    return out, lse, s_dmask, torch.zeros(2, dtype=torch.int64, device=q.device)


@torch.library.custom_op("skrull_standin::flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
    dv: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int, window_size_right: int, softcap: float,
    alibi_slopes: torch.Tensor | None, deterministic: bool,
    rng_state: torch.Tensor | None = None, zero_tensors: bool = False,
) -> torch.Tensor:
    _refuse_unmodelled(dropout_p, (window_size_left, window_size_right), softcap, alibi_slopes=alibi_slopes)
    _check_inputs(q, k, v, out, dout)
    if dq is None or dk is None or dv is None:
        _fail("stand-in: the code always passes dq, dk, dv buffers; allocating them is not modelled")
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        bad = grad.dtype != q.dtype or grad.shape != like.shape or grad.device != q.device
        if bad or grad.stride(-1) != 1:
            _fail(f"{name} must have q's dtype, the shape of its input and a contiguous last dimension")
    spans = _segments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for grad in (dq, dk, dv) if zero_tensors else ():
        grad.zero_()
    reference_backward(dout, q, k, v, out, softmax_lse, spans, causal, softmax_scale, dq, dk, dv)
    batch = cu_seqlens_q.numel() - 1
    return torch.zeros((q.shape[1], q.shape[0] + 128 * batch), dtype=torch.float32, device=q.device)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] % 8 == 0 else torch.nn.functional.pad(x, [0, 8 - x.shape[-1] % 8])


class _FlashAttnVarlenFunc(torch.autograd.Function):
    """What flash_attn_varlen_func wraps: pad the head dim to x8, call the op, slice back."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, return_softmax):
        head_dim = q.shape[-1]
        qp, kp, vp = _pad8(q), _pad8(k), _pad8(v)
        out, lse, s_dmask, rng_state = _flash_attn_varlen_forward(
            qp, kp, vp, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal=causal,
            return_softmax=return_softmax and dropout_p > 0)
        ctx.save_for_backward(qp, kp, vp, out, lse, cu_q, cu_k, rng_state)
        ctx.setup = (max_q, max_k, dropout_p, scale, causal, head_dim)
        out = out[..., :head_dim]
        return (out, lse, s_dmask) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *_):
        qp, kp, vp, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
        max_q, max_k, dropout_p, scale, causal, head_dim = ctx.setup
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        _flash_attn_varlen_backward(_pad8(dout.contiguous()), qp, kp, vp, out, lse, dq, dk, dv, cu_q, cu_k,
                                    max_q, max_k, dropout_p, scale, causal, -1, -1, 0.0, None, False,
                                    rng_state=rng_state)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], *(None,) * 8)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn.flash_attn_varlen_func: out, or (out, softmax_lse, S_dmask) with return_attn_probs."""
    _refuse_unmodelled(dropout_p, window_size, softcap, alibi_slopes=alibi_slopes, block_table=block_table)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p, scale, causal, return_attn_probs)


def _module(name: str, is_package: bool) -> types.ModuleType:
    """A module with a spec, as an imported one has (importlib.util.find_spec reads it)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    if is_package:
        module.__path__ = []  # so `from flash_attn import flash_attn_interface` resolves
    return module


def _flash_modules() -> dict[str, types.ModuleType]:
    interface = _module("flash_attn.flash_attn_interface", is_package=False)
    interface.flash_attn_varlen_func = flash_attn_varlen_func
    interface._flash_attn_varlen_forward = _flash_attn_varlen_forward
    interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    package = _module("flash_attn", is_package=True)
    package.__version__ = FLASH_VERSION
    package.flash_attn_interface = interface
    package.flash_attn_varlen_func = flash_attn_varlen_func
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


def _cpu_or_cuda(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


@contextmanager
def cuda_standins() -> Iterator[None]:
    """Install the stand-ins (aten CPU kernels, a fake flash_attn, CPU allowed for the CUDA kernels); undo
    everything on exit. Usable in a test (fixture) and in a spawned worker process alike."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", aten_flash_attention_forward, "CPU")
    lib.impl("_flash_attention_backward", aten_flash_attention_backward, "CPU")
    saved = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn.flash_attn_interface")}
    sys.modules.update(_flash_modules())
    device_rule = kernels.cuda_kernels_run_on
    kernels.cuda_kernels_run_on = _cpu_or_cuda
    try:
        yield
    finally:
        kernels.cuda_kernels_run_on = device_rule
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        lib._destroy()
