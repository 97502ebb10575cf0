"""`python -m app bench step`: the training step of one or more config variants, interleaved on one device.

    --variant NAME:key=value,key=value   (repeatable; none: the config as given, named `config`)
    per variant: the config + --set + its overrides, on one device (DP 1 x CP 1), bucket_size=auto derived
                 -> the first (warm-up + steps) global batches of the config's data (app/data/preview.py:
                    the run's own readers, template and length limit), planned by the config's policy
                    -> RankPayloads, exactly as the planner actor builds them
    workers/tools/step_bench.py runs them (the workers' engine and step, no Ray), interleaved step by step
    -> per variant: tokens/s, MFU, micro-batch / optimizer / gap seconds per step, peak memory beside the
       memory model's prediction for the largest micro-batch it ran (`peak_tokens`), the loss of every
       step; `speedup_vs_first`: the median over the counted steps of the first variant's step time over
       this one's (the same global batch in the same round).

Variants that change the length limit (bucket_size) tokenize the data at their own limit; the rows stay the
same rows. The first `warmup` steps are run and reported (`warmup_steps`) but not counted. With
`max_seconds` no build or step starts past it: each variant is summarized over the steps it counted
(`counted_steps`), `stopped_early` says why, and a variant without a counted step is an error.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.config import ConfigError, SkrullConfig, load_config

SINGLE_DEVICE = ("parallel.num_workers=1", "parallel.cp_size=1")
"""bench step measures one device: every variant runs DP 1 x CP 1 (its memory model too)."""


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


def parse_variant(text: str) -> Variant:
    """NAME:key=value,key=value (commas inside [...] belong to a list value) -> Variant."""
    name, sep, rest = text.partition(":")
    if not sep or not name or not rest:
        raise ConfigError(f"--variant {text!r}: expected NAME:key=value[,key=value...], e.g. "
                          "fused:train.optimizer_impl=fused")
    overrides, depth, current = [], 0, ""
    for char in rest:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            overrides.append(current)
            current = ""
        else:
            current += char
    overrides.append(current)
    if any("=" not in o for o in overrides):
        raise ConfigError(f"--variant {text!r}: every override is key=value")
    return Variant(name=name, overrides=tuple(o.strip() for o in overrides))


def variant_configs(config_path: str | None, sets: list[str], variants: list[Variant],
                    on_gpu: bool) -> list[tuple[str, SkrullConfig]]:
    """Each variant's config (--set, then the variant's overrides, then one device), bucket_size derived."""
    from app.profiling.budget import resolve_bucket_size

    device_set = [f"resources.gpus_per_worker={1 if on_gpu else 0}"]
    if on_gpu:
        device_set.append("model.dtype=bf16")  # the CUDA attention kernels take bf16 only (app/config.py)
    chosen = variants or [Variant(name="config", overrides=())]
    names = [v.name for v in chosen]
    if len(set(names)) != len(names):
        raise ConfigError(f"--variant names must differ, got {names}")
    configs = []
    for variant in chosen:
        overrides = [*sets, *device_set, *variant.overrides, *SINGLE_DEVICE]
        try:
            config, _ = resolve_bucket_size(load_config(config_path, overrides))
        except ConfigError as err:
            raise ConfigError(f"--variant {variant.name}: {err}") from None
        configs.append((variant.name, config))
    return configs


def step_rows(config: SkrullConfig, steps: int) -> list[list[Any]]:
    """The first `steps` global batches of usable rows in stream order (ConfigError when there are fewer)."""
    from app.bench.peer.rows import usable_rows

    size = config.scheduling.global_batch_size
    rows = usable_rows(config, steps * size)
    if len(rows) < steps * size:
        raise ConfigError(f"--steps/--warmup: {steps} steps of scheduling.global_batch_size={size} need "
                          f"{steps * size} usable rows, the data has {len(rows)} (data.num_samples for the "
                          "synthetic source); fewer steps or more rows")
    return [rows[i * size:(i + 1) * size] for i in range(steps)]


def step_payloads(config: SkrullConfig, steps: int) -> tuple[Any, ...]:
    """The first `steps` global batches of usable rows, planned by the config's policy on one device."""
    from app.profiling.hardware import cost_model
    from scheduling import plan_step
    from scheduling.payload import Cursor, Sample, build_rank_payloads

    cost, sched = cost_model(config), config.scheduling
    payloads = []
    for step, rows in enumerate(step_rows(config, steps), start=1):
        samples = [Sample(sample_id=r.index, input_ids=np.asarray(r.input_ids, dtype=np.int64),
                          labels=np.asarray(r.labels, dtype=np.int64)) for r in rows]
        lengths = [s.num_tokens for s in samples]
        labels = [s.num_label_tokens for s in samples]
        plan = plan_step(sched.policy, lengths, dp_size=1, cp_size=1, bucket_size=sched.bucket_size,
                         cost=cost, seed=sched.seed + step, static_cp_micro_batch=sched.static_cp_micro_batch,
                         labels=labels, cp_degrees=config.cp_degrees, chunkflow_keep=sched.chunkflow_keep)
        flops = float(np.sum(cost.flops(np.asarray(lengths), np.asarray(labels))))
        payload = build_rank_payloads(plan, samples, step=step, epoch=0, cursor=Cursor(epoch=0, rows=0),
                                      plan_ms=0.0, flops_at_peak_s=flops * cost.profile.train_flops_factor
                                      / cost.profile.peak_flops)[0, 0]
        payloads.append(payload)
    return tuple(payloads)


def predicted_peak_bytes(config: SkrullConfig, tokens: int | None = None) -> float:
    """The memory model's peak for one rank at the config's checkpointing setting, with the kernel set the
    variant's workers run (app/profiling/memory.py), for a micro-batch of `tokens` tokens (None: C)."""
    from app.profiling.memory import memory_terms

    terms = memory_terms(config)
    return terms.peak_bytes if tokens is None else terms.peak_at(tokens)


def largest_micro_batch(payloads: tuple[Any, ...]) -> int:
    """The most tokens one micro-batch of `payloads` holds: what a step's measured peak is compared at
    (each step's peak is its own; a C that the batches never fill would overstate the model's)."""
    from workers.metrics import micro_batch_tokens

    return max((max(micro_batch_tokens(p), default=0) for p in payloads), default=0)


def step_variant(name: str, config: SkrullConfig, payloads: tuple[Any, ...], on_gpu: bool) -> Any:
    """The workers' StepVariant of one config (the same ModelSpec and DeepSpeed JSON a run's workers get)."""
    from app.model.deepspeed_config import deepspeed_config
    from app.model.spec import model_spec
    from app.profiling.hardware import model_dims
    from workers.tools.step_bench import StepVariant

    tokenizer = config.data.tokenizer
    return StepVariant(
        name=name, model=model_spec(config.model, config.train, tokenizer=tokenizer),
        deepspeed=deepspeed_config(config.train, dtype=config.model.dtype, on_gpu=on_gpu,
                                   hidden_size=model_dims(config.model, tokenizer).hidden_size),
        overlap_comm=config.train.overlap_comm, one_rank_zero1=config.train.one_rank_zero1,
        loss_chunk_tokens=config.train.loss_chunk_tokens,
        warmup_tokens=config.scheduling.bucket_size, attention_backend=config.model.attention_backend,
        payloads=payloads)


def summarize(name: str, config: SkrullConfig, result: dict[str, Any], payloads: tuple[Any, ...],
              warmup: int) -> dict[str, Any]:
    """One variant's summary over its counted steps (warm-up steps left out); a variant that failed: its
    error and settings."""
    if "error" in result:
        return {"error": result["error"], "bucket_size": config.scheduling.bucket_size,
                "compile": config.train.compile, "kernels": config.model.kernels,
                "predicted_peak_bytes": predicted_peak_bytes(config)}
    readings = result["readings"][warmup:]
    if not readings:
        return {"error": "stopped before its first counted step",
                "bucket_size": config.scheduling.bucket_size,
                "predicted_peak_bytes": predicted_peak_bytes(config)}
    counted = payloads[warmup:warmup + len(readings)]
    largest = largest_micro_batch(payloads[:len(result["readings"])])
    seconds = sum(r.step_s for r in readings)
    tokens = sum(p.global_tokens for p in counted)
    at_peak = sum(p.flops_at_peak_s for p in counted)
    peaks = [r.peak_bytes for r in result["readings"] if r.peak_bytes is not None]
    mean = statistics.fmean
    return {
        "tokens_per_s": tokens / seconds, "mfu": at_peak / seconds,
        "step_s": mean(r.step_s for r in readings), "micro_batch_s": mean(r.micro_batch_s for r in readings),
        "optimizer_s": mean(r.optimizer_s for r in readings), "gap_s": mean(r.gap_s for r in readings),
        "micro_batches": mean(r.micro_batches for r in readings), "counted_steps": len(readings),
        "peak_bytes": max(peaks) if peaks else None,
        "predicted_peak_bytes": predicted_peak_bytes(config, largest), "peak_tokens": largest,
        "bucket_size": config.scheduling.bucket_size, "kernels": result["kernels"],
        "optimizer": result["optimizer"], "zero_stage": result["zero_stage"], "compile": config.train.compile,
        "activation_checkpointing": config.train.activation_checkpointing,
        "losses": [r.loss for r in result["readings"]], "applied": [r.applied for r in result["readings"]],
        "step_times": [r.step_s for r in result["readings"]],
        **{key: result[key] for key in ("top_ops", "device_time", "engine_phases_s")
           if result.get(key) is not None},
    }


def speedups(summaries: dict[str, dict[str, Any]], warmup: int) -> dict[str, float | None]:
    """Per variant: median over the counted steps both ran (a run stopped early may end a variant one step
    short) of (first variant's step time / its own), same batches (None where either failed)."""
    first = next(iter(summaries.values())).get("step_times")
    if first is None:
        return dict.fromkeys(summaries)
    return {name: statistics.median(a / b for a, b in zip(first[warmup:], s["step_times"][warmup:],
                                                          strict=False)) if "step_times" in s else None
            for name, s in summaries.items()}


def run_bench_step(config_path: str | None, sets: list[str], variants: list[Variant], *, steps: int,
                   warmup: int, trace_dir: str | None = None, max_seconds: float | None = None
                   ) -> dict[str, Any]:
    """The whole measurement (module docstring) -> the --json object."""
    import torch

    from workers.allocator import use_expandable_segments
    from workers.tools.step_bench import bench_steps

    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    if max_seconds is not None and max_seconds <= 0:
        raise ConfigError(f"--max-seconds must be > 0, got {max_seconds:g}")
    use_expandable_segments()  # before the first CUDA allocation, as a train worker does
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    configs = variant_configs(config_path, sets, variants, on_gpu)
    payloads = {name: step_payloads(config, warmup + steps) for name, config in configs}
    built = [step_variant(name, config, payloads[name], on_gpu) for name, config in configs]
    measured = bench_steps(built, device=device, seed=configs[0][1].train.seed, trace_dir=trace_dir,
                           max_seconds=max_seconds)
    summaries = {name: summarize(name, config, measured["variants"][name], payloads[name], warmup)
                 for name, config in configs}
    return {"device": _device_name(device), "steps": steps, "warmup_steps": warmup,
            "stopped_early": measured["stopped_early"],
            "tokens_per_step": [p.global_tokens for p in next(iter(payloads.values()))],
            "variants": summaries, "speedup_vs_first": speedups(summaries, warmup),
            "overrides": {name: list(v.overrides) for name, v in
                          zip([n for n, _ in configs], variants or [Variant("config", ())], strict=True)}}


def _device_name(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} cpu, {torch.get_num_threads()} threads"

