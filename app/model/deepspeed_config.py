"""The DeepSpeed JSON, generated from the config tree (never hand-kept beside it).

Why these settings:
- `train_micro_batch_size_per_gpu=1`, `gradient_accumulation_steps=1`: a Skrull step has a *variable*
  number of packed micro-batches, so the train loop drives the accumulation boundary itself
  (`set_gradient_accumulation_boundary` + `backward(scale_wrt_gas=False)`); DeepSpeed must not rescale.
- ZeRO-2 `overlap_comm` only on GPU: on CPU/gloo it buys nothing and costs a copy.
- The loss is already normalized by the global batch's label tokens and multiplied by the world size in the
  train loop, which cancels DeepSpeed's mean over all DP x CP ranks (CP ranks hold replicas).
- The optimizer is torch's own AdamW everywhere (`torch_adam: true`), with ZeRO around it: DeepSpeed's
  FusedAdam (GPU) and CPUAdam are C++/CUDA ops it JIT-compiles on first use, which needs nvcc and a CUDA
  toolkit matching torch that pip's torch wheels do not ship, so every worker of a GPU run would die in
  `deepspeed.initialize` on a machine without one. DeepSpeed 0.19's `get_optimizer_configuration`
  (runtime/engine.py) returns `torch.optim.AdamW` for `torch_adam` with an AdamW type, passing `fused` /
  `foreach` and every other param through. `train.optimizer_impl` picks torch's implementation: `fused`
  (the default on CUDA) is one kernel over the flat partition and takes a device-side "found inf" flag,
  which lets workers/zero_step.py run the whole optimizer step without a host synchronization; fused
  keeps its `step` counters on the parameters' device, which DeepSpeed's universal-checkpoint loader
  does not (it restores them as CPU tensors), so a resume moves them back (workers/zero_step.py
  `place_step_counters`). `foreach` keeps DeepSpeed's own step; on CPU `auto` is torch's default (a
  for-loop) under DeepSpeed's step.
- `timers.throughput` off: DeepSpeed's throughput timer synchronizes the device at every `engine.step()`
  (deepspeed/utils/timer.py ThroughputTimer.stop with its default `synchronized: true`) to time steps the
  product times itself with CUDA events (workers/laps.py).
- ZeRO `overlap_comm` follows `train.overlap_comm`: on GPUs it overlaps the gradient reduction with the
  backward on a side stream, at the price of a device synchronization at the end of every backward
  (stage_1_and_2.py `independent_gradient_partition_epilogue`); with one worker there is nothing to
  overlap, so `auto` turns it off there (the worker decides, `for_world_size`: an elastic run's size is
  known only when its workers start).
- No `scheduler` section: the learning-rate schedule (train.lr_scheduler, warmup, min_lr_ratio) is torch's
  LambdaLR over workers/lr_schedule.py, handed to `deepspeed.initialize` as the client scheduler, because
  it must follow the run's global step across resumes and skipped updates, and DeepSpeed's WarmupLR has no
  decay while its WarmupCosineLR has no linear decay and counts only applied updates.
- bf16 accumulates gradients in fp32 (`data_types.grad_accum_dtype`): a step has a variable, often large,
  number of micro-batches, and bf16's 8-bit mantissa loses the small late ones. DeepSpeed 0.19's ZeRO-2
  then keeps the rank's gradient partition in an fp32 buffer (`_use_compact_grad_partition_buffer`,
  runtime/zero/stage_1_and_2.py) instead of the bf16 `grads_in_partition` (ZeRO-1 switches to its
  BF16_Optimizer, which accumulates in fp32 too). Not with ZeRO stage 0: DeepSpeed has no fp32
  accumulation for bf16 without ZeRO (`_do_optimizer_sanity_check` raises NotImplementedError on the mix).
  ZeRO-3 takes the same setting (`DeepSpeedZeroOptimizer_Stage3(gradient_accumulation_dtype=...)`: its
  partitioned gradient buffers are fp32).
- `bf16.immediate_grad_update`: BF16_Optimizer (ZeRO-1 in bf16, what one worker runs, workers/engine.py
  for_world_size) adds each parameter's bf16 gradient to its fp32 sum as the backward produces it and frees
  it; without it every bf16 gradient stays alive from one backward to the next (2 bytes per parameter more,
  measured by tests/test_one_rank_zero1.py's ledger); the add itself runs in workers/bf16_accumulate.py's
  hook (one kernel per parameter instead of DeepSpeed's copy and add). ZeRO's own optimizers ignore the key.
- ZeRO-3 (`train.zero_stage: 3`) partitions the weights too, over the same W ranks, and gathers each
  module's weights in its forward and backward hooks. `stage3_prefetch_bucket_size` (elements gathered
  ahead of use) follows the reduce bucket (5e7 on GPU, DeepSpeed's default; 5e5 on CPU, where a gather
  is a memcpy through gloo). `stage3_param_persistence_threshold` keeps every parameter under 10 x
  hidden_size elements (the rule of transformers' DeepSpeed integration for its `auto` value: norms and
  biases, a few MB for a 70B model; DeepSpeed's default 1e5 when the hidden size is not given) gathered
  for the whole run instead of gathering it twice per micro-batch. `stage3_max_live_parameters` and
  `stage3_max_reuse_distance` are DeepSpeed's defaults (1e9 elements).
  What every rank must do alike at stage 3 (the same module forwards and backwards) is workers/step.py's.
"""

from __future__ import annotations

from app.config import TrainConfig
from workers.engine import DeepSpeedConfig

DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default `stage3_param_persistence_threshold` (deepspeed/runtime/zero/config.py)."""


def persistence_threshold(hidden_size: int) -> int:
    """ZeRO-3: parameters with fewer elements stay gathered on every rank (the memory model,
    app/profiling/memory.py, charges them whole): 10 x hidden_size, or DeepSpeed's default without one."""
    return 10 * hidden_size if hidden_size > 0 else DEEPSPEED_PERSISTENCE_THRESHOLD


def optimizer_impl(train: TrainConfig, *, on_gpu: bool) -> str:
    """train.optimizer_impl resolved: fused on CUDA under auto; on CPU auto is "default" (torch's for-loop,
    neither fused nor foreach)."""
    if train.optimizer_impl != "auto":
        return train.optimizer_impl
    return "fused" if on_gpu else "default"


def deepspeed_config(train: TrainConfig, *, dtype: str, on_gpu: bool,
                     hidden_size: int = 0) -> DeepSpeedConfig:
    """ZeRO engine settings (train.zero_stage) for the train section and the model's dtype (model.dtype);
    `hidden_size` (the model's) sets ZeRO-3's persistence threshold."""
    ds: DeepSpeedConfig = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,  # progress is ours (tqdm on the driver), not DeepSpeed's log lines
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": train.lr,
                "weight_decay": train.weight_decay,
                "betas": list(train.adam_betas),
                "eps": train.adam_eps,
                # torch's AdamW, never DeepSpeed's JIT-compiled FusedAdam / CPUAdam (module docstring).
                "torch_adam": True,
            },
        },
        "zero_optimization": {
            "stage": train.zero_stage,
            "overlap_comm": on_gpu if train.overlap_comm == "auto" else train.overlap_comm == "on",
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e7 if on_gpu else 5e5,
            "allgather_bucket_size": 5e7 if on_gpu else 5e5,
        },
        "gradient_clipping": train.grad_clip,
        "bf16": {"enabled": dtype == "bf16", "immediate_grad_update": True},
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False}},  # its stop() synchronizes the device every step
    }
    if train.zero_stage == 3:
        ds["zero_optimization"].update(stage3_prefetch_bucket_size=5e7 if on_gpu else 5e5,
                                       stage3_param_persistence_threshold=persistence_threshold(hidden_size),
                                       stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9)
    impl = optimizer_impl(train, on_gpu=on_gpu)
    if impl != "default":
        ds["optimizer"]["params"][impl] = True
    if dtype == "bf16":  # train.zero_stage is 1, 2 or 3 (app/config.py): each honours it
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds
