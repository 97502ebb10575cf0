"""workers/bf16_accumulate.py: BF16_Optimizer's per-parameter gradient accumulation in one kernel.

In a 1-rank gloo world (the BF16_Optimizer that one worker runs, workers/engine.py), a tiny Qwen2-shaped model
in bf16 with tied embeddings trains three planned steps of 2-3 micro-batches twice from the same seed: with
the lean hooks (build_engine's default) and with DeepSpeed's own hooks. The reference is DeepSpeed's
code: the fp32 gradient sums after a step's micro-batches, and then the fp32 master weights, AdamW's state
and the bf16 weights after every step, must be equal bit for bit (the in-place add widens each bf16 element
exactly, as DeepSpeed's copy does). That the add is one kernel with no fp32 copy holds on CUDA (CPU's
TensorIterator widens through a temporary): tests/test_kernels_cuda.py checks it there.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.planned_steps import planned_steps
from tests.test_one_rank_zero1 import _state

VOCAB = 96
SPEC = {"name_or_path": "tiny-qwen2", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "seed": 3,
        "dtype": "bf16"}
LENGTHS = ([30, 7, 12, 5, 40], [9, 44, 3, 11, 20], [22, 6, 17, 8, 33])


def _engine(lean: bool):
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from workers import bf16_accumulate
    from workers.engine import build_engine
    from workers.models import ModelSpec

    train = load_config(None, ["train.optimizer_impl=fused", "train.lr=0.003"]).train
    ds = deepspeed_config(train, dtype="bf16", on_gpu=False)
    real = bf16_accumulate.install
    if not lean:
        bf16_accumulate.install = lambda optimizer: None  # DeepSpeed's hooks stay
    try:
        return build_engine(ModelSpec(**SPEC), ds, torch.device("cpu"), seed=0)
    finally:
        bf16_accumulate.install = real


def _run(lean: bool, payloads: list) -> dict:
    """Per step: the fp32 gradient sums before the optimizer step, then the state after it; which hooks
    accumulate (the function that made each parameter's hook)."""
    from workers.distributed import ParallelGroups
    from workers.step import run_step

    engine = _engine(lean)
    groups = ParallelGroups.create(1)
    sums, states = [], []
    real_step = engine.optimizer.step

    def step_after_reading_sums(*args, **kwargs):
        sums.append([g.clone() for g in engine.optimizer.fp32_groups_gradients_flat])
        return real_step(*args, **kwargs)

    engine.optimizer.step = step_after_reading_sums
    for payload in payloads:
        run_step(engine, payload, groups, device=torch.device("cpu"), loss_chunk_tokens=16)
        states.append(_state(engine))
    params = sum(1 for p in engine.module.parameters() if p.requires_grad)
    hooks = {h.__qualname__.split(".")[0] for p in engine.module.parameters()
             for h in p._post_accumulate_grad_hooks.values()}
    return {"sums": sums, "states": states, "params": params, "hooks": len(engine.optimizer._grad_acc_hooks),
            "hook_makers": hooks}


def _worker(rank: int, world: int) -> dict:
    """One rank of its own (DeepSpeed keeps process-wide group state between engines)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    payloads = [step[0, 0] for step in planned_steps(LENGTHS, vocab=VOCAB, bucket_size=48)]
    assert all(len(p.micro_batches) >= 2 for p in payloads)  # sums over micro-batches are exercised
    return {"lean": _run(True, payloads), "deepspeed": _run(False, payloads)}


@pytest.fixture(scope="module")
def runs() -> dict:
    from workers.tools.launch import run_workers

    (result,) = run_workers(_worker, 1, backend="gloo")
    return result


def test_lean_hooks_accumulate_the_same_bits_as_deepspeeds(runs: dict) -> None:
    lean, reference = runs["lean"], runs["deepspeed"]
    assert lean["hooks"] == reference["hooks"] == lean["params"]
    assert lean["hook_makers"] == {"_accumulator"}, lean["hook_makers"]
    assert "_accumulator" not in reference["hook_makers"], reference["hook_makers"]
    for step, (a, b) in enumerate(zip(lean["sums"], reference["sums"], strict=True), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}: fp32 gradient sums"
        assert any(bool(x.abs().sum() > 0) for x in a), f"step {step}: no gradient accumulated"
    for step, (a, b) in enumerate(zip(lean["states"], reference["states"], strict=True), start=1):
        assert a.keys() == b.keys()
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, f"step {step}: {unequal[:5]} differ"

