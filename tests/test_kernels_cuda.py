"""On a CUDA device: liger's kernels against transformers' own modules, and a training step that never makes
the host wait (torch.cuda.set_sync_debug_mode). Skipped without CUDA (run by `gpu_check.sh kernels` and
`gpu_check.sh speed`).

The reference for liger is the torch kernel set (transformers' RMSNorm, SwiGLU MLP and RoPE, our chunked
linear cross-entropy) on the same bf16 model and batch: bf16 rounds each kernel's intermediate differently,
so the loss must agree within 1% and every gradient within 5% of its scale (a wrong kernel or a wrong
wiring is off by far more: a missing norm weight, a swapped gate, a RoPE on the wrong positions all move
the loss by tens of percent on random weights).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                                 reason="needs liger-kernel")
SPEC = {"name_or_path": "tiny-qwen2", "vocab_size": 4096, "hidden_size": 256, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "seed": 3,
        "dtype": "bf16"}


def _batch(device):
    from scheduling import DacpPlan
    from scheduling.payload import IGNORE_INDEX
    from workers.batch import build_rank_batch

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 4096, size=n) for n in (300, 77, 1024)]
    labels = [i.copy() for i in ids]
    for lab in labels:
        lab[: len(lab) // 3] = IGNORE_INDEX
    plan = DacpPlan(local=((0, 1, 2),), distributed=())
    return build_rank_batch(plan, ids, labels, cp_rank=0, cp_size=1).to(device)


def _loss_and_grads(kernels: str):
    from workers.forward import micro_batch_loss_sum
    from workers.models import ModelSpec

    device = torch.device("cuda")
    model = ModelSpec(**SPEC, kernels=kernels).build_on(device)
    loss = micro_batch_loss_sum(model, _batch(device), loss_chunk_tokens=512)
    loss.backward()
    return float(loss.detach()), [p.grad.float() for p in model.parameters()], model.skrull_kernels


@pytest.mark.cuda
@needs_cuda
@needs_liger
def test_liger_kernels_match_transformers_modules_on_cuda() -> None:
    ref_loss, ref_grads, ref_name = _loss_and_grads("torch")
    loss, grads, name = _loss_and_grads("liger")
    assert (ref_name, name) == ("torch", "liger")
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (loss, ref_loss)
    for ours, ref in zip(grads, ref_grads, strict=True):
        assert (ours - ref).abs().max() <= 5e-2 * ref.abs().max() + 1e-6


def _sync_free_steps(rank: int, world: int) -> dict[str, list[str]]:
    """Three steps of the device step on CUDA with sync debug mode "error" (a sync raises), at ZeRO-2 and at
    the ZeRO-1 one worker runs for it (DeepSpeed's BF16_Optimizer, workers/bf16_step.py), with the torch
    kernel set: liger's fused linear cross-entropy's forward reads the device once per micro-batch itself
    (its `.item()` count of targets, in liger's own code); its backward's `torch.equal(grad_output, 1)` is
    gone (workers/kernels/liger_linear_ce.py, tested below)."""
    return {"zero2": _sync_errors(one_rank_zero1=False), "zero1": _sync_errors(one_rank_zero1=True)}


def _sync_errors(*, one_rank_zero1: bool) -> list[str]:
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from scheduling import CostModel, plan_step
    from scheduling.payload import Cursor, Sample, build_rank_payloads
    from workers.distributed import ParallelGroups
    from workers.engine import build_engine
    from workers.models import ModelSpec
    from workers.step import run_step

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device("cuda", 0)
    ds = deepspeed_config(load_config(None, []).train, dtype="bf16", on_gpu=True)
    groups = ParallelGroups.create(1, device=device)
    engine = build_engine(ModelSpec(**SPEC, kernels="torch"), ds, device, seed=0,
                          one_rank_zero1=one_rank_zero1)
    rng = np.random.default_rng(1)
    lengths = [300, 77, 1024, 40]
    samples = [Sample(sample_id=i, input_ids=rng.integers(1, 4096, n), labels=rng.integers(1, 4096, n))
               for i, n in enumerate(lengths)]
    cost = CostModel.from_model_dims(hidden_size=256, kv_hidden_size=128, num_layers=2)
    plan = plan_step("skrull", lengths, dp_size=1, cp_size=1, bucket_size=1100, cost=cost)
    assert len(plan.micro_batches[0]) >= 2  # the fp32 sums over micro-batches run too
    payload = build_rank_payloads(plan, samples, step=1, epoch=0, cursor=Cursor(epoch=0, rows=4),
                                  plan_ms=0.0)[0, 0]
    run_step(engine, payload, groups, device=device, loss_chunk_tokens=512, sync=True)  # lazy inits
    errors = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            run_step(engine, payload, groups, device=device, loss_chunk_tokens=512)
    except RuntimeError as err:
        errors.append(str(err).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return errors


@pytest.mark.cuda
@needs_cuda
def test_a_training_step_never_synchronizes_on_cuda() -> None:
    from workers.tools.launch import run_workers

    (errors,) = run_workers(_sync_free_steps, 1, backend="nccl")
    assert errors == {"zero2": [], "zero1": []}


@pytest.mark.cuda
@needs_cuda
@needs_liger
def test_the_loss_heads_backward_is_ligers_without_its_host_read_on_cuda() -> None:
    """workers/kernels/liger_linear_ce.py against liger's own function (the same forward and kernels): the
    loss and both gradients bit for bit under the product's non-unit gradient (W / G), and its backward runs
    under torch.cuda.set_sync_debug_mode("error"), where liger's own backward raises (its torch.equal)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from workers.kernels.liger_linear_ce import LinearCrossEntropySum

    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3000, 256, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(4096, 256, device="cuda", generator=generator) * 0.02).bfloat16()
    targets = torch.randint(0, 4096, (3000,), device="cuda", generator=generator)
    scale = torch.tensor(0.37, device="cuda")

    def ours(x, w):
        return LinearCrossEntropySum.apply(x, w, None, targets, 2)

    def ligers(x, w):
        return liger_fused_linear_cross_entropy(x, w, targets, reduction="sum", accum_dtype=torch.float32,
                                                chunk_mem_const=2)

    def run(loss_fn, mode: str) -> tuple[torch.Tensor, ...]:
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_fn(x, w)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            (loss * scale).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return loss.detach(), x.grad, w.grad

    run(ours, "default")  # Triton's first compile of the scaling kernel, outside the checked run
    mine, reference = run(ours, "error"), run(ligers, "default")
    assert all(torch.equal(a, b) for a, b in zip(mine, reference, strict=True))
    with pytest.raises(RuntimeError):
        run(ligers, "error")


@pytest.mark.cuda
@needs_cuda
def test_a_bf16_gradient_adds_into_its_fp32_sum_in_one_kernel_on_cuda() -> None:
    """workers/bf16_accumulate.py's premise: on CUDA, `fp32.add_(bf16)` widens inside the kernel (one
    launch, no fp32 temporary), and sums exactly as DeepSpeed's `fp32.add_(bf16.to(fp32))`."""
    from torch.profiler import ProfilerActivity, profile

    grad = torch.randn(4096, 896, device="cuda").to(torch.bfloat16)
    lean = torch.randn(4096, 896, device="cuda")
    reference = lean.clone().add_(grad.to(torch.float32))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        lean.add_(grad)
        torch.cuda.synchronize()
    ops = {e.key: e.count for e in prof.key_averages()}
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert "aten::_to_copy" not in ops and len(kernels) == 1, (ops, [k.name for k in kernels])
    assert torch.equal(lean, reference)


@pytest.mark.cuda
@needs_cuda
def test_fused_adamws_state_allocated_ahead_trains_as_its_lazy_state_on_cuda() -> None:
    """workers/optimizer_state.py with torch's fused CUDA AdamW (its own kernel, not the CPU one that
    tests/test_optimizer_state.py runs): the weights stay bit for bit, the step counters are device
    tensors at 0, and three steps from there equal three from torch's lazily created state."""
    from workers.optimizer_state import allocate_optimizer_state

    generator = torch.Generator(device="cuda").manual_seed(0)
    start = [torch.randn(n, device="cuda", generator=generator) for n in (4096 * 896, 896, 7)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(3)]

    def trained(ahead: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
        if ahead:
            assert allocate_optimizer_state(optimizer)
            assert all(torch.equal(p, t) for p, t in zip(params, start, strict=True))
            steps = [state["step"] for state in optimizer.state.values()]
            assert all(s.device.type == "cuda" and float(s) == 0.0 for s in steps)
        for step_grads in grads:
            for param, grad in zip(params, step_grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
        return [p.detach() for p in params]

    assert all(torch.equal(a, b) for a, b in zip(trained(True), trained(False), strict=True))


@pytest.mark.cuda
@needs_cuda
def test_the_profiles_device_memory_is_what_the_allocator_can_hold_on_cuda() -> None:
    """`profile`'s device_memory_bytes (free + reserved): what this process allocates moves it by at most
    a segment's rounding, and it sits below the device's total by what lives outside the allocator."""
    from workers.tools.profile_memory import allocator_capacity_bytes

    device = torch.device("cuda")
    before = allocator_capacity_bytes(device)
    block = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    during = allocator_capacity_bytes(device)
    del block
    total = torch.cuda.get_device_properties(device).total_memory
    assert abs(during - before) <= 32 << 20, (before, during)
    assert 0.8 * total < before < total, (before, total)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kernels", ["liger", "torch"])
def test_what_the_forward_keeps_on_cuda_is_what_the_memory_model_counts(kernels: str) -> None:
    """The memory model's per-token count of each kernel set (app/profiling/activation/) against what the
    forward keeps on CUDA, within 5%: the direct measurement of the slope that two `train` runs' peaks on
    one H200 can only bound (their warm-up ran without the optimizer's state then, docs/benchmarks.md).
    Whichever set this fails for, its message holds both numbers; torch, checked on CPU by the ledger, is
    the control."""
    if kernels == "liger" and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("needs liger-kernel")
    from app.profiling.activation import Checkpointing, kernel_set, pass_memory, shape_from_hf
    from tests.saved_tensors import kept_per_token
    from workers.models import ModelSpec

    device = torch.device("cuda")
    model = ModelSpec(**SPEC, kernels=kernels).build_on(device)
    kept = kept_per_token(model, device, (1024, 2048))
    shape = shape_from_hf(model.config.to_dict(), element=2)
    modeled = pass_memory(shape, kernel_set(kernels), Checkpointing(0), 512).kept_per_token
    assert modeled == pytest.approx(kept, rel=0.05), (kernels, modeled, kept)
