"""train.optimizer_impl=fused resumes on another world size through a universal checkpoint.

torch's fused AdamW keeps its `step` counters as fp32 tensors on the parameters' device; DeepSpeed's
universal-checkpoint loader puts back whatever ds_to_universal saved (workers/zero_step.py
`place_step_counters` moves them where fused needs them, after every load). Here, on CPU (gloo): two ranks
train step 1 with fused AdamW under the device step, save a DeepSpeed checkpoint and go on to step 2; the
checkpoint is converted to universal (workers/checkpoints.py, DeepSpeed's converter) and one rank loads it
into a fused engine and trains the same step 2. Its loss and gradient norm must equal the uninterrupted
run's (fp32, 1e-5 relative: the same global batch, split over 1 instead of 2 ranks), and its Adam step
counter must read 2 afterwards (1 restored + 1). On CPU the counters come back as CPU fp32 tensors beside
CPU parameters, which is what fused wants there: this run proves the fused path end to end, and the
second test moves counters restored on another device than their parameters (a GPU run's case). The one
rank runs ZeRO-1 (workers/engine.py for_world_size). In bf16 one worker's ZeRO-1 is DeepSpeed's
BF16_Optimizer, whose checkpoints differ from ZeRO-2's: the bf16 tests export one and resume it on two
workers, and resume a one-worker ZeRO-2 checkpoint (the code before) on one worker at ZeRO-1.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from scheduling import CostModel, plan_step
from scheduling.payload import IGNORE_INDEX, Cursor, Sample, build_rank_payloads

VOCAB = 96
SPEC = {"name_or_path": "tiny-qwen2", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "seed": 1}
LENGTHS = ([12, 30, 7, 20], [25, 9, 16, 11])


def _payloads(step: int, dp_size: int) -> dict:
    rng = np.random.default_rng(step)
    samples = []
    for i, n in enumerate(LENGTHS[step - 1]):
        ids = rng.integers(1, VOCAB, size=n)
        labels = ids.copy()
        labels[: n // 4] = IGNORE_INDEX
        samples.append(Sample(sample_id=i, input_ids=ids, labels=labels))
    cost = CostModel.from_model_dims(hidden_size=32, kv_hidden_size=16, num_layers=2)
    plan = plan_step("skrull", LENGTHS[step - 1], dp_size=dp_size, cp_size=1, bucket_size=64, cost=cost)
    return build_rank_payloads(plan, samples, step=step, epoch=0, cursor=Cursor(epoch=0, rows=4 * step),
                               plan_ms=0.0)


def _ds(dtype: str) -> dict:
    from app.config import load_config
    from app.model.deepspeed_config import deepspeed_config

    return deepspeed_config(load_config(None, ["train.optimizer_impl=fused", "train.lr=0.01"]).train,
                            dtype=dtype, on_gpu=False)


def _engine(ds_extra: dict | None = None, dtype: str = "fp32", one_rank_zero1: bool = True):
    from workers.engine import build_engine
    from workers.models import ModelSpec

    ds = {**_ds(dtype), **(ds_extra or {})}
    return build_engine(ModelSpec(**SPEC, dtype=dtype), ds, torch.device("cpu"), seed=0,
                        one_rank_zero1=one_rank_zero1)


def _step(engine, payloads: dict, groups) -> tuple[float, float]:
    import torch.distributed as dist

    from workers.step import run_step

    payload = payloads[groups.dp_rank, 0]
    stats = run_step(engine, payload, groups, device=torch.device("cpu"), loss_chunk_tokens=16)
    loss = stats.loss_sum.clone().float()
    dist.all_reduce(loss)
    return float(loss) / payload.global_label_tokens, float(engine.get_global_grad_norm())


def _train_and_save(rank: int, world: int, out: str) -> tuple[float, float]:
    from workers.distributed import ParallelGroups

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(1)
    engine = _engine()
    _step(engine, _payloads(1, world), groups)
    engine.save_checkpoint(out, tag="step1")
    return _step(engine, _payloads(2, world), groups)


def _train_bf16_one_worker_and_save(rank: int, world: int, out: str) -> dict:
    """One worker in bf16: ZeRO-2 runs as stage 1, DeepSpeed's BF16_Optimizer under the device step
    (workers/engine.py for_world_size, workers/bf16_step.py). Step 1, a checkpoint as the train loop writes
    it (skrull_state.json beside the DeepSpeed tag), then step 2."""
    from deepspeed.utils import safe_get_full_fp32_param

    from workers.checkpoints import CheckpointState
    from workers.distributed import ParallelGroups

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(1)
    engine = _engine(dtype="bf16")
    _step(engine, _payloads(1, world), groups)
    engine.save_checkpoint(out, tag="step1")
    CheckpointState(step=1, epoch=0, rows=4, tag="step1", world_size=1, dp_size=1, cp_size=1,
                    zero_stage=engine.zero_optimization_stage()).write(out)
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    loss, norm = _step(engine, _payloads(2, world), groups)
    return {"optimizer": type(engine.optimizer).__name__, "device_step": hasattr(engine.optimizer,
            "skrull_applied"), "masters": masters, "loss": loss, "norm": norm}


def _resume_bf16(rank: int, world: int, universal: str) -> tuple[float, float, str]:
    from workers.distributed import ParallelGroups
    from workers.zero_step import place_step_counters

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(1)
    engine = _engine({"checkpoint": {"load_universal": True}}, dtype="bf16")
    engine.load_checkpoint(universal, tag="step1_universal")
    place_step_counters(engine)
    return (*_step(engine, _payloads(2, world), groups), type(engine.optimizer).__name__)


def test_a_one_worker_bf16_checkpoint_exports_and_resumes_on_two_workers(tmp_path: Path) -> None:
    """A one-worker bf16 run's checkpoint is DeepSpeed's BF16_Optimizer's (ZeRO-1), which zero_to_fp32
    refuses: `export` reads it through the universal converter (workers/checkpoint_weights.py) and gets the
    fp32 master weights exactly; two workers (ZeRO-2) resume it through the universal checkpoint and train
    step 2 as the one worker did: loss within 2e-5, gradient norm within 5e-4 relative (measured 7e-8 and
    5e-5; ZeRO-2 and BF16_Optimizer round bf16 gradients into their fp32 sums differently,
    tests/test_one_rank_zero1.py)."""
    from app.model.export import consolidate
    from workers.checkpoint_weights import zero_to_fp32_reads
    from workers.checkpoints import CheckpointState, converting_to_universal
    from workers.tools.launch import run_workers

    saved = tmp_path / "ckpt"
    (one,) = run_workers(_train_bf16_one_worker_and_save, 1, args=(str(saved),), backend="gloo")
    assert one["optimizer"] == "BF16_Optimizer" and one["device_step"]
    assert not zero_to_fp32_reads(saved, "step1")
    exported = consolidate(saved, "step1", frozen_base=False)
    assert exported.keys() == one["masters"].keys()
    assert all(torch.equal(exported[n], one["masters"][n]) for n in exported)
    with converting_to_universal(saved, CheckpointState.read(saved), tmp_path / "universal"):
        pass
    resumed = run_workers(_resume_bf16, 2, args=(str(tmp_path / "universal"),), backend="gloo")
    loss, norm, optimizer = resumed[0]
    assert optimizer == "DeepSpeedZeroOptimizer"
    assert abs(loss - one["loss"]) <= 2e-5 * one["loss"] and abs(norm - one["norm"]) <= 5e-4 * one["norm"]


def _resume_a_zero2_checkpoint_on_one_worker(rank: int, world: int, out: str) -> dict:
    """A one-worker bf16 ZeRO-2 checkpoint as the code before train.one_rank_zero1 wrote it (no zero_stage
    in skrull_state.json), resumed by the train loop's own loader on one worker, which now runs ZeRO-1."""
    from ray.train import Checkpoint

    from workers.checkpoints import CheckpointState
    from workers.distributed import ParallelGroups
    from workers.models import ModelSpec
    from workers.train_loop import WorkerSettings, _loaded_engine

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(1)
    engine = _engine(dtype="bf16", one_rank_zero1=False)
    _step(engine, _payloads(1, world), groups)
    engine.save_checkpoint(out, tag="step1")
    CheckpointState(step=1, epoch=0, rows=4, tag="step1", world_size=1, dp_size=1, cp_size=1).write(out)
    expected = _step(engine, _payloads(2, world), groups)
    settings = WorkerSettings(model=ModelSpec(**SPEC, dtype="bf16"), deepspeed=_ds("bf16"), cp_size=1,
                              total_steps=2, loss_chunk_tokens=16, checkpoint_every=0, log_every=1,
                              run_dir="", planner=None)
    resumed = _loaded_engine(settings, torch.device("cpu"), groups, Checkpoint.from_directory(out),
                             CheckpointState.read(out), local_rank=0)
    return {"optimizers": (type(engine.optimizer).__name__, type(resumed.optimizer).__name__),
            "expected": expected, "resumed": _step(resumed, _payloads(2, world), groups)}


def test_a_zero2_checkpoint_of_one_worker_resumes_on_one_worker_at_zero1(tmp_path: Path) -> None:
    """The upgrade case: same world size, another ZeRO stage (in bf16 another file layout), so the loader
    goes through the universal converter; step 2 trains as the uninterrupted ZeRO-2 run did (loss within
    2e-5, gradient norm within 5e-4 relative, as tests/test_one_rank_zero1.py)."""
    from workers.tools.launch import run_workers

    (result,) = run_workers(_resume_a_zero2_checkpoint_on_one_worker, 1, args=(str(tmp_path / "ckpt"),),
                            backend="gloo")
    assert result["optimizers"] == ("DeepSpeedZeroOptimizer", "BF16_Optimizer")
    (loss, norm), (got_loss, got_norm) = result["expected"], result["resumed"]
    assert abs(got_loss - loss) <= 2e-5 * loss and abs(got_norm - norm) <= 5e-4 * norm


def _resume(rank: int, world: int, universal: str) -> dict:
    from workers.distributed import ParallelGroups
    from workers.zero_step import place_step_counters

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    groups = ParallelGroups.create(1)
    engine = _engine({"checkpoint": {"load_universal": True}})
    engine.load_checkpoint(universal, tag="step1_universal")
    place_step_counters(engine)
    loss, norm = _step(engine, _payloads(2, world), groups)
    steps = [state["step"] for state in engine.optimizer.optimizer.state.values()]
    return {"loss": loss, "norm": norm, "steps": [float(s) for s in steps],
            "step_types": sorted({f"{s.dtype}@{s.device}" if torch.is_tensor(s) else type(s).__name__
                                  for s in steps})}


def test_a_fused_run_resumes_on_another_world_size_from_a_universal_checkpoint(tmp_path: Path) -> None:
    from workers.checkpoints import CheckpointState, converting_to_universal
    from workers.tools.launch import run_workers

    saved = tmp_path / "ckpt"
    (uninterrupted, _) = run_workers(_train_and_save, 2, args=(str(saved),), backend="gloo")
    state = CheckpointState(step=1, epoch=0, rows=4, tag="step1", world_size=2, dp_size=2, cp_size=1)
    with converting_to_universal(saved, state, tmp_path / "universal"):
        pass
    (resumed,) = run_workers(_resume, 1, args=(str(tmp_path / "universal"),), backend="gloo")
    loss, norm = uninterrupted
    assert abs(resumed["loss"] - loss) <= 1e-5 * abs(loss) and abs(resumed["norm"] - norm) <= 1e-5 * norm
    assert resumed["steps"] and set(resumed["steps"]) == {2.0}, resumed["steps"]
    assert resumed["step_types"] == ["torch.float32@cpu"]


def test_step_counters_move_to_their_parameters_device() -> None:
    """place_step_counters on a stand-in for a GPU run: parameters on another device (meta) than the
    restored counters (a CPU float64 tensor and a plain number, as checkpoints hold them); only fused
    groups' counters move."""
    from types import SimpleNamespace

    from workers.zero_step import place_step_counters

    params = [torch.nn.Parameter(torch.empty(4, device="meta")) for _ in range(3)]
    fused = torch.optim.AdamW(params[:2], lr=0.1)
    fused.param_groups[0]["fused"] = True  # torch refuses fused=True on meta at construction
    fused.add_param_group({"params": [params[2]], "fused": False})
    fused.state[params[0]]["step"] = torch.tensor(3.0, dtype=torch.float64)
    fused.state[params[1]]["step"] = 3
    fused.state[params[2]]["step"] = torch.tensor(3.0)
    place_step_counters(SimpleNamespace(optimizer=SimpleNamespace(optimizer=fused)))
    moved = [fused.state[p]["step"] for p in params[:2]]
    assert all(s.device.type == "meta" and s.dtype == torch.float32 for s in moved)
    assert fused.state[params[2]]["step"].device.type == "cpu"  # not a fused group: left as it is
