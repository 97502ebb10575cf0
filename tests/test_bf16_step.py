"""One bf16 ZeRO-2 step over DP 2 gloo ranks, with tied embeddings and activation recomputation, against the
fp32 single-process reference of the same weights.

deepspeedai/DeepSpeed#8224: DeepSpeed 0.18.3-0.19.3 computed wrong gradients with ZeRO-2 + bf16 on several
ranks when a module runs more than once in a step; tied input/output embeddings and recomputed decoder
layers are such uses, and both are what a long-context fine-tune of Qwen2.5 runs (pyproject.toml pins the
DeepSpeed versions without it). The distributed side is the whole step (workers/step.py run_step: planner
payloads, DACP attention, the chunked loss on the tied weight, DeepSpeed's fp32 accumulation of bf16
gradients); the reference nobody here wrote is the Hugging Face model's own forward with `labels`, per
sequence, in fp32 on the same (bf16-rounded) weights. Tolerance as `verify`'s (workers/tools/parity.py):
5e-2 relative, or 1.5x the HF model's own bf16 gradient error against that reference when larger.
Gradients are read from ZeRO's fp32 master weights around one plain SGD step of lr 2^20 (as in
tests/test_train_step.py: the update is the gradient, exactly enough at that scale).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from scheduling import plan_step
from scheduling.payload import Cursor, build_rank_payloads
from tests.test_train_step import COST, LENGTHS, LR, VOCAB, _samples
from workers.tools.parity import BF16_FLOOR_FACTOR, TOLERANCE

SEED = 3


def tied_model_dir(root: Path) -> Path:
    """A local model directory (config.json only) of a tiny Qwen2 whose LM head is its input embedding."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                use_cache=False).save_pretrained(root)
    return root


def _ds_config() -> dict:
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config

    config = deepspeed_config(load_config(None, ["train.grad_clip=0"]).train, dtype="bf16", on_gpu=False)
    del config["optimizer"]  # plain SGD: the update is the gradient
    config["zero_allow_untested_optimizer"] = True
    return config


def _worker(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """One of 2 DP ranks: rank 0 saves the initial weights and the gradient the step applied."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from workers.distributed import ParallelGroups
    from workers.engine import import_deepspeed
    from workers.models import build_model
    from workers.step import run_step

    deepspeed = import_deepspeed()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(1)
    plan = plan_step("skrull", LENGTHS, dp_size=2, cp_size=1, bucket_size=40, cost=COST)
    assert all(len(per_dp) > 1 for per_dp in plan.micro_batches)  # gradients accumulate over micro-batches
    payloads = build_rank_payloads(plan, _samples(), step=1, epoch=0, cursor=Cursor(epoch=0, rows=8),
                                   plan_ms=0.0)
    model = build_model(model_dir, random_init=True, dtype="bf16", seed=SEED, activation_checkpointing=True)
    model.train()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if rank == 0:
        torch.save(model.state_dict(), Path(out_dir, "weights.pt"))
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    params = list(engine.module.named_parameters())
    before = {n: safe_get_full_fp32_param(p).clone() for n, p in params}
    run_step(engine, payloads[groups.dp_rank, 0], groups, device=torch.device("cpu"), loss_chunk_tokens=16)
    grads = {n: (before[n] - safe_get_full_fp32_param(p)) / LR for n, p in params}  # collective
    if rank == 0:
        torch.save(grads, Path(out_dir, "grads.pt"))
    dist.barrier()


def _hf_grads(model_dir: Path, weights: dict[str, torch.Tensor],
              dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF model's own gradients of the global batch's loss (per-sequence CE sums / label tokens)."""
    from workers.models import build_model

    model = build_model(str(model_dir), random_init=True, attn_implementation="sdpa").to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    samples = _samples()
    label_tokens = sum(s.num_label_tokens for s in samples)
    total = 0.0
    for s in samples:
        out = model(input_ids=torch.as_tensor(s.input_ids)[None], labels=torch.as_tensor(s.labels)[None],
                    use_cache=False)
        total = total + out.loss.float() * s.num_label_tokens if s.num_label_tokens else total
    (total / label_tokens).backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


def _max_rel_diff(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((grads[n] - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
            for n, ref in reference.items()}


def test_a_bf16_step_with_tied_embeddings_and_recompute_matches_the_fp32_reference(tmp_path: Path) -> None:
    from workers.tools.launch import run_workers

    model_dir = tied_model_dir(tmp_path / "tied")
    run_workers(_worker, 2, args=(str(model_dir), str(tmp_path)), backend="gloo")
    weights = torch.load(tmp_path / "weights.pt")
    reference = _hf_grads(model_dir, weights, torch.float32)
    floor = max(_max_rel_diff(_hf_grads(model_dir, weights, torch.bfloat16), reference).values())
    tolerance = max(TOLERANCE["bf16"], BF16_FLOOR_FACTOR * floor)
    ours = torch.load(tmp_path / "grads.pt")
    assert set(ours) == set(reference)  # one tied embedding weight, no separate LM head
    diffs = _max_rel_diff(ours, reference)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= tolerance, (f"{worst}: {diffs[worst]:.3g} off the fp32 reference (tolerance "
                                       f"{tolerance:.3g}; the HF model's own bf16: {floor:.3g})")
