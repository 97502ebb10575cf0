"""The CUDA attention kernels' glue, run on CPU against stand-ins of the ops they call, and the hot path's
freedom from host syncs.

- Stand-ins (tests/cuda_standins.py) first meet references nobody here wrote: PyTorch SDPA per segment and
  the ops' own meta registrations (output shapes and dtypes), and refuse what the real kernels refuse.
- With them installed, `torch-flash` and `flash` run dacp_attention, and a CP=2 zigzag ring over gloo,
  and match the `torch` backend. Tolerance 2.5e-2 abs + rel: bf16 inputs, each side rounds to bf16
  (8 mantissa bits, ~4e-3 per op) in different places; fp32 accumulation on both.
- Structure: the host-built index tensors of a micro-batch (forward + backward) do not grow with the number
  of layers, for every backend. A `cuda` test runs a micro-batch under
  torch.cuda.set_sync_debug_mode("error").
- `auto` picks flash only when flash_attn imports.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cuda_standins import cuda_standins
from mp_utils import excess, sdpa_reference
from torch.overrides import TorchFunctionMode

from scheduling import DacpPlan
from workers.attention import AttentionRuntime, DacpLayout, dacp_attention, make_kernel
from workers.attention.kernels import FlashAttnKernel, TorchFlashKernel, resolve_backend
from workers.batch import build_rank_batch
from workers.forward import micro_batch_loss_sum
from workers.models import build_model
from workers.tools.launch import run_workers

SCALE = 0.3
BF16_TOL = 2.5e-2
CUDA_BACKENDS = ("torch-flash", "flash")


@pytest.fixture
def standins():
    with cuda_standins():
        yield


def _packed(lengths, heads, groups, head_dim=16, seed=0):
    """Per-sequence bf16 q, k, v, dout and their packed concatenation with int32 cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [[torch.randn(n, h, head_dim, generator=gen).bfloat16() for h in (heads, groups, groups, heads)]
            for n in lengths]
    packed = [torch.cat([s[i] for s in seqs]) for i in range(4)]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return seqs, packed, cu


def _full_reference(q, k, v, dout):
    """Non-causal fp32 SDPA (GQA) of one segment: out, lse and grads, [S, H, D] / [S, H]."""
    q, k, v = (x.float().transpose(0, 1).requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True)
    out.backward(dout.float().transpose(0, 1))
    rep = q.shape[0] // k.shape[0]
    lse = torch.logsumexp(SCALE * q.detach() @ k.detach().repeat_interleave(rep, 0).transpose(1, 2), -1)
    return {"out": out.detach().transpose(0, 1), "lse": lse.T, "dq": q.grad.transpose(0, 1),
            "dk": k.grad.transpose(0, 1), "dv": v.grad.transpose(0, 1)}


def _assert_close(ours: dict, refs: list[dict]) -> None:
    for name, value in ours.items():
        ref = torch.cat([r[name] for r in refs])
        assert value.shape == ref.shape, name
        assert excess(value.detach().float(), ref, BF16_TOL, BF16_TOL) <= 0, f"{name} beyond {BF16_TOL}"


def _meta(*tensors):
    return [t.to("meta") for t in tensors]


@pytest.mark.parametrize("causal", [True, False])
def test_aten_standins_match_sdpa_and_the_ops_meta_outputs(standins, causal) -> None:
    """The real aten ops (their schema and dispatch) with our CPU kernels: SDPA's numbers, the meta
    registration's shapes and dtypes, new gradient tensors."""
    lengths = [1, 5, 12, 3]
    seqs, (q, k, v, dout), cu = _packed(lengths, heads=4, groups=2)
    args = (cu, cu, max(lengths), max(lengths), 0.0, causal, False)
    outs = torch.ops.aten._flash_attention_forward(q, k, v, *args, scale=SCALE)
    metas = torch.ops.aten._flash_attention_forward(*_meta(q, k, v, cu, cu), *args[2:], scale=SCALE)
    assert [(o.shape, o.dtype) for o in outs] == [(m.shape, m.dtype) for m in metas]
    out, lse, rng_state, unused, _ = outs
    backward = torch.ops.aten._flash_attention_backward
    bwd_args = (max(lengths), max(lengths), 0.0, causal)
    grads = backward(dout, q, k, v, out, lse, cu, cu, *bwd_args, rng_state, unused, scale=SCALE)
    grad_metas = backward(*_meta(dout, q, k, v, out, lse, cu, cu), *bwd_args, *_meta(rng_state, unused),
                          scale=SCALE)
    assert [(g.shape, g.dtype) for g in grads] == [(m.shape, m.dtype) for m in grad_metas]
    reference = sdpa_reference if causal else (lambda q, k, v, d, _: _full_reference(q, k, v, d))
    refs = [reference(*s, SCALE) for s in seqs]
    _assert_close({"out": out, "lse": lse.T, "dq": grads[0], "dk": grads[1], "dv": grads[2]}, refs)


def test_flash_attn_standins_match_sdpa_and_write_gradients_in_place(standins) -> None:
    from flash_attn import flash_attn_interface as fai

    lengths = [4, 1, 9]
    seqs, (q, k, v, dout), cu = _packed(lengths, heads=4, groups=1, head_dim=8)
    out, lse, s_dmask = fai.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, softmax_scale=SCALE, causal=True,
                                                   return_attn_probs=True)
    assert lse.shape == (4, sum(lengths)) and lse.dtype == torch.float32 and s_dmask.numel() == 0
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    softmax_d = fai._flash_attn_varlen_backward(
        dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu,
        cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9, dropout_p=0.0, softmax_scale=SCALE, causal=True,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False)
    assert softmax_d.shape == (4, sum(lengths) + 128 * len(lengths)) and softmax_d.dtype == torch.float32
    _assert_close({"out": out, "lse": lse.T, "dq": dq, "dk": dk, "dv": dv},
                  [sdpa_reference(*s, SCALE) for s in seqs])
    # The public function's own autograd path (head dim padded to 16 and sliced back) agrees too.
    q12, k12, v12 = (x[..., :6].clone().requires_grad_() for x in (q, k, v))
    out12 = fai.flash_attn_varlen_func(q12, k12, v12, cu, cu, 9, 9, softmax_scale=SCALE, causal=True)
    out12.backward(dout[..., :6])
    refs = [sdpa_reference(*(x[..., :6] for x in s), SCALE) for s in seqs]
    _assert_close({"out": out12, "dq": q12.grad, "dk": k12.grad, "dv": v12.grad}, refs)


def test_standins_refuse_what_the_real_kernels_refuse(standins) -> None:
    _, (q, k, v, _), cu = _packed([3, 5], heads=4, groups=2)
    op = torch.ops.aten._flash_attention_forward
    cases = {
        "cu_seqlens_q must have dtype int32": (q, k, v, cu.long(), cu, 5, 5),
        "longer than max_seqlen_q": (q, k, v, cu, cu, 4, 5),
        "fp16 and bf16": (q.float(), k.float(), v.float(), cu, cu, 5, 5),
        "multiple of 8": (q[..., :12], k[..., :12], v[..., :12], cu, cu, 5, 5),
        "must divide": (q[:, :3], k, v, cu, cu, 5, 5),
        "contiguous last dimension": (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, cu, 5, 5),
        "one query per segment": (q[:1], k, v, torch.tensor([0, 0, 1], dtype=torch.int32), cu, 1, 5),
    }
    for message, args in cases.items():
        with pytest.raises(RuntimeError, match=message):
            op(*args, 0.0, True, False, scale=SCALE)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_backend_runs_dacp_attention_like_the_torch_backend(standins, backend) -> None:
    """One rank: local sequences plus distributed ones (padded, diagonal block), bf16, GQA, through
    make_kernel and dacp_attention exactly as a worker calls them."""
    layout = DacpLayout(cp_size=1, local_lens=(5, 1, 9), dist_chunk_lens=(4, 2))
    results = {}
    for name in ("torch", backend):
        gen = torch.Generator().manual_seed(7)
        q, k, v, dout = (torch.randn(layout.num_tokens, h, 16, generator=gen).bfloat16()
                         for h in (4, 2, 2, 4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        runtime = AttentionRuntime.create(None, torch.device("cpu"), name)
        out, lse = dacp_attention(q, k, v, layout, runtime, scale=SCALE)
        out.backward(dout)
        results[name] = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    assert isinstance(runtime.kernel, TorchFlashKernel if backend == "torch-flash" else FlashAttnKernel)
    for key, ref in results["torch"].items():
        ours = results[backend][key].detach().float()
        assert excess(ours, ref.detach().float(), BF16_TOL, BF16_TOL) <= 0, key


def _ring_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    results = []
    with cuda_standins():
        runtimes = {name: AttentionRuntime.create(group, torch.device("cpu"), name)
                    for name in ("torch", *CUDA_BACKENDS)}
        for case in cases:
            ids = [[1] * n for n in case["lengths"]]
            plan = DacpPlan(local=tuple(map(tuple, case["local"])), distributed=tuple(case["dist"]))
            batch = build_rank_batch(plan, ids, ids, cp_rank=rank, cp_size=world).to("cpu")
            per_backend = {}
            for name, runtime in runtimes.items():
                gen = torch.Generator().manual_seed(100 * rank + case["seed"])
                q, k, v, dout = (torch.randn(batch.num_tokens, h, 16, generator=gen).bfloat16()
                                 for h in (case["heads"], case["groups"], case["groups"], case["heads"]))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                out, lse = dacp_attention(q, k, v, batch.index, runtime, scale=SCALE)
                out.backward(dout)
                per_backend[name] = {"kernel": type(runtime.kernel).__name__, "out": out.detach(), "lse": lse,
                                     "dq": q.grad, "dk": k.grad, "dv": v.grad}
            results.append(per_backend)
    return results


@pytest.mark.slow
def test_cuda_backends_match_the_torch_backend_over_a_cp2_ring() -> None:
    """CP=2 over gloo (2 processes): local + zigzag-sharded sequences whose lengths are not multiples of
    2 * CP (padding), bf16, GQA and MQA; each CUDA backend's forward and gradients vs the torch backend's."""
    lengths = [7, 13, 5, 22, 3, 1, 10]
    cases = [dict(lengths=lengths, local=[[0, 5], [2]], dist=[1, 3, 4, 6], heads=4, groups=2, seed=1),
             dict(lengths=lengths, local=[[], [0]], dist=[1, 2, 3, 6], heads=4, groups=1, seed=2)]
    per_rank = run_workers(_ring_worker, 2, args=(cases,), backend="gloo")
    failures = []
    for rank, results in enumerate(per_rank):
        for c, per_backend in enumerate(results):
            assert per_backend["flash"]["kernel"] == "FlashAttnKernel"
            assert per_backend["torch-flash"]["kernel"] == "TorchFlashKernel"
            for backend in CUDA_BACKENDS:
                for key in ("out", "lse", "dq", "dk", "dv"):
                    bad = excess(per_backend[backend][key].float(), per_backend["torch"][key].float(),
                                 BF16_TOL, BF16_TOL)
                    if bad > 0:
                        failures.append(f"rank {rank} case {c} {backend} {key}: {bad:.3g} beyond {BF16_TOL}")
    assert not failures, "\n".join(failures)


class _BrokenFlashAttn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """flash_attn as a wheel built against another torch: found (find_spec), but its import fails."""

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")


class _NoFlashAttn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn":
            raise ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn")
        return None


def _with_finder(monkeypatch, finder) -> None:
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])


def test_auto_picks_flash_only_when_flash_attn_imports(monkeypatch, caplog) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # resolving does not touch the device
    _with_finder(monkeypatch, _BrokenFlashAttn())
    assert importlib.util.find_spec("flash_attn") is not None  # "installed", as the old rule saw it
    with caplog.at_level(logging.WARNING, logger="workers.attention.kernels"):
        assert resolve_backend("auto", cuda) == "torch-flash"
        assert isinstance(make_kernel("auto", cuda), TorchFlashKernel)
    assert "does not import" in caplog.text and "undefined symbol" in caplog.text
    with pytest.raises(ImportError, match="does not import"):
        make_kernel("flash", cuda)
    caplog.clear()
    _with_finder(monkeypatch, _NoFlashAttn())
    assert resolve_backend("auto", cuda) == "torch-flash" and not caplog.text  # absent: nothing to say
    with cuda_standins():  # a flash_attn that imports and takes our keywords
        assert resolve_backend("auto", cuda) == "flash"
        assert isinstance(make_kernel("auto", cuda), FlashAttnKernel)
        assert resolve_backend("auto", cpu) == "torch"
    assert "flash_attn" not in sys.modules  # everything the stand-ins installed is undone on exit
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_kernel("torch-flash", cpu)


class _HostIndexCounter(TorchFunctionMode):
    """Counts tensors built from host data or host ints: torch.tensor / as_tensor / asarray / arange."""

    NAMES = frozenset({"tensor", "as_tensor", "asarray", "arange", "frombuffer"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.NAMES
        return func(*args, **(kwargs or {}))


def _host_index_tensors(monkeypatch, backend: str, layers: int) -> int:
    """Host-built index tensors of one micro-batch (moved to the device, forward, backward) on a model."""
    model = build_model("tiny-qwen2", num_layers=layers, dtype="bf16", seed=0)
    runtime = AttentionRuntime.create(None, torch.device("cpu"), backend)
    ids = [list(range(1, n + 1)) for n in (5, 11, 3, 6)]
    plan = DacpPlan(local=((0, 2),), distributed=(1, 3))  # local + "distributed" (padded, diagonal block)
    batch = build_rank_batch(plan, ids, ids, cp_rank=0, cp_size=1)
    counter = _HostIndexCounter()
    from_numpy = torch.from_numpy

    def counted_from_numpy(array):
        counter.count += 1
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", counted_from_numpy)
    with counter:
        micro_batch_loss_sum(model, batch, runtime=runtime, loss_chunk_tokens=4).backward()
    monkeypatch.setattr(torch, "from_numpy", from_numpy)
    return counter.count


@pytest.mark.parametrize("backend", ["torch", *CUDA_BACKENDS])
def test_host_built_index_tensors_do_not_grow_with_the_layers(standins, monkeypatch, backend) -> None:
    """Everything attention and loss index with is built once per micro-batch, before the first layer."""
    one, three = (_host_index_tensors(monkeypatch, backend, layers) for layers in (1, 3))
    assert one == three, f"{backend}: {one} host-built index tensors with 1 layer, {three} with 3"
    assert one <= 2  # DacpIndex.build: one int32 tensor of bounds, one int64 of shard rows


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
def test_a_micro_batch_never_syncs_the_host_on_cuda() -> None:
    """Forward + backward of a micro-batch (local + sharded sequences, cp_size 1) through the DACP model on
    CUDA under torch.cuda.set_sync_debug_mode("error"): any host sync in the hot path raises. A first
    micro-batch warms up lazy initialisations (cuBLAS handles, pinned-memory pool) outside the mode."""
    device = torch.device("cuda")
    model = build_model("tiny-qwen2", dtype="bf16", seed=0).to(device)
    runtime = AttentionRuntime.create(None, device, "auto")
    ids = [list(range(1, n + 1)) for n in (37, 120, 5, 64)]
    labels = [[-100] * (n // 2) + seq[n // 2:] for n, seq in zip((37, 120, 5, 64), ids, strict=True)]
    plan = DacpPlan(local=((0, 2),), distributed=(1, 3))
    batches = [build_rank_batch(plan, ids, labels, cp_rank=0, cp_size=1) for _ in range(2)]
    micro_batch_loss_sum(model, batches[0], runtime=runtime, loss_chunk_tokens=16).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = micro_batch_loss_sum(model, batches[1], runtime=runtime, loss_chunk_tokens=16)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
