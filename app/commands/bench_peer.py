"""`python -m app bench peer`: this project against TRL's SFTTrainer on the same model, tokens and steps.

    python -m app bench peer [--config configs/bench/cpu-lmsys.yaml] [--steps 4] [--rounds 2]
        [--trl-micro-batch 8] [--json] [--set key=value ...]

Each round runs TRL (app/bench/peer/trl_side.py: SFTTrainer, padding-free, one process) and then this project
(app/bench/peer/our_side.py: `bench train` of skrull and balanced_packed), each in a fresh process, so the
rounds alternate T O T O ... and drift on the machine reaches both sides. Both train the same global batches
(app/bench/peer/rows.py) from the same initial weights: `bench train`'s uncounted steps (the warm-up step
and, with online calibration, the calibration window, in which the planner tries its candidates), then
--steps counted ones; the uncounted steps are left out of the timings on both sides. Over the counted steps
of all rounds:

    tokens_per_s        median tokens of a step / median step_s (bench train's formula), per side
    tokens_per_cpu_s    median tokens / median cpu_s: CPU seconds of the step, all threads of TRL's process,
                        summed over this project's worker processes (Ray's own daemons left out)
    vs_trl              a policy's tokens_per_s / TRL's (> 1: this project is faster)
    paired_vs_trl       median over (round, step) of TRL's step_s / the policy's on the same global batch
    per_round           each round's tokens_per_s, per side

Checks: `same_samples` (at every step both sides trained the same sample ids), `same_tokens` (and TRL
counted those tokens), `first_step` (loss and gradient norm of step 1, computed by each side on the same
weights and batch, and their largest relative difference from TRL's over the rounds). `machine`: cores and
the load average (`uptime`'s) at start and end. Every run's JSON and log, and bench_peer.json (a copy of
the --json line), go to <run.storage_path>/bench-peer-<timestamp>-<hex>/.
Nothing heavy is imported until the command runs; each side is its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from app.bench.peer.rows import POLICIES
from app.commands.common import add_config_arguments, add_json_argument, config_from_args
from app.config import ConfigError, SkrullConfig
from app.rundir.files import jsonable
from app.train.failures import RunFailed

DEFAULT_CONFIG = "configs/bench/cpu-lmsys.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.set_defaults(config=DEFAULT_CONFIG)
    add_json_argument(parser)
    parser.add_argument("--steps", type=int, default=4,
                        help="counted optimizer steps per run, after 1 warm-up (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="TRL / this project pairs, run alternately")
    parser.add_argument("--trl-micro-batch", type=int, default=8,
                        help="TRL's per_device_train_batch_size in sequences; gradient accumulation makes up "
                             "the global batch (default 8)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: both sides on GPUs in bf16 (model.dtype=bf16, resources.gpus_per_worker="
                             "1), TRL with the best attention transformers finds (flash_attention_2, else "
                             "flash_attention_4, else sdpa) and Liger's kernels when liger-kernel is "
                             "installed")


def check_arguments(args: argparse.Namespace, config: SkrullConfig) -> None:
    """Every bad argument as one ConfigError naming it, before anything runs."""
    from app.bench.peer.rows import step_batches
    from app.bench.peer.trl_side import check_micro_batch

    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps}: need at least one counted step")
    if args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds}: need at least one round")
    check_micro_batch(args.trl_micro_batch, config.scheduling.global_batch_size)
    step_batches(config, args.steps)  # the config knobs and enough rows for every step


TRL_SETUP = ("trl", "transformers", "processes", "torch_threads", "micro_batch",
             "gradient_accumulation_steps", "attention", "padding_free", "device", "dtype", "liger")
"""What the summary says TRL ran with (its JSON's keys)."""
CUDA_SETS = ("model.dtype=bf16", "resources.gpus_per_worker=1")
"""What --device cuda sets on both sides (a config for CPU stays one for CPU otherwise)."""


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("bench peer --device cuda: no CUDA device is visible to torch")
        args.overrides = [*args.overrides, *CUDA_SETS]
    config = config_from_args(args)
    check_arguments(args, config)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(4)}"
    out_dir = Path(config.run.storage_path) / f"bench-peer-{stamp}"
    out_dir.mkdir(parents=True)
    load_start, started = _load(), time.perf_counter()
    rounds = []
    for index in range(1, args.rounds + 1):
        trl = _side(args, out_dir, f"trl-{index}", "app.bench.peer.trl_side",
                    ["--micro-batch", str(args.trl_micro_batch), "--device", args.device])
        ours = _side(args, out_dir, f"ours-{index}", "app.bench.peer.our_side",
                     ["--policies", ",".join(POLICIES)])
        rounds.append({"trl": trl, "ours": ours})
    machine = {"cpus": os.cpu_count(), "load_avg_1_5_15_min": load_start, "load_avg_1_5_15_min_end": _load()}
    summary = summarize(rounds, wall_s=time.perf_counter() - started, machine=machine, out_dir=str(out_dir))
    line = json.dumps(jsonable(summary))
    (out_dir / "bench_peer.json").write_text(line + "\n")
    print(line if args.json else format_report(summary))
    return 0


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _side(args: argparse.Namespace, out_dir: Path, name: str, module: str,
          extra: list[str]) -> dict[str, Any]:
    """Run one side as its own process (output to <name>.log); its JSON result."""
    result, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    sets = [part for override in args.overrides for part in ("--set", override)]
    command = [sys.executable, "-m", module, "--config", args.config, *sets, "--steps", str(args.steps),
               "--out", str(result), *extra]
    if not args.json:
        print(f"{name}: running ({log})", file=sys.stderr, flush=True)
    with log.open("w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RunFailed(f"{name} ({module}) exited with {code}; the end of {log}:\n{tail}")
    return json.loads(result.read_text())


# ------------------------------------------------------------------------------------------- summary


def summarize(rounds: list[dict[str, Any]], *, wall_s: float, machine: dict[str, Any], out_dir: str
              ) -> dict[str, Any]:
    """The report of every round's two results (module docstring)."""
    steps = {"trl": [r["trl"]["per_step"] for r in rounds]}
    steps.update({p: [r["ours"]["per_step"][p] for r in rounds] for p in POLICIES})
    sides = {name: _side_row(runs) for name, runs in steps.items()}
    for policy in POLICIES:
        sides[policy]["vs_trl"] = sides[policy]["tokens_per_s"] / sides["trl"]["tokens_per_s"]
        sides[policy]["paired_vs_trl"] = _paired(steps["trl"], steps[policy])
    trl, ours = rounds[0]["trl"], rounds[0]["ours"]
    return {
        "sides": sides,
        "steps": len([s for s in trl["per_step"] if not s["warmup"]]), "rounds": len(rounds),
        "global_batch_size": len(trl["per_step"][0]["sample_ids"]),
        "trl_setup": {key: trl.get(key) for key in TRL_SETUP},
        "our_setup": {key: ours[key] for key in ("processes", "dp_size", "cp_size", "bucket_size",
                                                 "torch_threads", "attention_backend")},
        "same_samples": _same(steps, "sample_ids"), "same_tokens": _same(steps, "tokens") and all(
            s["trl_tokens"] == s["tokens"] for run in steps["trl"] for s in run),
        "first_step": _first_step(steps),
        "wall_s": wall_s, "machine": machine, "run_dir": out_dir,
        "our_run_dirs": [r["ours"]["run_dir"] for r in rounds],
    }


def _counted(run: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in run if not s["warmup"]]


def _rate(steps: list[dict[str, Any]]) -> float:
    return statistics.median(s["tokens"] for s in steps) / statistics.median(s["step_s"] for s in steps)


def _side_row(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """tokens/s over every round's counted steps, and per round."""
    counted = [s for run in runs for s in _counted(run)]
    cpu_s = statistics.median(s["cpu_s"] for s in counted)
    return {"tokens_per_s": _rate(counted), "step_s_median": statistics.median(s["step_s"] for s in counted),
            "cpu_s_median": cpu_s,
            "tokens_per_cpu_s": statistics.median(s["tokens"] for s in counted) / max(cpu_s, 1e-12),
            "per_round_tokens_per_s": [_rate(_counted(run)) for run in runs],
            "per_round_step_s": [[s["step_s"] for s in _counted(run)] for run in runs]}


def _paired(trl: list[list[dict[str, Any]]], ours: list[list[dict[str, Any]]]) -> float:
    """Median of TRL's step_s / ours over the same (round, step): the same global batch on both sides."""
    pairs = [(a["step_s"], b["step_s"]) for run_a, run_b in zip(trl, ours, strict=True)
             for a, b in zip(_counted(run_a), _counted(run_b), strict=True)]
    return statistics.median(a / max(b, 1e-12) for a, b in pairs)


def _same(steps: dict[str, list[list[dict[str, Any]]]], key: str) -> bool:
    """Every side has, at every (round, step), the same `key` as TRL (sample ids compared as sets)."""
    def value(step: dict[str, Any]) -> Any:
        return sorted(step[key]) if key == "sample_ids" else step[key]

    reference = [[value(s) for s in run] for run in steps["trl"]]
    return all([[value(s) for s in run] for run in runs] == reference for runs in steps.values())


def _first_step(steps: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Loss and grad norm of step 1 (initial weights) per side and round; largest |x - TRL's| / TRL's."""
    out: dict[str, Any] = {}
    for key in ("loss", "grad_norm"):
        values = {name: [run[0][key] for run in runs] for name, runs in steps.items()}
        out[key] = values
        out[f"{key}_max_rel_diff"] = max(
            (abs(v - t) / max(abs(t), 1e-12) for name, vs in values.items() if name != "trl"
             for v, t in zip(vs, values["trl"], strict=True) if v is not None and t is not None),
            default=None)
    return out


def _sci(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1e}"


# -------------------------------------------------------------------------------------------- output


def format_report(summary: dict[str, Any]) -> str:
    sides, trl, ours, first = (summary["sides"], summary["trl_setup"], summary["our_setup"],
                               summary["first_step"])
    machine = summary["machine"]
    lines = [
        f"bench peer: {summary['rounds']} rounds (TRL, then bench train of {' and '.join(POLICIES)}), "
        f"{summary['steps']} counted steps per run (+1 warm-up), {summary['global_batch_size']} sequences "
        "per step",
        f"TRL {trl['trl']} (transformers {trl['transformers']}): {trl['processes']} process, "
        f"{trl['torch_threads']} torch threads, padding-free micro-batches of {trl['micro_batch']} sequences "
        f"x {trl['gradient_accumulation_steps']} accumulation steps, attention {trl['attention']}, "
        f"{trl.get('dtype')} on {trl.get('device')}, Liger {'on' if trl.get('liger') else 'off'}",
        f"this project: {ours['processes']} Ray Train workers (DP {ours['dp_size']} x CP {ours['cp_size']}), "
        f"{ours['torch_threads']} torch thread(s) each, BucketSize {ours['bucket_size']}, "
        f"attention: {ours['attention_backend']}",
        "",
        f"{'side':<16}  {'tokens/s':>9}  {'step s p50':>10}  {'CPU s p50':>9}  {'tokens/CPU s':>12}  "
        "per round tokens/s",
    ]
    for name, row in sides.items():
        rounds = ", ".join(f"{x:.0f}" for x in row["per_round_tokens_per_s"])
        lines.append(f"{name:<16}  {row['tokens_per_s']:>9.0f}  {row['step_s_median']:>10.3f}  "
                     f"{row['cpu_s_median']:>9.2f}  {row['tokens_per_cpu_s']:>12.0f}  {rounds}")
    lines.append("")
    lines += [f"{p} / TRL: {sides[p]['vs_trl']:.2f}x tokens/s (per-step pairs: "
              f"{sides[p]['paired_vs_trl']:.2f}x)" for p in POLICIES]
    loss = ", ".join(f"{name} {values[0]:.6f}" for name, values in first["loss"].items())
    lines.append(f"first step (same weights, same batch): loss {loss}; largest relative difference from TRL "
                 f"{_sci(first['loss_max_rel_diff'])} (grad norm {_sci(first['grad_norm_max_rel_diff'])})")
    lines.append(f"same samples every step: {'yes' if summary['same_samples'] else 'NO'}; same tokens: "
                 f"{'yes' if summary['same_tokens'] else 'NO'}")
    load = " ".join(f"{x:g}" for x in machine["load_avg_1_5_15_min"])
    load_end = " ".join(f"{x:g}" for x in machine["load_avg_1_5_15_min_end"])
    lines.append(f"wall {summary['wall_s']:.0f} s on {machine['cpus']} CPUs; load average at start {load}, "
                 f"at end {load_end}")
    lines.append(f"results: {summary['run_dir']}/bench_peer.json (each run's JSON and log beside it)")
    return "\n".join(lines)
