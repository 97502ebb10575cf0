"""`python -m app profile`: measure this machine with the configured model and write a hardware profile.

Runs workers/tools/profile_run.py in a Ray Train worker group of parallel.num_workers workers (the minimum
of an elastic range) started as `train` starts its own (same resources per worker, gloo on CPU, NCCL on
CUDA, Ray joined or embedded the same way), with the config's model, dtype and attention backend, then
fits every term of the cost model (scheduling/cost.py) to what was measured:

    compute     T(F) = F * train_flops_factor / (peak_flops * mfu) + b(W), F the scheduling.cost_formula
                FLOPs of each case (label tokens included), timed through the DeepSpeed engine as a
                training micro-batch -> mfu, micro_batch_launch_s = b(W) - the measured reduction
    ring        t(bytes) = max(latency, offset + bytes / bandwidth) (T_comm's two regimes) on the CP
                group, over messages around the model's per-layer K/V shard (the lower quartile of
                each size's steps) -> intra_node_latency_s, intra_node_comm_offset_s,
                intra_node_bandwidth
    overlap     the share of min(ring, local attention) the ring hides when run beside it -> ring_overlap
    reduce      ZeRO-2's per-micro-batch gradient all-reduce (2 ring passes) of P parameters over W
                ranks -> grad_reduce_passes = 2, grad_reduce_bandwidth = 2 (W-1)/W * P * bytes / t
    optimizer   engine.step() / (P / W) -> optimizer_s_per_param
    memory      peak bytes of a forward+backward per checkpointing setting (nothing recomputed, every
                layer, and on CUDA every layer offloaded) against the shape-derived model of the same pass
                (app/profiling/activation/) -> runtime_memory_bytes, the most a measured peak exceeds the
                model (0 if none does); the residual is each setting's measured bytes per token against
                the modeled; on CUDA device_memory_bytes, the memory the run's tensors can have (free +
                what the caching allocator holds, the least over ranks: the device's total less the CUDA
                context, NCCL and other processes); and the BucketSize C that the measured profile leaves
                (scheduling.bucket_size: auto derives it the same way)
    steps       --steps global batches of the run's lengths, planned by skrull, static_cp_packed and
                static_cp, trained as whole steps (each timed in 3 rounds, the median kept) -> k =
                measured / modeled (least squares in relative error), and every time term above is
                scaled by k (app/profiling/steps.py); then the steps' micro-batch laps fit what a sharded
                sequence costs beyond its FLOPs and bytes (the online calibration's fit,
                scheduling/refit.py, over the scaled profile) -> ring_sequence_step_s

Every fit's largest relative residual is printed; over 15% is a warning naming the term. Fields not
measured here (peak_flops, inter-node links, gpus_per_node, and on CPU the device memory, which the workers
share with Ray's object store and the OS) keep the configured profile's values. One node only: the
inter-node bandwidth of a multi-node cluster is not measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

from app.commands.common import add_config_arguments, add_json_argument, config_from_args
from app.config import ConfigError

RESIDUAL_WARNING = 0.15


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_json_argument(parser)
    parser.add_argument("--out", default=None, metavar="YAML",
                        help="write the fitted profile here (e.g. configs/hardware/NAME.yaml)")
    parser.add_argument("--name", default=None, help="profile name (default: the --out file's stem)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed passes per measurement, after a warm-up")
    parser.add_argument("--steps", type=int, default=2, metavar="N",
                        help="global batches of the run's lengths trained as whole steps, each planned by "
                             "skrull, static_cp_packed and static_cp, to fit the step scale (0: none)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="largest compute stream in tokens (default: scheduling.bucket_size)")


def compute_cases(max_tokens: int) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Streams of T = max_tokens/8 .. max_tokens as 1 sequence, 8 sequences or sequences of <= 128
    tokens, each with every token labeled and with 30% labeled: the fit sees the S^2 term, the linear
    terms and the LM head apart."""
    cases = []
    for divisor in (8, 4, 2, 1):
        tokens = max(32, max_tokens // divisor)
        short = min(128, tokens)
        for lengths in ((tokens,), (tokens // 8,) * 8, (short,) * max(1, tokens // short)):
            for fraction in (1.0, 0.3):
                if (lengths, fraction) not in cases:
                    cases.append((lengths, fraction))
    return tuple(cases)


def _settings(config: Any, args: argparse.Namespace, steps: list[Any], on_gpu: bool) -> Any:
    from app.model.deepspeed_config import deepspeed_config
    from app.model.spec import model_spec
    from app.profiling.hardware import cost_model
    from workers.tools.profile_run import ProfileSettings

    max_tokens = args.max_tokens or config.scheduling.bucket_size
    cost = cost_model(config)
    return ProfileSettings(
        steps=tuple(step.payloads for step in steps),
        model=model_spec(config.model, config.train, tokenizer=config.data.tokenizer),
        deepspeed=deepspeed_config(config.train, dtype=config.model.dtype, on_gpu=on_gpu,
                                   hidden_size=cost.hidden_size),
        cp_size=config.parallel.cp_size, cases=compute_cases(max_tokens),
        memory_cases=tuple((max(32, max_tokens // d),) for d in (8, 4, 2, 1)),
        kv_hidden_size=cost.kv_hidden_size, repeats=args.repeats,
        loss_chunk_tokens=config.train.loss_chunk_tokens, timeout_s=config.train.collective_timeout_s,
        seed=config.train.seed, overlap_comm=config.train.overlap_comm,
        one_rank_zero1=config.train.one_rank_zero1)


def _world_size(config: Any) -> int:
    """The configured (minimum) worker count: one fixed group, which must hold a CP group."""
    workers = config.parallel.worker_range[0]
    if workers < config.parallel.cp_size:
        raise ConfigError(f"parallel.num_workers={workers} cannot hold one CP group of parallel.cp_size="
                          f"{config.parallel.cp_size}")
    return workers


def _measuring_config(config: Any, world: int, storage: str) -> Any:
    """The run's config as one fixed worker group that never restarts, with no planner or Ray Data
    reservation (profile starts neither), and Ray Train's files in a scratch directory."""
    import dataclasses

    return dataclasses.replace(
        config, run=dataclasses.replace(config.run, storage_path=storage),
        parallel=dataclasses.replace(config.parallel, num_workers=world),
        train=dataclasses.replace(config.train, max_failures=0),
        resources=dataclasses.replace(config.resources, planner_cpus=0, data_cpus=0))


def measure(config: Any, args: argparse.Namespace) -> tuple[dict, list[Any]]:
    """The workers' raw measurements, and the whole steps they trained (app/profiling/steps.py).

    The measurements run in a Ray Train worker group started like `train`'s (workers/tools/profile_run.py
    says why); the libraries' output goes to a scratch log, printed only if the measurement fails."""
    import tempfile

    import ray

    from app.profiling.hardware import cost_model
    from app.profiling.steps import planned_steps
    from app.train.cluster import on_this_node, ray_session
    from app.train.components import make_trainer
    from app.train.console import captured_output
    from app.train.preflight import check_cluster_fits
    from app.train.run_monitor import RunMonitor
    from workers.tools.profile_run import profile_loop_per_worker

    world = _world_size(config)
    steps = planned_steps(config, cost_model(config), num_batches=args.steps, world_size=world) \
        if args.steps else []
    settings = _settings(config, args, steps, on_gpu=config.resources.gpus_per_worker > 0)
    with tempfile.TemporaryDirectory(prefix="skrull-profile-") as scratch:
        measuring = _measuring_config(config, world, scratch)
        log = Path(scratch) / "profile.log"
        try:
            with captured_output(log) as terminal, ray_session(measuring, worker_logs=False) as embedded:
                warning = check_cluster_fits(measuring, ray.cluster_resources(), embedded=embedded)
                if warning:
                    print(warning, file=terminal)
                monitor = RunMonitor.options(scheduling_strategy=on_this_node()).remote()
                trainer = make_trainer(measuring, settings, "profile", monitor, loop=profile_loop_per_worker)
                trainer.fit()
                (raw,) = ray.get(monitor.since.remote(0))
        except ConfigError:
            raise
        except Exception:
            print(log.read_text()[-8000:], file=sys.stderr)
            raise
    return raw, steps


def fit_profile(config: Any, raw: dict, steps: list[Any] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """(measured profile fields, largest relative residual per fit) from profile_rank's rows.

    With whole `steps` measured, every time term is then scaled by their measured / modeled factor
    (app/profiling/steps.py); raw["step_fit"] records the factor and the step residual before it."""
    from app.profiling.hardware import cost_model
    from scheduling.calibrate import fit_compute, fit_two_regime

    cost = cost_model(config)
    profile = cost.profile
    rows = raw["compute"]
    flops = [float(sum(cost.flops(n, lab) for n, lab in zip(r["lengths"], r["labels"], strict=True)))
             for r in rows]
    compute = fit_compute(flops, [r["seconds_median"] for r in rows], profile)
    fields = {"mfu": compute.mfu, "micro_batch_launch_s": compute.micro_batch_launch_s}
    residuals = {"compute": compute.max_rel_residual}
    if "ring" in raw:
        # The lower quartile of the repeats: scheduling noise on a shared host lands in the medians of
        # single small transfers (a 64 KiB step measured 0.43 ms min, 3.5 ms median), while the single
        # fastest is an outlier of its own (fitted, 50 repeats per size: 8-14% residuals against 4-6% for
        # the lower quartile over five runs; docs/benchmarks.md §0).
        link = fit_two_regime([r["bytes"] for r in raw["ring"]], [r["seconds_p25"] for r in raw["ring"]])
        fields.update(intra_node_latency_s=max(link.latency_s, 1e-7), intra_node_bandwidth=link.bandwidth,
                      intra_node_comm_offset_s=link.offset_s, ring_overlap=float(raw["overlap"]["overlap"]))
        residuals["ring"] = link.max_rel_residual
    world = raw["world_size"]
    if "reduce" in raw:
        reduce = raw["reduce"]
        moved = 2.0 * (world - 1) / world * reduce["bytes"]  # all_reduce: 2 ring passes of the data
        fields.update(grad_reduce_passes=2.0, grad_bytes_per_param=reduce["bytes"] / reduce["params"],
                      grad_reduce_bandwidth=moved / reduce["seconds_median"])
        # The compute cases ran through the engine, so their intercept is b(W) = launch + the reduction
        # at this world size; the profile keeps the two apart (b is re-derived for other world sizes).
        fields["micro_batch_launch_s"] = max(compute.intercept_s - reduce["seconds_median"], 0.0)
    optimizer = raw["optimizer"]
    fields["optimizer_s_per_param"] = optimizer["seconds_median"] * world / optimizer["params"]
    fields.update(_memory_fields(raw, config, residuals))
    if "device_memory_bytes" in raw:
        fields["device_memory_bytes"] = float(raw["device_memory_bytes"])
    if steps and raw.get("steps"):
        from app.profiling.steps import fit_steps, fitted_cost, scaled_fields

        fit = fit_steps(list(steps), raw["steps"], fitted_cost(cost, fields))
        fields = scaled_fields(fields, fit.scale)
        residuals["step"] = fit.max_rel_residual
        raw["step_fit"] = {"scale": fit.scale, "max_rel_residual": fit.max_rel_residual,
                           "max_rel_residual_before": fit.max_rel_residual_before,
                           "policies": [step.policy for step in steps], "measured_s": raw["steps"]}
        fields.update(_sharded_sequence_field(list(steps), raw, fitted_cost(cost, fields), world))
    return fields, residuals


def _sharded_sequence_field(steps: list[Any], raw: dict, cost: Any, world: int) -> dict[str, float]:
    """ring_sequence_step_s from the whole steps' micro-batch laps: the online calibration's fit
    (scheduling/refit.py) over them, the other terms held where the isolated measurements and the step
    scale put them (the steps' plans mix sharded and local sequences: skrull, static_cp_packed, static_cp);
    raw["sequence_fit"] records it. Nothing when the steps shard nothing."""
    from scheduling.refit import PlannedStep, StepTiming, refit

    planned = {i: PlannedStep(plan=s.plan, lengths=s.lengths, labels=s.labels) for i, s in enumerate(steps)}
    timings = [StepTiming(step=i, micro_batch_s=tuple(laps["micro_batch_s"]), optimizer_s=laps["optimizer_s"])
               for i, laps in enumerate(raw.get("step_laps", []))]
    fit = refit(cost, planned, timings, world=world)
    if fit is None or not any(mb.distributed or mb.partial for s in steps for rank in s.plan.micro_batches
                              for mb in rank):
        return {}
    raw["sequence_fit"] = fit.to_dict()
    return {"ring_sequence_step_s": fit.profile.ring_sequence_step_s}


MEMORY_SETTINGS = {"memory": (0, False), "memory_checkpointed": (1, False), "memory_offloaded": (1, True)}
"""The memory rows of workers/tools/profile_run.py and the checkpointing (every, offload) each ran with."""


def _memory_fields(raw: dict, config: Any, residuals: dict[str, float]) -> dict[str, float]:
    """runtime_memory_bytes: the most a measured peak exceeds the shape-derived model of its pass
    (app/profiling/activation/), never below 0; each setting's residual is its measured bytes per token
    (a least-squares slope) against the modeled, relative."""
    from app.profiling.activation import Checkpointing, kernel_set, model_shape, pass_memory
    from app.profiling.memory import kernel_set_of
    from scheduling.calibrate import fit_linear

    shape, kernels, excess = model_shape(config), kernel_set(kernel_set_of(config)), 0.0
    chunk = config.train.loss_chunk_tokens
    for key, (every, offload) in MEMORY_SETTINGS.items():
        if key not in raw:
            continue
        rows, setting = raw[key], Checkpointing(every, offload)
        tokens = [r["tokens"] for r in rows]
        # A pass shorter than one loss chunk holds that many rows of the chunked loss's temporaries, not
        # a whole chunk's (which the model charges as fixed bytes: C is always longer).
        modeled = [pass_memory(shape, kernels, setting, min(chunk, n)).peak(n) for n in tokens]
        excess = max([excess, *(r["peak_bytes"] - m for r, m in zip(rows, modeled, strict=True))])
        slope = fit_linear(tokens, [max(r["peak_bytes"], 1) for r in rows]).slope
        modeled_slope = fit_linear(tokens, modeled).slope
        residuals[key] = abs(slope - modeled_slope) / modeled_slope
    return {"runtime_memory_bytes": excess}


def _bucket_size(config: Any, fields: dict[str, float]) -> int | None:
    """The C the measured profile gives the config (app/profiling/memory.py; None: nothing fits)."""
    import dataclasses

    from app.profiling.hardware import load_hardware_profile
    from app.profiling.memory import memory_terms
    from scheduling import HardwareProfile

    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    measured = dataclasses.replace(load_hardware_profile(config.hardware.profile),
                                   **{k: v for k, v in fields.items() if k in known})
    return memory_terms(config, profile=measured).tokens or None


def profile_yaml(config: Any, raw: dict, fields: dict[str, float], residuals: dict[str, float],
                 name: str, command: str) -> str:
    """The configured profile with the measured fields replaced, headed by how and when it was made."""
    import dataclasses

    from app.profiling.hardware import cost_model

    base = dataclasses.asdict(cost_model(config).profile)
    values = {**base, **fields, "name": name}
    today = datetime.date.today().isoformat()
    lines = [f"# Measured by `{command}` on {raw['device']}, {today},",
             f"# {raw['world_size']} workers (CP {raw['cp_size']}), model {config.model.name_or_path} "
             f"({raw['params']:,} parameters, {config.model.dtype}), scheduling.cost_formula="
             f"{config.scheduling.cost_formula}.",
             "# Fit residuals (largest relative): " + ", ".join(f"{k} {v:.1%}" for k, v in residuals.items()),
             "# Fields without '# measured' are the base profile's "
             f"({config.hardware.profile}): not measured by `profile`."]
    if "step_fit" in raw:
        fit = raw["step_fit"]
        before, after = fit["max_rel_residual_before"], fit["max_rel_residual"]
        lines.insert(3, f"# {len(fit['measured_s'])} whole training steps ran {fit['scale']:.3f}x the "
                        f"isolated terms' model (largest step error {before:.1%} before, {after:.1%} "
                        "after): every time term below is scaled by that.")
    if "sequence_fit" in raw:
        fit = raw["sequence_fit"]
        lines.insert(4, f"# The steps' {fit['micro_batches']} micro-batches fitted ring_sequence_step_s "
                        f"(median error {fit['error_before']:.1%} -> {fit['error_after']:.1%}; "
                        "scheduling/refit.py).")
    for key, value in values.items():
        text = value if isinstance(value, str) else (f"{value:.6g}" if isinstance(value, float) else value)
        lines.append(f"{key}: {text}" + ("  # measured" if key in fields else ""))
    return "\n".join(lines) + "\n"


def _print(raw: dict, fields: dict[str, float], residuals: dict[str, float], bucket: int | None) -> None:
    print(f"profile: {raw['device']}, {raw['world_size']} workers (CP {raw['cp_size']}), "
          f"{raw['params']:,} parameters")
    for key, value in fields.items():
        print(f"  {key:<28} {value:.4g}")
    for term, residual in residuals.items():
        flag = "  WARNING: over 15%" if residual > RESIDUAL_WARNING else ""
        print(f"  fit residual {term:<15} {residual:.1%}{flag}")
    if "step_fit" in raw:
        fit = raw["step_fit"]
        print(f"  whole steps: measured / modeled = {fit['scale']:.3f} (largest step error "
              f"{fit['max_rel_residual_before']:.1%} before scaling, {fit['max_rel_residual']:.1%} after)")
    if "overlap" in raw:
        o = raw["overlap"]
        print(f"  ring beside local attention: ring {o['comm_s'] * 1e3:.2f} ms, attention "
              f"{o['compute_s'] * 1e3:.2f} ms, both {o['both_s'] * 1e3:.2f} ms -> overlap {o['overlap']:.2f}")
    if bucket is not None:
        print(f"  BucketSize for the memory budget: scheduling.bucket_size <= {bucket:,} tokens")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    config = config_from_args(args)
    if args.steps < 0:
        raise SystemExit("--steps must be >= 0")
    raw, steps = measure(config, args)
    fields, residuals = fit_profile(config, raw, steps)
    bucket = _bucket_size(config, fields)
    for term, residual in residuals.items():
        if residual > RESIDUAL_WARNING:
            print(f"warning: the {term} fit's largest residual is {residual:.0%} (> 15%): the cost model's "
                  f"{term} term describes this machine poorly", file=sys.stderr)
    if fields["mfu"] > 1:
        print(f"warning: fitted mfu {fields['mfu']:.2f} > 1: the base profile's peak_flops "
              f"({config.hardware.profile}) is below the rate measured; set peak_flops in the written "
              "profile to the device's peak (the predicted times are the same either way)", file=sys.stderr)
    name = args.name or (Path(args.out).stem if args.out else "measured")
    command = "python -m app " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["profile"] else \
        f"python -m app profile --config {args.config}"
    text = profile_yaml(config, raw, fields, residuals, name, command)
    if args.out:
        out = Path(args.out)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)  # never a half-written profile
    if args.json:
        print(json.dumps({"profile": fields, "residuals": residuals, "bucket_size": bucket, "raw": raw},
                         default=_jsonable))
        return 0
    _print(raw, fields, residuals, bucket)
    if args.out:
        print(f"profile written to {args.out}")
    return 0


def _jsonable(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else str(value)
