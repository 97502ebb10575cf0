"""ZeRO-3: one step over DP 2 x CP 2 gloo ranks equals the single-process step over the same global batch.

The check of tests/test_train_step.py (same samples, same reference nobody here wrote: the Hugging Face
model's own forward with `labels` per sequence, autograd; plain SGD with lr 2^20, so the parameter change
read back is the gradient; fp32, same tolerance), with `train.zero_stage: 3` in the generated DeepSpeed
JSON: every weight is partitioned over the 4 ranks (the persistence threshold of a hidden size of 64 keeps
only norms and biases whole) and gathered by DeepSpeed's module hooks, the LM head's for the chunked loss
too (workers/loss.py LossHead). Each rank runs its own sequence lengths; ZeRO-3 needs the same module
forwards and backwards on every rank, which the plans' equal micro-batch counts and the idle micro-batch
give (workers/step.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from scheduling import DacpPlan, StepPlan, plan_step
from scheduling.payload import Cursor, build_rank_payloads
from tests.test_train_step import COST, LENGTHS, LR, MODEL, _reference_grads, _samples

# DP rank 0's first micro-batch has nothing for CP rank 1 (an idle micro-batch on it); its second shards
# sequence 3 over both CP ranks. DP rank 1 holds the other four, one micro-batch all sharded.
IDLE_PLAN = StepPlan(micro_batches=(
    (DacpPlan(local=((0, 1, 2), ()), distributed=()), DacpPlan(local=((), (4,)), distributed=(3,))),
    (DacpPlan(local=((5,), (6,)), distributed=()), DacpPlan(local=((), ()), distributed=(7,))),
))
CASES = {"skrull": None, "balanced_packed": None, "idle_cp_rank": IDLE_PLAN}


def _ds_config() -> dict:
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config

    train = load_config(None, ["train.grad_clip=0", "train.zero_stage=3"]).train
    config = deepspeed_config(train, dtype="fp32", on_gpu=False, hidden_size=64)
    del config["optimizer"]  # plain SGD below, so that the update is the gradient
    config["zero_allow_untested_optimizer"] = True
    return config


def held_elements(params: list[torch.nn.Parameter]) -> int:
    """Weight elements a ZeRO-3 rank holds between steps: its partition of every parameter (ds_tensor)
    and the whole of every parameter left gathered (the persistent ones; a released one has 0)."""
    return sum(p.ds_tensor.numel() + p.numel() for p in params)


def _worker(rank: int, world: int, out_dir: str) -> dict[str, float]:
    """One of 4 ranks (DP 2 x CP 2); returns the eval loss before each step and the weight elements this
    rank held after it."""
    import torch.distributed as dist

    from workers.distributed import ParallelGroups
    from workers.engine import import_deepspeed, prepare_for_zero
    from workers.eval_step import eval_loss_sum
    from workers.models import build_model
    from workers.step import run_step

    deepspeed = import_deepspeed()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    samples = _samples()
    measured: dict[str, float] = {}
    for name, plan in CASES.items():
        groups = ParallelGroups.create(2)
        plan = plan or plan_step(name, LENGTHS, dp_size=2, cp_size=2, bucket_size=40, cost=COST)
        payloads = build_rank_payloads(plan, samples, step=1, epoch=0, cursor=Cursor(epoch=0, rows=8),
                                       plan_ms=0.0)
        model = build_model(**MODEL)
        model.train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = _ds_config()
        prepare_for_zero(model, config)
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        payload = payloads[groups.dp_rank, groups.cp_rank]
        # the eval pass first (forward only, the initial weights): the loss of the global batch
        loss = eval_loss_sum(engine, (payload,), groups, device=torch.device("cpu"), loss_chunk_tokens=16)
        dist.all_reduce(loss)
        measured[f"{name}_eval_loss"] = float(loss) / payload.global_label_tokens
        run_step(engine, payload, groups, device=torch.device("cpu"), loss_chunk_tokens=16)
        params = list(engine.module.named_parameters())
        measured[f"{name}_held"] = held_elements([p for _, p in params])
        with deepspeed.zero.GatheredParameters([p for _, p in params]):  # collective
            if rank == 0:
                grads = {n: (before[n] - p.detach()) / LR for n, p in params}
                torch.save(grads, Path(out_dir, f"{name}.pt"))
        dist.barrier()
    return measured


@pytest.fixture(scope="module")
def zero3_grads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, float]]]:
    from workers.tools.launch import run_workers

    out_dir = tmp_path_factory.mktemp("zero3")
    return out_dir, run_workers(_worker, 4, args=(str(out_dir),), backend="gloo")


@pytest.mark.parametrize("case", list(CASES))
def test_one_zero3_step_equals_the_single_process_step(zero3_grads, case: str) -> None:
    out_dir, measured = zero3_grads
    reference = _reference_grads()
    ours = torch.load(out_dir / f"{case}.pt")
    assert set(ours) == set(reference)
    for name, ref in reference.items():
        scale = ref.abs().max().item() + 1e-12  # tolerance: tests/test_train_step.py's, same reasoning
        diff = (ours[name] - ref).abs().max().item()
        assert diff <= 1e-5 * scale + 1e-9, f"{case}: {name} differs by {diff:.3g} (scale {scale:.3g})"
    # Partitioned: between steps a rank holds 1/W of every weight (rounded up) and, whole, only the weights
    # under DeepSpeed's persistence threshold (10 x hidden = 640 elements here: norms and biases).
    from app.model.deepspeed_config import persistence_threshold

    sizes = [t.numel() for t in reference.values()]
    bound = sum(-(-n // 4) for n in sizes) + sum(n for n in sizes if n < persistence_threshold(64))
    held = [rank[f"{case}_held"] for rank in measured]
    assert all(n <= bound for n in held) and max(held) < sum(sizes) / 3, (held, bound, sum(sizes))
    # the eval loss at ZeRO-3 (workers/eval_step.py, forward only) is the HF model's loss of the batch
    assert measured[0][f"{case}_eval_loss"] == pytest.approx(_reference_loss(), rel=1e-5)


def _reference_loss() -> float:
    """The HF model's own loss of the global batch (CE sum / label tokens), with the initial weights."""
    from workers.models import build_model

    model = build_model(**MODEL, attn_implementation="sdpa")
    samples = [s for s in _samples() if s.num_label_tokens]
    total = 0.0
    for s in samples:
        out = model(input_ids=torch.as_tensor(s.input_ids)[None], labels=torch.as_tensor(s.labels)[None],
                    use_cache=False)
        total += float(out.loss) * s.num_label_tokens
    return total / sum(s.num_label_tokens for s in samples)


def _fp32_state(engine) -> dict[str, torch.Tensor]:
    """Every trained weight's fp32 master and Adam's exp_avg, gathered (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            state[name] = safe_get_full_fp32_param(p).clone()
            state[f"{name}.exp_avg"] = safe_get_full_optimizer_state(p, "exp_avg").clone()
    return state


def _checkpoint_worker(rank: int, world: int, directory: str, universal: bool) -> dict[int, dict]:
    """W ranks: per LoRA rank r in LORA_RANKS, a ZeRO-3 engine (tiny-qwen2, AdamW, LoRA adapters when
    r > 0) saved after one step into <directory>/r<r> as the train loop saves it, or loaded from there
    as the train loop resumes (universal: on another world size)."""
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config
    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.engine import build_engine
    from workers.models import ModelSpec
    from workers.step import engine_loss_sum

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    ds = deepspeed_config(load_config(None, ["train.lr=0.01", "train.zero_stage=3"]).train, dtype="fp32",
                          on_gpu=False, hidden_size=64)
    if universal:
        ds = {**ds, "checkpoint": {"load_universal": True}}
    ids = [list(range(1 + rank, 40)), [7, 3, 9, 4 + rank]]
    batch = build_rank_batch(DacpPlan(local=((0, 1),), distributed=()), ids, ids, cp_rank=0, cp_size=1)
    states = {}
    for lora_r in LORA_RANKS:
        spec, path = ModelSpec(vocab_size=128, lora_r=lora_r), Path(directory, f"r{lora_r}")
        engine = build_engine(spec, ds, torch.device("cpu"), seed=0)
        if (path / "step1").exists():
            engine.load_checkpoint(str(path), tag="step1_universal" if universal else "step1",
                                   load_module_strict=not spec.frozen_base)
        else:
            engine.backward(engine_loss_sum(engine, batch, runtime=None, loss_chunk_tokens=16))
            engine.step()
            engine.save_checkpoint(str(path), tag="step1", exclude_frozen_parameters=spec.frozen_base)
        states[lora_r] = _fp32_state(engine)
    return states


LORA_RANKS = (0, 4)
"""A full fine-tune and a LoRA one (only the adapters train, and only they are checkpointed)."""


def test_a_zero3_checkpoint_resumes_on_any_world_size_and_exports_exactly(tmp_path: Path) -> None:
    """The train loop's save, its resume on another world size through DeepSpeed's universal conversion
    (workers/tools/ds_to_universal.py) and the export's consolidation (app/model/export.py), on ZeRO-3
    checkpoints of 2 ranks, full and LoRA: each gives back the saved fp32 weights and Adam state bit for
    bit. (A resume on the same world size: tests/test_resilience.py's ZeRO-3 run.)"""
    import subprocess
    import sys

    from app.model.export import consolidate
    from workers.tools.launch import run_workers

    saved = run_workers(_checkpoint_worker, 2, args=(str(tmp_path), False), backend="gloo")[0]
    converters = [subprocess.Popen([sys.executable, "-m", "workers.tools.ds_to_universal", "--input_folder",
                                    str(tmp_path / f"r{r}" / "step1"), "--output_folder",
                                    str(tmp_path / f"r{r}" / "step1_universal"), "--num_extract_workers", "1",
                                    "--num_merge_workers", "1", "--inject_missing_state"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in LORA_RANKS]
    assert all(converter.wait() == 0 for converter in converters)
    one_rank = run_workers(_checkpoint_worker, 1, args=(str(tmp_path), True), backend="gloo")[0]
    for lora_r in LORA_RANKS:
        assert set(one_rank[lora_r]) == set(saved[lora_r])
        assert all(torch.equal(one_rank[lora_r][k], v) for k, v in saved[lora_r].items()), lora_r
        exported = consolidate(tmp_path / f"r{lora_r}", "step1", frozen_base=bool(lora_r))
        weights = {k: v for k, v in saved[lora_r].items() if not k.endswith(".exp_avg")}
        assert set(exported) == set(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)
        assert (lora_r > 0) == all(".lora_" in k for k in exported)
