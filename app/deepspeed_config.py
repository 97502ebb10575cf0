"""The DeepSpeed JSON, generated from the config tree (never hand-kept beside it).

Why these settings:
- `train_micro_batch_size_per_gpu=1`, `gradient_accumulation_steps=1`: a Skrull step has a *variable*
  number of packed micro-batches, so the train loop drives the accumulation boundary itself
  (`set_gradient_accumulation_boundary` + `backward(scale_wrt_gas=False)`); DeepSpeed must not rescale.
- ZeRO-2 `overlap_comm` only on GPU: on CPU/gloo it buys nothing and costs a copy.
- The loss is already normalized by the global batch's label tokens and multiplied by the world size in the
  train loop, which cancels DeepSpeed's mean over all DP x CP ranks (CP ranks hold replicas).
"""

from __future__ import annotations

from app.config import TrainConfig
from workers.engine import DeepSpeedConfig


def deepspeed_config(train: TrainConfig, *, dtype: str, on_gpu: bool) -> DeepSpeedConfig:
    """ZeRO-2 engine settings for the train section and the model's dtype (model.dtype)."""
    ds: DeepSpeedConfig = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,  # progress is ours (tqdm on the driver), not DeepSpeed's log lines
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": train.lr,
                "weight_decay": train.weight_decay,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                # DeepSpeed's fused CPU Adam is a C++ op compiled on first use (minutes); torch's is exact.
                "torch_adam": not on_gpu,
            },
        },
        "zero_optimization": {
            "stage": train.zero_stage,
            "overlap_comm": on_gpu,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e7 if on_gpu else 5e5,
            "allgather_bucket_size": 5e7 if on_gpu else 5e5,
        },
        "gradient_clipping": train.grad_clip,
        "bf16": {"enabled": dtype == "bf16"},
        "wall_clock_breakdown": False,
    }
    if train.warmup_steps:
        ds["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": train.lr,
                       "warmup_num_steps": train.warmup_steps, "warmup_type": "linear"},
        }
    return ds
