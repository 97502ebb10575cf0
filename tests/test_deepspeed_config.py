"""The DeepSpeed JSON of a GPU run (app/model/deepspeed_config.py): torch's fused AdamW inside ZeRO-2 under
the device step (workers/zero_step.py), no JIT-built op, no throughput timer, and bf16 gradients accumulated
in fp32 (also by DeepSpeed's BF16_Optimizer, the ZeRO-1 that one worker runs for ZeRO-2).

DeepSpeed builds the optimizer the same way on every accelerator up to the op it loads: its FusedAdam
loads `FusedAdamBuilder().load()` in its constructor (a JIT compile with nvcc on CUDA, with g++ on CPU).
So the engine is built here on CPU (gloo, one rank) from the JSON generated for a GPU run, with every op
build refused and recorded: which optimizer class a GPU worker gets, and that it needs no compiler. The
CPU accelerator's shared-memory comm op is refused too: workers/engine.py marks it off, since training
never calls it (DeepSpeed's CUDA accelerator has no such op).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from app.config import load_config
from app.model.deepspeed_config import deepspeed_config
from workers.tools.launch import run_workers

MICRO_BATCHES = 64
"""A power of two: loss / 64 is exact, so 64 fp32-accumulated copies of a micro-batch's gradient sum back
to the one-micro-batch gradient exactly, while bf16 partial sums (8 mantissa bits) round."""


def test_the_gpu_json_asks_for_torch_fused_adamw_and_fp32_accumulation() -> None:
    train = load_config(None, []).train
    gpu = deepspeed_config(train, dtype="bf16", on_gpu=True)
    assert gpu["optimizer"]["type"] == "AdamW"
    assert gpu["optimizer"]["params"]["torch_adam"] is True and gpu["optimizer"]["params"]["fused"] is True
    assert "foreach" not in gpu["optimizer"]["params"]
    assert gpu["data_types"] == {"grad_accum_dtype": "fp32"}
    assert gpu["timers"] == {"throughput": {"enabled": False}}  # its stop() synchronizes every step
    assert gpu["zero_optimization"]["overlap_comm"] is True  # the worker turns it off on one GPU
    # Nothing else that loads a DeepSpeed op: no offload (CPUAdam), no fp16, no compression or quantization.
    assert set(gpu) <= {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
                        "optimizer", "zero_optimization", "gradient_clipping", "bf16", "data_types",
                        "wall_clock_breakdown", "timers"}
    assert not any(key.startswith("offload") for key in gpu["zero_optimization"])
    cpu = deepspeed_config(train, dtype="fp32", on_gpu=False)
    assert cpu["optimizer"]["params"]["torch_adam"] is True
    assert not {"foreach", "fused"} & set(cpu["optimizer"]["params"])  # torch's default: a for-loop
    foreach = load_config(None, ["train.optimizer_impl=foreach", "train.overlap_comm=off"]).train
    gpu_foreach = deepspeed_config(foreach, dtype="bf16", on_gpu=True)
    assert gpu_foreach["optimizer"]["params"]["foreach"] is True
    assert gpu_foreach["zero_optimization"]["overlap_comm"] is False
    assert "data_types" not in cpu  # fp32 accumulates in fp32 anyway
    tuned = load_config(None, ["train.adam_betas=[0.8, 0.99]", "train.adam_eps=1e-6"]).train
    params = deepspeed_config(tuned, dtype="fp32", on_gpu=False)["optimizer"]["params"]
    assert (params["betas"], params["eps"]) == ([0.8, 0.99], 1e-6)
    stage1 = load_config(None, ["train.zero_stage=1"]).train
    assert deepspeed_config(stage1, dtype="bf16", on_gpu=True)["data_types"] == {"grad_accum_dtype": "fp32"}


def _refuse_op_builds() -> list[str]:
    """Every DeepSpeed op build from now on raises; returns the list the refused builders' names go to."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    refused: list[str] = []

    def refuse(self, *args, **kwargs):
        refused.append(type(self).__name__)
        raise RuntimeError(f"JIT-built DeepSpeed op {type(self).__name__} requested")

    OpBuilder.load = refuse
    OpBuilder.jit_load = refuse
    return refused


def _gpu_json_engines(rank: int, world: int) -> dict:
    """Engines from the GPU JSON (and from it without data_types): optimizer classes, the op builds
    requested, and the gradient after 1 and after MICRO_BATCHES micro-batches of loss / MICRO_BATCHES."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed asserts them
    refused = _refuse_op_builds()
    from deepspeed.utils import safe_get_full_grad

    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.engine import build_engine
    from workers.forward import micro_batch_loss_sum
    from workers.models import ModelSpec

    gpu = deepspeed_config(load_config(None, []).train, dtype="bf16", on_gpu=True)
    bf16_accumulation = {key: value for key, value in gpu.items() if key != "data_types"}
    spec = ModelSpec(dtype="bf16", vocab_size=128)
    ids = [list(range(3, 40)), [7, 3, 9, 4, 11]]
    batch = build_rank_batch(DacpPlan(local=((0, 1),), distributed=()), ids, ids, cp_rank=0, cp_size=1)

    def accumulate(ds_config, micro_batches: int, one_rank_zero1: bool = False) -> tuple[object, Tensor]:
        engine = build_engine(spec, ds_config, torch.device("cpu"), seed=0, one_rank_zero1=one_rank_zero1)
        for index in range(micro_batches):
            engine.set_gradient_accumulation_boundary(index == micro_batches - 1)
            loss = micro_batch_loss_sum(engine.module, batch) / batch.num_tokens
            engine.backward(loss / micro_batches, scale_wrt_gas=False)
        grad = torch.cat([safe_get_full_grad(p).float().flatten() for p in engine.module.parameters()])
        return engine, grad

    engine, one = accumulate(gpu, 1)
    basic = engine.basic_optimizer
    result = {"optimizer": f"{type(basic).__module__}.{type(basic).__qualname__}",
              "foreach": basic.defaults["foreach"], "fused": basic.defaults["fused"],
              "wrapper": type(engine.optimizer).__name__,
              "device_step": engine.optimizer.step.__func__.__name__}
    engine.step()  # torch's fused AdamW over ZeRO-2's flat fp32 partition
    steps = [state["step"] for state in basic.state.values()]
    result["stepped"] = bool(steps) and all(int(step) == 1 and step.is_cpu for step in steps)
    engine, fp32_sum = accumulate(gpu, MICRO_BATCHES)
    flat = getattr(engine.optimizer.averaged_gradients.get(0), "flat_partition", None)  # the fp32 buffer
    result["partition_dtype"] = "none" if flat is None else str(flat.dtype)
    _, bf16_sum = accumulate(bf16_accumulation, MICRO_BATCHES)
    # One worker runs ZeRO-2 as stage 1 (workers/engine.py for_world_size): DeepSpeed's BF16_Optimizer,
    # under workers/bf16_step.py's device step, accumulating in fp32 as well.
    engine, zero1_sum = accumulate(gpu, MICRO_BATCHES, one_rank_zero1=True)
    result["zero1"] = (type(engine.optimizer).__name__, engine.optimizer.step.__func__.__module__)
    return result | {"refused": refused, "one": one, "fp32_sum": fp32_sum, "bf16_sum": bf16_sum,
                     "zero1_sum": zero1_sum}


def test_the_gpu_json_builds_torch_adamw_in_zero2_without_a_jit_op_and_accumulates_in_fp32() -> None:
    (result,) = run_workers(_gpu_json_engines, 1, backend="gloo")
    assert result["refused"] == []  # before: FusedAdamBuilder (DeepSpeed's FusedAdam, JIT-built)
    assert result["optimizer"] == "torch.optim.adamw.AdamW"
    assert result["fused"] is True and not result["foreach"]
    assert result["wrapper"] == "DeepSpeedZeroOptimizer" and result["stepped"]
    assert result["device_step"] == "device_step"  # workers/zero_step.py replaced DeepSpeed's step
    # fp32 accumulation: ZeRO-2 keeps the rank's gradient partition in fp32, and 64 micro-batches of
    # loss / 64 sum to the one-micro-batch gradient (each is that gradient / 64, exactly, in bf16).
    assert result["partition_dtype"] == "torch.float32"
    one = result["one"]
    scale = one.abs().max()
    assert (result["fp32_sum"] - one).abs().max() <= 1e-6 * scale
    assert result["zero1"] == ("BF16_Optimizer", "workers.bf16_step")
    assert (result["zero1_sum"] - one).abs().max() <= 1e-6 * scale
    # The same sum accumulated in bf16 (DeepSpeed's default for a bf16 model) rounds: what fp32 avoids.
    assert (result["bf16_sum"] - one).abs().max() > 1e-3 * scale
