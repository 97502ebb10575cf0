"""`python -m app bench compute`: measure the model's micro-batch compute time and fit the profile.

Runs forward+backward of the configured model on one device over packed streams of several sizes and
sequence mixes (workers/tools/profile_compute.py), fits T = a*F + b (scheduling/calibrate.py), prints the
fitted `mfu` and `micro_batch_launch_s` beside the profile's values, plus the modeled-vs-measured error of
both, as YAML lines to paste into configs/hardware/<profile>.yaml. One device only: the ring's
communication rates are not part of this measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json

from app.commands.common import add_config_arguments, add_json_argument

RESIDUAL_WARNING = 0.25
"""Above this largest relative residual the fitted line is flagged as a poor description of the device."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_json_argument(parser)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run (auto: cuda when available)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="largest stream in tokens (default: scheduling.bucket_size)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per case, after one warm-up")


def _device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench compute --device cuda: no CUDA device is visible")
    return torch.device(name)


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} cpu, {torch.get_num_threads()} threads"


def measure(args: argparse.Namespace) -> dict:
    from app.commands.common import config_from_args
    from app.model.spec import model_spec
    from app.profiling.hardware import cost_model
    from scheduling.calibrate import fit_compute
    from workers.tools.profile_compute import compute_cases, measure_compute

    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    config = config_from_args(args)
    cost = cost_model(config)
    device = _device(args.device)
    model = model_spec(config.model, config.train, tokenizer=config.data.tokenizer).build().to(device)
    model.train()
    max_tokens = args.max_tokens or config.scheduling.bucket_size
    rows = measure_compute(model, compute_cases(max_tokens), repeats=args.repeats,
                           loss_chunk_tokens=config.train.loss_chunk_tokens,
                           attention_backend=config.model.attention_backend)
    for row in rows:
        row["flops"] = float(sum(cost.flops(n) for n in row["lengths"]))
        row["modeled_s_profile"] = cost.t_comp(row["flops"]) + cost.micro_batch_overhead_s(1)
    fit = fit_compute([r["flops"] for r in rows], [r["seconds_median"] for r in rows], cost.profile)
    for row in rows:
        row["modeled_s_fit"] = fit.predict(row["flops"])
    profile = cost.profile
    return {
        "device": _device_name(device), "dtype": config.model.dtype, "model": config.model.name_or_path,
        "profile": profile.name, "peak_flops": profile.peak_flops, "rows": rows,
        "fit": {"mfu": fit.mfu, "micro_batch_launch_s": fit.micro_batch_launch_s,
                "intercept_s": fit.intercept_s, "max_rel_residual": fit.max_rel_residual},
        "profile_values": {"mfu": profile.mfu, "micro_batch_launch_s": profile.micro_batch_launch_s},
    }


def _print(result: dict, command: str) -> None:
    print(f"bench compute: {result['model']} ({result['dtype']}) on {result['device']}, "
          f"profile {result['profile']}")
    print(f"{'tokens':>7}  {'sequences':>14}  {'GFLOP fwd':>10}  {'measured ms':>11}  {'fit ms':>8}  "
          f"{'profile ms':>10}")
    for r in result["rows"]:
        lens = r["lengths"]
        shape = f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else f"{len(lens)} mixed"
        ms = {key: r[key] * 1e3 for key in ("seconds_median", "modeled_s_fit", "modeled_s_profile")}
        print(f"{r['tokens']:>7}  {shape:>14}  {r['flops'] / 1e9:>10.1f}  {ms['seconds_median']:>11.2f}  "
              f"{ms['modeled_s_fit']:>8.2f}  {ms['modeled_s_profile']:>10.2f}")
    fit, old = result["fit"], result["profile_values"]
    print(f"fit T = a*F + b: largest relative residual {fit['max_rel_residual']:.1%}")
    if fit["max_rel_residual"] > RESIDUAL_WARNING:
        print(f"warning: T is not linear in the paper's FLOPs here (residual > {RESIDUAL_WARNING:.0%}): "
              "small models spend most of their time in the embedding / LM head, which the formula leaves "
              "out; treat the fitted values as rough")
    if fit["mfu"] > 1:
        print(f"warning: fitted mfu > 1: the profile's peak_flops ({result['peak_flops']:.3g} FLOP/s) is "
              "below what this device sustains; correct peak_flops first")
    today = datetime.date.today().isoformat()
    source = f"measured by `{command}` on {result['device']}, {today}"
    print(f"mfu: {fit['mfu']:.4g}                   # {source} (profile had {old['mfu']:g})")
    print(f"micro_batch_launch_s: {fit['micro_batch_launch_s']:.4g}  # {source} (profile had "
          f"{old['micro_batch_launch_s']:g}; intercept {fit['intercept_s']:.3g} s)")


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        _print(result, "skrull bench compute")
    return 0
