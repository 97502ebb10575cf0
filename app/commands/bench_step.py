"""`python -m app bench step`: tokens/s, MFU and the split of a training step per config variant, measured
interleaved on one device (CUDA when present, else CPU) without Ray (app/bench/step.py).

    python -m app bench step --config configs/tiny-cpu.yaml --variant today:train.optimizer_impl=auto \\
        --variant fused:train.optimizer_impl=fused,train.compile=true [--steps 8] [--trace DIR] \\
        [--max-seconds S] [--json]

--json prints one line: {"device", "variants": {NAME: {"tokens_per_s", "mfu", "micro_batch_s", "optimizer_s",
"gap_s", "peak_bytes", "predicted_peak_bytes", ...}}, "speedup_vs_first": {NAME: ratio}, "stopped_early"}
(the first variant is the reference; stopped_early: null, or why --max-seconds ended the run).
"""

from __future__ import annotations

import argparse
import json

from app.commands.common import add_config_arguments, add_json_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_json_argument(parser)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="a named set of overrides on top of --set, repeatable (the first is the "
                             "reference); none: the config as given, named `config`")
    parser.add_argument("--steps", type=int, default=8, help="counted steps per variant (default 8)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="steps run first and not counted, per variant (default 1)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="one more step per variant under torch.profiler: DIR/<variant>.json (Chrome "
                             "trace) and the 15 ops with the most self time")
    parser.add_argument("--max-seconds", type=float, default=None, metavar="S",
                        help="start no build or step after S seconds (builds included); report the steps "
                             "measured so far, say so (stopped_early) and exit 1")


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _print(result: dict) -> None:
    print(f"bench step on {result['device']}: {result['steps']} counted steps per variant (after "
          f"{result['warmup_steps']} warm-up), interleaved; tokens per step "
          f"{result['tokens_per_step'][result['warmup_steps']]:,} ...")
    if result["stopped_early"]:
        print(f"stopped early: {result['stopped_early']} (each variant over the steps it counted)")
    header = (f"{'variant':<14} {'tokens/s':>10} {'MFU':>6} {'step s':>8} {'micro-b s':>9} {'optim s':>8} "
              f"{'gap s':>7} {'mb/step':>7} {'peak':>9} {'model':>9} {'vs first':>8}")
    print(header)
    for name, v in result["variants"].items():
        if "error" in v:
            print(f"{name:<14} failed: {v['error']}")
            continue
        print(f"{name:<14} {v['tokens_per_s']:>10,.0f} {v['mfu']:>6.3f} {v['step_s']:>8.4f} "
              f"{v['micro_batch_s']:>9.4f} {v['optimizer_s']:>8.4f} {v['gap_s']:>7.4f} "
              f"{v['micro_batches']:>7.1f} {_gb(v['peak_bytes']):>9} {_gb(v['predicted_peak_bytes']):>9} "
              f"{_ratio(result['speedup_vs_first'][name]):>8}")
    for name, v in result["variants"].items():
        if "error" in v:
            continue
        print(f"  {name}: kernels {v['kernels']}, {v['optimizer']}, ZeRO-{v['zero_stage']}, "
              f"compile {v['compile']}, "
              f"checkpointing {v['activation_checkpointing']}, C {v['bucket_size']:,}")
        if v.get("device_time"):
            t = v["device_time"]
            print(f"    traced step: the device busy {t['busy_ms']:.1f} ms and idle {t['idle_ms']:.1f} ms of "
                  f"{t['span_ms']:.1f} ms (idle: waiting for the host)")
        for op in v.get("top_ops") or []:
            print(f"    {op['self_ms']:>10.2f} ms  {op['calls']:>6}x  {op['op']}")


def run(args: argparse.Namespace) -> int:
    from app.bench.step import parse_variant, run_bench_step

    variants = [parse_variant(text) for text in args.variant]
    result = run_bench_step(args.config, args.overrides, variants, steps=args.steps, warmup=args.warmup,
                            trace_dir=args.trace, max_seconds=args.max_seconds)
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    failed = any("error" in v for v in result["variants"].values())
    return 1 if failed or result["stopped_early"] else 0
