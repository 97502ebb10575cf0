"""model.kernels (workers/kernels): which set a worker runs, and the liger set's wiring.

liger-kernel's Triton kernels run on CUDA only. On CPU a stand-in package named `liger_kernel` provides the
functions the liger set calls (liger_kernel.transformers.functional: liger_rms_norm, liger_swiglu;
liger_kernel.transformers.rope: liger_rotary_pos_emb; liger_kernel.ops: the fused linear cross-entropy's
forward, which also returns the gradients, and the in-place kernel that scales them), each computing
what liger documents it computes, in plain torch. What this checks is our side: every RMSNorm and gated MLP
of the decoder runs liger's function, RoPE is installed in the model family's modeling module (and restored
by the torch set), the loss head calls the fused linear cross-entropy over the label rows only with the sum
reduction and fp32 accumulation, and with all of that the loss and gradients equal the torch set's within
fp32 rounding. The kernels' own numerics against transformers' modules are checked on a GPU
(tests/test_kernels_cuda.py, `gpu_check.sh kernels` and `speed`).
"""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest
import torch

from workers.kernels import kernel_set, kernels_problem, resolve_kernels

SPEC = {"name_or_path": "tiny-qwen2", "vocab_size": 96, "hidden_size": 32, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "seed": 3}


def _standin() -> tuple[types.ModuleType, dict[str, list]]:
    """A `liger_kernel` package of liger's public functions in plain torch; records each call."""
    calls: dict[str, list] = {"rms_norm": [], "swiglu": [], "flce": [], "scale": [], "rope": []}

    def liger_rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
        calls["rms_norm"].append(casting_mode)
        x = X.float()
        return (offset + W) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(X.dtype)

    def liger_swiglu(a, b):
        calls["swiglu"].append(a.shape)
        return torch.nn.functional.silu(a) * b

    def fused_linear_cross_entropy_forward(_input, weight, target, ce_weight=None, bias=None,
                                           ignore_index=-100, reduction="mean", accum_dtype=None,
                                           chunk_mem_const=1, **_):
        """The loss and, as liger's forward does, the gradients of the input rows and the weight."""
        calls["flce"].append({"rows": _input.shape[0], "reduction": reduction, "accum_dtype": accum_dtype,
                              "ignored": int((target == ignore_index).sum()), "mem_const": chunk_mem_const})
        with torch.enable_grad():
            rows = _input.detach().requires_grad_()
            head = weight.detach().requires_grad_(weight.requires_grad)
            logits = torch.nn.functional.linear(rows, head, bias).float()
            loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index,
                                                     reduction=reduction)
            grads = torch.autograd.grad(loss, [rows, head] if head.requires_grad else [rows])
        grad_weight = grads[1].to(weight.dtype) if head.requires_grad else None
        return loss.detach(), None, None, None, grads[0], grad_weight, None

    class ElementMul:
        """liger's in-place `X *= *grad_output` kernel, launched as `kernel[grid](...)`."""

        def __getitem__(self, grid):
            def launch(x, x_stride, grad_output, n_cols, BLOCK_SIZE, X_col_stride=1, num_warps=32):
                calls["scale"].append((grid, tuple(x.shape), n_cols))
                x.mul_(grad_output)
            return launch

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls["rope"].append(q.shape)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

        def rotate_half(x):
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    names = ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.functional",
             "liger_kernel.transformers.rope", "liger_kernel.ops",
             "liger_kernel.ops.fused_linear_cross_entropy", "liger_kernel.ops.utils")
    modules = {name: types.ModuleType(name) for name in names}
    functional = modules["liger_kernel.transformers.functional"]
    functional.liger_rms_norm, functional.liger_swiglu = liger_rms_norm, liger_swiglu
    modules["liger_kernel.transformers.rope"].liger_rotary_pos_emb = liger_rotary_pos_emb
    flce = modules["liger_kernel.ops.fused_linear_cross_entropy"]
    flce.fused_linear_cross_entropy_forward, flce.MAX_FUSED_SIZE = fused_linear_cross_entropy_forward, 32768
    utils = modules["liger_kernel.ops.utils"]
    utils.element_mul_kernel, utils.is_hip = ElementMul(), lambda: False
    for name, module in modules.items():  # each package holds its submodules as attributes
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules, calls


@pytest.fixture
def liger(monkeypatch):
    modules, calls = _standin()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield calls
    from workers.models import build_model

    kernel_set("torch").activate(build_model(**SPEC))  # transformers' own RoPE back for later tests


def _loss_and_grads(model, scale: float = 1.0, counter=None) -> tuple[float, list[torch.Tensor]]:
    """The micro-batch's loss and every parameter's gradient of `scale` x loss (the backward inside
    `counter`, a TorchDispatchMode, when given)."""
    from scheduling import DacpPlan
    from scheduling.payload import IGNORE_INDEX
    from workers.batch import build_rank_batch
    from workers.forward import micro_batch_loss_sum

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 96, size=n) for n in (23, 9, 40)]
    labels = [i.copy() for i in ids]
    for lab in labels:
        lab[: len(lab) // 2] = IGNORE_INDEX
    batch = build_rank_batch(DacpPlan(local=((0, 1, 2),), distributed=()), ids, labels, cp_rank=0, cp_size=1)
    model.zero_grad(set_to_none=True)
    loss = micro_batch_loss_sum(model, batch, loss_chunk_tokens=16)
    with counter or contextlib.nullcontext():
        (loss * scale).backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


LossAndGrads = tuple[float, list[torch.Tensor]]


def _with_set(name: str, scale: float = 1.0, counter=None) -> LossAndGrads:
    """_loss_and_grads of SPEC's model with kernel set `name` applied and activated."""
    from workers.models import build_model

    model = build_model(**SPEC)
    kernel_set(name).apply(model)
    kernel_set(name).activate(model)
    return _loss_and_grads(model, scale, counter)


def _same_loss_and_grads(ours: LossAndGrads, ref: LossAndGrads) -> None:
    """Equal within fp32 rounding: the loss 1e-5 relative, each gradient 1e-5 of its largest entry."""
    assert abs(ours[0] - ref[0]) <= 1e-5 * abs(ref[0])
    for a, b in zip(ours[1], ref[1], strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-8


def test_the_liger_set_routes_every_norm_mlp_rope_and_the_loss_through_liger(liger) -> None:
    reference = _with_set("torch")
    ours = _with_set("liger")

    layers = 2
    assert len(liger["rms_norm"]) == 2 * layers + 1  # two per layer and the final norm
    assert set(liger["rms_norm"]) == {"llama"}
    assert len(liger["swiglu"]) == layers and len(liger["rope"]) == layers
    (flce,) = liger["flce"]
    label_rows = sum(n - n // 2 for n in (23, 9, 40))  # targets = labels[1:]: the prompt's first token drops
    assert flce["rows"] == label_rows and flce["ignored"] == 0  # only rows with a target reach it
    assert flce["reduction"] == "sum" and flce["accum_dtype"] == torch.float32
    # chunk_mem_const sizes liger's chunk near train.loss_chunk_tokens (16 rows here): 96 / (32 k) chunks
    assert flce["mem_const"] == int(np.ceil(96 / (32 * np.ceil(label_rows / 16))))
    _same_loss_and_grads(ours, reference)


def test_the_liger_loss_scales_its_gradients_without_a_host_read(liger) -> None:
    """The head's loss reaches liger with a gradient of W / G, never 1 (workers/step.py): the backward
    scales the gradients liger's forward computed, in place with liger's kernel (one launch for the hidden
    rows' gradient, one for the head weight's), and reads nothing back to the host, where liger's own
    backward asks whether that gradient is 1 (workers/kernels/liger_linear_ce.py; on a GPU,
    tests/test_kernels_cuda.py checks the same with liger's kernels and torch.cuda.set_sync_debug_mode)."""
    from tests.test_fast_step import SyncCounter

    reference = _with_set("torch", scale=0.37)
    counter = SyncCounter()
    ours = _with_set("liger", scale=0.37, counter=counter)
    assert counter.calls == []
    rows = liger["flce"][0]["rows"]
    assert [(grid, shape) for grid, shape, _ in liger["scale"]] == [((rows,), (rows, 32)), ((96,), (96, 32))]
    _same_loss_and_grads(ours, reference)


def test_the_liger_loss_set_routes_the_loss_alone_through_liger(liger) -> None:
    """liger_loss (`auto` under train.compile on CUDA): liger's fused linear cross-entropy, transformers'
    own norms, MLPs and RoPE (the compiler fuses those); the loss and gradients of the torch set."""
    reference = _with_set("torch")
    ours = _with_set("liger_loss")
    assert [len(liger[k]) for k in ("rms_norm", "swiglu", "rope", "flce")] == [0, 0, 0, 1]
    assert liger["flce"][0]["reduction"] == "sum" and liger["flce"][0]["accum_dtype"] == torch.float32
    _same_loss_and_grads(ours, reference)


def test_which_set_a_worker_runs(monkeypatch) -> None:
    import workers.kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernels("auto", cpu, "qwen2") == "torch"
    assert resolve_kernels("auto", cpu, "qwen2", compile=True) == "torch"
    assert resolve_kernels("torch", cuda, "qwen2") == "torch"
    monkeypatch.setattr(workers.kernels, "liger_available", lambda: True)  # as on a GPU machine with liger
    assert resolve_kernels("auto", cuda, "qwen2") == "liger"
    assert resolve_kernels("auto", cuda, "qwen2", compile=True) == "liger_loss"
    assert resolve_kernels("liger", cuda, "qwen2", compile=True) == "liger"  # asked for: liger in the layers
    assert resolve_kernels("torch", cuda, "qwen2", compile=True) == "torch"
    assert resolve_kernels("auto", cuda, "gpt2", compile=True) == "torch"  # a family liger does not cover
    with pytest.raises(ValueError, match="model.kernels=liger runs liger-kernel's Triton kernels"):
        resolve_kernels("liger", cpu, "qwen2")
    assert kernels_problem("liger", on_gpu=True, available=False).startswith(
        "model.kernels=liger needs liger-kernel, which is not installed")
    assert kernels_problem("auto", on_gpu=False) is None


def test_liger_on_cpu_workers_is_a_config_error() -> None:
    from app.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.kernels=liger"):
        load_config(None, ["model.kernels=liger"])
    assert load_config(None, ["model.kernels=liger", "resources.gpus_per_worker=1",
                              "model.dtype=bf16"]).model.kernels == "liger"
