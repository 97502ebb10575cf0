"""Single-process checks of the varlen kernel interface and DACP attention without a CP group.

Reference: PyTorch SDPA per sequence (causal, GQA). fp32 tolerance 1e-5 abs + rel: the aten CPU flash
op is ~5e-7 from SDPA; bf16 2.5e-2 vs an fp32 reference on the same bf16-rounded inputs.
"""

from __future__ import annotations

import pytest
import torch
from mp_utils import excess, sdpa_reference

from workers.attention import DacpLayout, dacp_attention, get_kernel
from workers.attention.kernels import auto_backend

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
    with pytest.raises(ValueError, match="backend"):
        get_kernel("triton")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_auto_backend_is_torch_on_cpu() -> None:
    assert auto_backend(torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="model.dtype=bf16"):
        get_kernel("torch-flash").forward(*(torch.zeros(2, 2, 8),) * 3, [0, 2], [0, 2], causal=True,
                                          scale=SCALE)


def _packed_sdpa_reference(seqs) -> dict[str, torch.Tensor]:
    """fp32 SDPA per sequence, concatenated in packed order: out, lse, dq, dk, dv."""
    refs = [sdpa_reference(*s, SCALE) for s in seqs]
    return {name: torch.cat([r[name] for r in refs]) for name in ("out", "lse", "dq", "dk", "dv")}


def _check_kernel_against_sdpa(kernel, lengths, heads, groups, tol) -> None:
    """One varlen causal call over all `lengths` (CUDA, bf16) vs fp32 SDPA per sequence."""
    seqs = _seqs(lengths, heads, groups, torch.bfloat16, seed=3)
    q, k, v, dout = (torch.cat([s[i] for s in seqs]).cuda() for i in range(4))
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out, lse = kernel.forward(q, k, v, cu, cu, causal=True, scale=SCALE)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, cu, cu, causal=True, scale=SCALE)
    ref = _packed_sdpa_reference(seqs)
    ours = {"out": out, "lse": lse.T, "dq": dq, "dk": dk, "dv": dv}
    for name, value in ours.items():
        assert value.shape == ref[name].shape, name
        assert excess(value.detach().float().cpu(), ref[name], tol, tol) <= 0, f"{name} beyond {tol}"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("heads,groups", [(4, 1), (4, 2), (2, 2)])
def test_torch_flash_backend_matches_sdpa(heads, groups) -> None:
    _check_kernel_against_sdpa(get_kernel("torch-flash"), [1, 2, 17, 64, 300, 3], heads, groups, 2.5e-2)


@pytest.mark.cuda
@needs_cuda
def test_dacp_attention_on_cuda_matches_sdpa() -> None:
    """The auto backend on CUDA through dacp_attention: local varlen plus a cp_size=1 distributed part."""
    lengths = [5, 40, 8]  # seqs 0-1 local, seq 2 distributed as 2 chunks of 4
    seqs = _seqs(lengths, 4, 2, torch.bfloat16, seed=4)
    q, k, v, dout = (torch.cat([s[i] for s in seqs]).cuda() for i in range(4))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    layout = DacpLayout(cp_size=1, local_lens=(5, 40), dist_chunk_lens=(4,))
    out, lse = dacp_attention(q, k, v, layout, None, scale=SCALE)
    out.backward(dout)
    ref = _packed_sdpa_reference(seqs)
    ours = {"out": out, "lse": lse.T, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, value in ours.items():
        assert excess(value.detach().float().cpu(), ref[name], 2.5e-2, 2.5e-2) <= 0, name


@pytest.mark.cuda
@needs_cuda
def test_flash_attn_backend_matches_sdpa() -> None:
    pytest.importorskip("flash_attn")
    _check_kernel_against_sdpa(get_kernel("flash"), [1, 17, 64], 4, 2, 2.5e-2)
