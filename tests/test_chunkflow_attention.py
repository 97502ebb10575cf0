"""A dependent chunk's attention, on every kernel backend, equals causal attention over the whole sequence.

One sequence (GQA, bf16 inputs) is cut into three chunks and run as the chunkflow schedule runs them: the
forward of each chunk in order through chunk_attention (its queries against the store's earlier K/V and its
own, workers/attention/chunked.py), then the backwards in reverse order, the later chunks' dK/dV reaching the
earlier chunks' k and v through the store. The reference nobody here wrote: PyTorch SDPA, causal, in fp32,
over the whole sequence, and its autograd gradients. The CUDA backends (torch-flash, flash) run on CPU
against the stand-ins of tests/cuda_standins.py, as in tests/test_attention_cuda_glue.py, with its bf16
tolerance (2.5e-2 abs + rel).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from cuda_standins import cuda_standins
from mp_utils import excess

from workers.attention import make_kernel
from workers.attention.chunked import ChunkCall, ChunkKV, chunk_attention
from workers.attention.index import VarlenBlock

SCALE = 0.3
BF16_TOL = 2.5e-2
SPANS = ((0, 8), (8, 16), (16, 23))


def _reference(q, k, v, dout) -> dict[str, torch.Tensor]:
    q, k, v = (x.float().transpose(0, 1).requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    out.backward(dout.float().transpose(0, 1))
    return {"out": out.detach().transpose(0, 1), "dq": q.grad.transpose(0, 1), "dk": k.grad.transpose(0, 1),
            "dv": v.grad.transpose(0, 1)}


def _chunked(backend: str, q, k, v, dout) -> dict[str, torch.Tensor]:
    kernel = make_kernel(backend, torch.device("cpu"))
    store = ChunkKV(q.shape[0])
    leaves, outs = [], []
    for start, stop in SPANS:
        qi, ki, vi = (x[start:stop].clone().requires_grad_() for x in (q, k, v))
        c = stop - start
        call = ChunkCall(store=store, start=start, stop=stop,
                         prior=VarlenBlock.build((0, c), (0, start), causal=False) if start else None)
        diag = VarlenBlock.build((0, c), (0, c), causal=True)
        outs.append(chunk_attention(qi, ki, vi, call, layer=0, kernel=kernel, diag=diag, scale=SCALE))
        leaves.append((qi, ki, vi))
    for (start, stop), out in reversed(list(zip(SPANS, outs, strict=True))):
        out.backward(dout[start:stop])
    grads = {name: torch.cat([leaf[i].grad for leaf in leaves]) for i, name in enumerate(("dq", "dk", "dv"))}
    return {"out": torch.cat([o.detach() for o in outs]), **grads}


@pytest.mark.parametrize("backend", ["torch", "torch-flash", "flash"])
def test_chunk_attention_equals_causal_attention_over_the_whole_sequence(backend: str) -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(SPANS[-1][1], heads, 16, generator=gen).bfloat16() for heads in (4, 2, 2, 4))
    reference = _reference(q, k, v, dout)
    with cuda_standins() if backend != "torch" else contextlib.nullcontext():
        ours = _chunked(backend, q, k, v, dout)
    for name, ref in reference.items():
        assert ours[name].shape == ref.shape, name
        assert excess(ours[name].float(), ref, BF16_TOL, BF16_TOL) <= 0, f"{backend}: {name}"
