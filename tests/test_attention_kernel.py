"""Single-process checks of the varlen kernel interface and DACP attention without a CP group.

Reference: PyTorch SDPA per sequence (causal, GQA). fp32 tolerance 1e-5 abs + rel: the aten CPU flash
op is ~5e-7 from SDPA; bf16 2.5e-2 vs an fp32 reference on the same bf16-rounded inputs.

The flash-attn backward is a private function whose signature changed between releases, so its call is
checked twice: on any machine, against a stand-in that records the keywords it receives; where
flash-attn is installed, those keywords against the installed function's signature.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from mp_utils import excess, sdpa_reference

from workers.attention import BACKENDS, AttentionRuntime, DacpLayout, VarlenBlock, dacp_attention, make_kernel
from workers.attention.kernels import (
    FLASH_ATTN_VERSIONS,
    FLASH_VARLEN_BACKWARD_KWARGS,
    FlashAttnKernel,
    TorchCpuKernel,
    TorchFlashKernel,
    flash_backward_mismatch,
    flash_backward_parameters,
)
from workers.attention.runtime import default_runtime

SCALE = 0.25


def _seqs(lengths, heads, groups, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, h, 8, generator=gen).to(dtype) for h in (heads, groups, groups, heads)]
            for n in lengths]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2.5e-2)])
@pytest.mark.parametrize("heads,groups", [(4, 1), (4, 2), (2, 2)])
def test_local_varlen_matches_sdpa(dtype, tol, heads, groups) -> None:
    lengths = [1, 2, 13, 40, 3]
    seqs = _seqs(lengths, heads, groups, dtype)
    q, k, v, dout = (torch.cat([s[i] for s in seqs]) for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = dacp_attention(q, k, v, DacpLayout(cp_size=1, local_lens=tuple(lengths)), None, scale=SCALE)
    out.backward(dout)
    ref = _packed_sdpa_reference(seqs)
    ours = {"out": out, "lse": lse.T, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, value in ours.items():
        assert excess(value.detach(), ref[name], tol, tol) <= 0, f"{name} out of tolerance {tol}"


def test_distributed_part_without_cp_group_is_plain_causal_attention() -> None:
    """cp_size=1: a 'distributed' sequence is padded to 2 chunks and runs the ring's diagonal block only."""
    lengths = [5, 8]  # seq 0 local, seq 1 distributed (c = 4, no pad), seq 2 distributed with 1 pad
    seqs = _seqs(lengths + [3], 4, 2, torch.float32, seed=1)
    pad = [torch.zeros(1, *t.shape[1:]) for t in seqs[2]]
    parts = [seqs[0], seqs[1], [torch.cat([a, b]) for a, b in zip(seqs[2], pad, strict=True)]]
    q, k, v, dout = (torch.cat([p[i] for p in parts]).clone() for i in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    layout = DacpLayout(cp_size=1, local_lens=(5,), dist_chunk_lens=(4, 2))
    out, lse = dacp_attention(q, k, v, layout, None, scale=SCALE)
    out.backward(dout)
    refs = [sdpa_reference(*s, SCALE) for s in seqs]
    real = slice(0, 16)  # the pad is the stream's last row
    ref_out = torch.cat([r["out"] for r in refs])
    ref_dk = torch.cat([r["dk"] for r in refs])
    assert excess(out.detach()[real], ref_out, 1e-5, 1e-5) <= 0
    assert excess(k.grad[real], ref_dk, 1e-5, 1e-5) <= 0


def test_empty_stream_and_bad_inputs() -> None:
    q = torch.zeros(0, 2, 8, requires_grad=True)
    out, lse = dacp_attention(q, q, q, DacpLayout(cp_size=1), None)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    with pytest.raises(ValueError, match="layout describes"):
        dacp_attention(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.zeros(3, 2, 8),
                       DacpLayout(cp_size=1, local_lens=(2,)), None)
    with pytest.raises(ValueError, match="cp_size=2"):
        dacp_attention(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8),
                       DacpLayout(cp_size=2, local_lens=(2,)), None)
    with pytest.raises(TypeError, match="AttentionRuntime"):  # the old signature's process group
        dacp_attention(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8),
                       DacpLayout(cp_size=1, local_lens=(2,)), object())


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")


def test_runtime_resolves_the_backend_once() -> None:
    assert BACKENDS == ("auto", "torch", "torch-flash", "flash")
    runtime = AttentionRuntime.create(None, CPU)
    assert isinstance(runtime.kernel, TorchCpuKernel) and runtime.comm is None and runtime.cp_size == 1
    assert isinstance(AttentionRuntime.create(None, CPU, "torch").kernel, TorchCpuKernel)
    assert runtime.single_rank() is runtime
    # The default runtime of a device is built once and reused by every call that passes none.
    assert default_runtime(CPU) is default_runtime(torch.device("cpu"))
    with pytest.raises(ValueError, match="model.attention_backend='triton'"):
        AttentionRuntime.create(None, CPU, "triton")
    for cuda_only in ("torch-flash", "flash"):
        with pytest.raises(ValueError, match=f"model.attention_backend='{cuda_only}' needs a CUDA device"):
            make_kernel(cuda_only, CPU)
    with pytest.raises(ValueError, match="model.dtype=bf16"):
        block = VarlenBlock.build([0, 2], [0, 2], causal=True)
        TorchFlashKernel().forward(*(torch.zeros(2, 2, 8),) * 3, block, scale=SCALE)


def test_hf_call_without_layout_attends_each_row_on_this_rank_alone() -> None:
    """A model call without dacp_layout (rows = whole sequences) keeps the runtime's kernel, not its ring."""
    from workers.attention.hf import dacp_attention_forward

    class Ring:  # a CP group's communicator: must not be used for whole rows
        size = 2

    runtime = AttentionRuntime(kernel=TorchCpuKernel(), comm=Ring())
    assert runtime.cp_size == 2 and runtime.single_rank().comm is None
    assert runtime.single_rank().kernel is runtime.kernel
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 7, 8, generator=gen) for h in (4, 2, 2))  # [B, H|G, S, D]
    out, _ = dacp_attention_forward(torch.nn.Module(), q, k, v, None, scaling=SCALE, dacp_runtime=runtime)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE,
                                                           enable_gqa=True)
    assert excess(out, ref.transpose(1, 2), 1e-5, 1e-5) <= 0


class _RecordingFlashInterface:
    """Stands in for flash_attn.flash_attn_interface: records the backward call, accepts keywords only."""

    def __init__(self) -> None:
        self.backward_calls: list[dict] = []

    def _flash_attn_varlen_backward(self, **kwargs) -> torch.Tensor:
        self.backward_calls.append(kwargs)
        kwargs["dq"].fill_(1.0)  # flash-attn writes the gradients into the buffers it is given
        return torch.empty(0)


def test_flash_backward_is_called_with_exactly_the_declared_keywords() -> None:
    """CPU, no flash-attn: FlashAttnKernel.backward passes FLASH_VARLEN_BACKWARD_KWARGS, by keyword only."""
    fake = _RecordingFlashInterface()
    kernel = FlashAttnKernel(fai=fake)
    q, dout, out = (torch.zeros(5, 4, 8) for _ in range(3))
    k, v = torch.zeros(5, 2, 8), torch.zeros(5, 2, 8)
    lse = torch.zeros(4, 5)
    block = VarlenBlock.build([0, 2, 5], [0, 2, 5], causal=True)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, block, scale=0.5)
    (call,) = fake.backward_calls
    assert sorted(call) == sorted(FLASH_VARLEN_BACKWARD_KWARGS)
    assert len(set(FLASH_VARLEN_BACKWARD_KWARGS)) == len(FLASH_VARLEN_BACKWARD_KWARGS)
    assert call["dq"] is dq and call["dk"] is dk and call["dv"] is dv and bool((dq == 1).all())
    assert call["causal"] is True and call["softmax_scale"] == 0.5 and call["dropout_p"] == 0.0
    assert (call["window_size_left"], call["window_size_right"], call["softcap"]) == (-1, -1, 0.0)
    assert call["cu_seqlens_q"] is block.cu_q and call["cu_seqlens_k"] is block.cu_k  # prepared, not rebuilt
    assert call["cu_seqlens_q"].dtype == torch.int32 and call["cu_seqlens_q"].tolist() == [0, 2, 5]
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (3, 3)


def test_flash_signature_check_against_both_generations() -> None:
    """The check FlashAttnKernel runs at build time: a 2.6-style signature (window_size tuple) is refused,
    a 2.7/2.8-style one (window_size_left/right, optional rng_state and zero_tensors) accepted."""

    def v26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, rng_state=None): ...

    def v28(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
            alibi_slopes, deterministic, rng_state=None, zero_tensors=False): ...

    class Fai:
        def __init__(self, fn) -> None:
            self._flash_attn_varlen_backward = fn

    assert flash_backward_mismatch(flash_backward_parameters(Fai(v28))) == []
    problems = flash_backward_mismatch(flash_backward_parameters(Fai(v26)))
    assert "unknown keyword 'window_size_left'" in problems
    assert "required parameter 'window_size' not passed" in problems
    assert flash_backward_parameters(Fai(lambda *args, **kwargs: None)) is None  # unreadable: no verdict


def test_gpu_extra_pins_the_flash_attn_range_the_call_matches() -> None:
    # A regex, not tomllib: the project supports Python 3.10, whose stdlib has no TOML reader.
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    (extra,) = re.findall(r"^gpu = \[(.*)\]", pyproject, re.MULTILINE)
    assert f"flash-attn{FLASH_ATTN_VERSIONS}" in re.findall(r'"([^"]+)"', extra)


def test_flash_backward_keywords_match_the_installed_flash_attn() -> None:
    """Where flash-attn imports: every keyword we pass exists in its _flash_attn_varlen_backward, we pass
    every parameter it requires, and its version lies in the range the `gpu` extra pins."""
    fai = pytest.importorskip("flash_attn.flash_attn_interface",
                              reason="flash-attn is not installed (the [gpu] extra): nothing to inspect")
    fn = fai._flash_attn_varlen_backward
    # 2.7+ wraps it in torch.library.custom_op, whose own signature is (*args, **kwargs).
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), "cannot read the real signature"
    ours = set(FLASH_VARLEN_BACKWARD_KWARGS)
    assert ours <= set(params), f"keywords the installed function lacks: {sorted(ours - set(params))}"
    required = {n for n, p in params.items() if p.default is p.empty}
    assert required <= ours, f"required parameters we do not pass: {sorted(required - ours)}"
    import flash_attn
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(FLASH_ATTN_VERSIONS).contains(flash_attn.__version__.split("+")[0], prereleases=True)


def _packed_sdpa_reference(seqs) -> dict[str, torch.Tensor]:
    """fp32 SDPA per sequence, concatenated in packed order: out, lse, dq, dk, dv."""
    refs = [sdpa_reference(*s, SCALE) for s in seqs]
    return {name: torch.cat([r[name] for r in refs]) for name in ("out", "lse", "dq", "dk", "dv")}


def _check_kernel_against_sdpa(kernel, lengths, heads, groups, tol) -> None:
    """One varlen causal call over all `lengths` (CUDA, bf16) vs fp32 SDPA per sequence."""
    seqs = _seqs(lengths, heads, groups, torch.bfloat16, seed=3)
    q, k, v, dout = (torch.cat([s[i] for s in seqs]).cuda() for i in range(4))
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    block = VarlenBlock.build(cu, cu, causal=True, device=q.device)
    out, lse = kernel.forward(q, k, v, block, scale=SCALE)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, block, scale=SCALE)
    ref = _packed_sdpa_reference(seqs)
    ours = {"out": out, "lse": lse.T, "dq": dq, "dk": dk, "dv": dv}
    for name, value in ours.items():
        assert value.shape == ref[name].shape, name
        assert excess(value.detach().float().cpu(), ref[name], tol, tol) <= 0, f"{name} beyond {tol}"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("heads,groups", [(4, 1), (4, 2), (2, 2)])
def test_torch_flash_backend_matches_sdpa(heads, groups) -> None:
    _check_kernel_against_sdpa(TorchFlashKernel(), [1, 2, 17, 64, 300, 3], heads, groups, 2.5e-2)


@pytest.mark.cuda
@needs_cuda
def test_dacp_attention_on_cuda_matches_sdpa() -> None:
    """The auto backend on CUDA through dacp_attention: local varlen plus a cp_size=1 distributed part."""
    lengths = [5, 40, 8]  # seqs 0-1 local, seq 2 distributed as 2 chunks of 4
    seqs = _seqs(lengths, 4, 2, torch.bfloat16, seed=4)
    q, k, v, dout = (torch.cat([s[i] for s in seqs]).cuda() for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    layout = DacpLayout(cp_size=1, local_lens=(5, 40), dist_chunk_lens=(4,))
    runtime = AttentionRuntime.create(None, q.device)  # auto on CUDA: flash or torch-flash
    out, lse = dacp_attention(q, k, v, layout, runtime, scale=SCALE)
    out.backward(dout)
    ref = _packed_sdpa_reference(seqs)
    ours = {"out": out, "lse": lse.T, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, value in ours.items():
        assert excess(value.detach().float().cpu(), ref[name], 2.5e-2, 2.5e-2) <= 0, name


@pytest.mark.cuda
@needs_cuda
def test_flash_attn_backend_matches_sdpa() -> None:
    pytest.importorskip("flash_attn")
    _check_kernel_against_sdpa(make_kernel("flash", torch.device("cuda")), [1, 17, 64], 4, 2, 2.5e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["torch-flash", "flash"])
def test_cuda_kernels_with_one_query_per_segment(backend) -> None:
    """max_seqlen_q == 1 with GQA sends both CUDA kernels down their ngroups-swap path (mha_varlen_fwd), whose
    lse layout the ring's merge and the backward rely on: an idle micro-batch, shards of one-token chunks."""
    if backend == "flash":
        pytest.importorskip("flash_attn")
    _check_kernel_against_sdpa(make_kernel(backend, torch.device("cuda")), [1, 1, 1], 4, 2, 2.5e-2)
