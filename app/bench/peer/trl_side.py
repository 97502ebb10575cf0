"""One TRL SFTTrainer run on the bench model and the run's own global batches, timed per optimizer step.

    python -m app.bench.peer.trl_side --config configs/bench/cpu-lmsys.yaml --steps 4 --micro-batch 8 \
        --out r.json
        [--set key=value ...]         -> r.json: per step (warm-up first) step_s, cpu_s, loss, grad_norm,
                                         tokens, sample_ids; threads, versions, the attention TRL ran with

The set-up, side by side with `bench train` (docs/benchmarks.md, "Against TRL's SFTTrainer"):
- model: workers/models.py's build of the config's model (preset dims, vocabulary sized by data.tokenizer,
  seed train.seed), as every worker's engine builds it, but with transformers' "sdpa" attention instead of
  the DACP one: the same initial weights.
- data: app/bench/peer/rows.py's global batches, pre-tokenized as input_ids + assistant_masks
  (labels != -100). TRL builds labels = input_ids where the mask is 1 (its own dataset preparation), which
  are the run's labels: both sides train the same targets.
- padding_free=True without dataset packing: TRL's collator concatenates a micro-batch's sequences into one
  row whose position_ids restart at 0 per sequence (and sets the label of every sequence's first token to
  -100, so no sequence predicts into the next); transformers derives a block-causal mask from those
  position_ids. TRL's dataset-level BFD packing (packing=True) is not used: it fills bins across the whole
  dataset, so an optimizer step would no longer hold the same sequences as the other side's step.
  max_length is None because TRL refuses it with padding-free training without packing; the rows are
  already cut to data.max_length by the run's tokenization (data.too_long=truncate), which is what that
  refusal asks for.
- per_device_train_batch_size = micro_batch, gradient_accumulation_steps = global_batch_size / micro_batch,
  sequential sampler: optimizer step n trains global batch n. The loss is normalized by the label tokens of
  the whole accumulated step (transformers' num_items_in_batch), the same sum(CE) / G as this project's.
- torch AdamW with train.lr, adam_betas, adam_eps, weight_decay and grad_clip at a constant learning rate
  (bench train's engines have no schedule either), fp32, one process, torch threads = the machine's cores.

Timing: a callback stamps every optimizer step's end; step n's time runs from step n-1's end to step n's
(collating its micro-batches, forward, backward, clipping, the optimizer, the previous step's logging), as
bench train's step_s counts the planner wait and the step's compute. cpu_s is the process's CPU time over
the same span (all its threads).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from app.bench.peer.rows import StepBatch, side_config, step_batches
from app.config import ConfigError, SkrullConfig
from scheduling.payload import IGNORE_INDEX

ATTENTION = "sdpa"
"""transformers' attention for the TRL model on CPU (no flash kernel runs there)."""


def trl_attention(device: str) -> str:
    """The best attention transformers gives TRL on `device`: flash_attention_2 when flash-attn imports,
    else flash_attention_4 when flash-attn-4 does, else sdpa (PyTorch's own, flash-backed on CUDA)."""
    if device != "cuda":
        return ATTENTION
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_4_available

    if is_flash_attn_2_available():
        return "flash_attention_2"
    try:
        fa4 = is_flash_attn_4_available(kernels_fallback_ok=False)
    except TypeError:  # transformers without the keyword
        fa4 = is_flash_attn_4_available()
    return "flash_attention_4" if fa4 else ATTENTION


def liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def check_micro_batch(micro_batch: int, global_batch_size: int) -> None:
    """The micro-batch must split the global batch evenly (ConfigError naming --trl-micro-batch)."""
    if micro_batch < 1 or global_batch_size % micro_batch:
        raise ConfigError(f"--trl-micro-batch={micro_batch}: must be >= 1 and divide "
                          f"scheduling.global_batch_size={global_batch_size} (one optimizer step = one "
                          "global batch)")


def trl_columns(batches: list[StepBatch]) -> dict[str, list[list[int]]]:
    """The rows of every step, in order, as TRL's pre-tokenized columns: input_ids and assistant_masks."""
    rows = [row for batch in batches for row in batch.rows]
    return {"input_ids": [list(row.input_ids) for row in rows],
            "assistant_masks": [[int(label != IGNORE_INDEX) for label in row.labels] for row in rows]}


def trl_args(config: SkrullConfig, steps: int, micro_batch: int, out_dir: Path, device: str = "cpu") -> Any:
    """SFTConfig of the TRL side (module docstring); on CUDA in bf16, with Liger when it is installed."""
    from trl import SFTConfig

    size, train = config.scheduling.global_batch_size, config.train
    check_micro_batch(micro_batch, size)
    return SFTConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=size // micro_batch, train_sampling_strategy="sequential",
        padding_free=True, packing=False, max_length=None, shuffle_dataset=False,
        learning_rate=train.lr, lr_scheduler_type="constant", optim="adamw_torch",
        adam_beta1=train.adam_betas[0], adam_beta2=train.adam_betas[1], adam_epsilon=train.adam_eps,
        weight_decay=train.weight_decay, max_grad_norm=train.grad_clip,
        bf16=device == "cuda", fp16=False, use_cpu=device != "cuda",
        use_liger_kernel=device == "cuda" and liger_installed(),
        seed=train.seed, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=False,
        **{_checkpointing_field(SFTConfig): train.activation_checkpointing},
    )


def _checkpointing_field(args_class: type) -> str:
    """TrainingArguments' checkpointing switch: `activation_checkpointing` in newer transformers,
    `gradient_checkpointing` before (5.17 and older)."""
    import dataclasses

    names = {field.name for field in dataclasses.fields(args_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def build_trainer(config: SkrullConfig, batches: list[StepBatch], micro_batch: int, out_dir: Path,
                  callbacks: tuple[Any, ...] = (), device: str = "cpu") -> Any:
    """SFTTrainer over `batches` with the run's model (same weights as the workers') and tokenizer."""
    from datasets import Dataset
    from trl import SFTTrainer

    from app.model.export_tokenizer import hf_tokenizer
    from app.model.spec import model_spec

    args = trl_args(config, len(batches), micro_batch, out_dir, device)
    spec = model_spec(config.model, config.train, tokenizer=config.data.tokenizer)
    model = spec.build(attn_implementation=trl_attention(device))
    model.train()
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict(trl_columns(batches)),
                      # pre-tokenized rows: TRL needs the tokenizer for its pad token only, no chat template
                      processing_class=hf_tokenizer(config.data.tokenizer, None),
                      callbacks=list(callbacks))


def step_clock() -> Any:
    """A TrainerCallback recording each optimizer step's end (wall and process CPU time, every thread) and
    its logged loss, grad norm and tokens."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.began = (0.0, 0.0)
            self.ends: list[tuple[float, float]] = []
            self.logs: dict[int, dict[str, float]] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.began = (time.perf_counter(), time.process_time())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the step's end on the device, not its last launch
            self.ends.append((time.perf_counter(), time.process_time()))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.logs[state.global_step] = {k: float(v) for k, v in logs.items()
                                                if isinstance(v, int | float)}

    return StepClock()


def run_trl(config: SkrullConfig, steps: int, micro_batch: int, out_dir: Path,
            device: str = "cpu") -> dict[str, Any]:
    """Train `bench train`'s uncounted global batches + `steps` with TRL on `device` (step_batches); every
    step's time, loss, batch."""
    import torch
    import transformers
    import trl

    started = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)
    batches = step_batches(config, steps)
    clock = step_clock()
    trainer = build_trainer(config, batches, micro_batch, out_dir, callbacks=(clock,), device=device)
    trainer.train()
    if len(clock.ends) != len(batches):
        raise RuntimeError(f"TRL ran {len(clock.ends)} optimizer steps of {len(batches)}")
    previous = [clock.began, *clock.ends[:-1]]
    seen = [clock.logs[b.step].get("num_tokens", float("nan")) for b in batches]
    return {
        "side": "trl", "trl": trl.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "processes": 1, "micro_batch": micro_batch,
        "gradient_accumulation_steps": config.scheduling.global_batch_size // micro_batch,
        "attention": trainer.model.config._attn_implementation, "padding_free": trainer.padding_free,
        "device": device, "dtype": str(next(trainer.model.parameters()).dtype).replace("torch.", ""),
        "liger": bool(trainer.args.use_liger_kernel),
        "wall_s": time.perf_counter() - started,
        "per_step": [{
            "step": b.step, "warmup": b.warmup, "step_s": end[0] - before[0],
            "cpu_s": end[1] - before[1],
            "loss": clock.logs[b.step]["loss"], "grad_norm": clock.logs[b.step].get("grad_norm"),
            "tokens": b.tokens, "trl_tokens": seen[i] - (seen[i - 1] if i else 0.0),
            "sample_ids": b.sample_ids,
        } for i, (b, end, before) in enumerate(zip(batches, clock.ends, previous, strict=True))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench.peer.trl_side", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, required=True, help="counted steps, after the warm-up")
    parser.add_argument("--micro-batch", type=int, required=True, help="sequences per micro-batch")
    parser.add_argument("--out", required=True, help="write the JSON result here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    config = side_config(args.config, args.overrides)
    out = Path(args.out)
    result = run_trl(config, args.steps, args.micro_batch, out.parent / f"{out.stem}-trainer", args.device)
    out.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
