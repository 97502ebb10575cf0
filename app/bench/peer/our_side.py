"""One `bench train` run of this project's policies, reported in the TRL side's form
(app/bench/peer/trl_side.py).

    python -m app.bench.peer.our_side --config configs/bench/cpu-lmsys.yaml --steps 4 --out r.json
        [--policies skrull,balanced_packed] [--set key=value ...]

The existing machinery trains: app/bench/driver.py's `bench_train` (one Ray session, one Ray Train worker
group of parallel.num_workers ranks, DP x CP from the config, the policies interleaved step by step after
one warm-up step each, every engine from the same seed). Per policy and step (warm-up first) the JSON
holds bench train's own step_s (the slowest rank's planner wait + forward, backward and optimizer step),
cpu_s (the CPU seconds of every worker process over its fetch and step, summed over ranks), loss (the
global batch's summed CE / its label tokens), grad_norm, tokens and sample ids; `summary` is bench
train's summary of the counted steps (app/bench/summary.py), minus per-step detail.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.bench.peer.rows import POLICIES, check_peer_config, side_config
from app.config import SkrullConfig
from app.rundir.files import jsonable

STEP_KEYS = ("step", "warmup", "step_s", "loss", "grad_norm", "tokens", "label_tokens", "sample_ids",
             "micro_batches", "planner_wait_s", "rank_cpu_s")


def run_ours(config: SkrullConfig, steps: int, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """bench train of `policies` on its uncounted + `steps` global batches; every step of every policy."""
    from app.bench.driver import bench_train
    from app.bench.summary import summarize

    check_peer_config(config)
    result = bench_train(config, policies, steps, progress=False, quiet=True)
    summary = summarize(result)
    per_policy = {p: [_step(record) for record in result.records if record["policy"] == p] for p in policies}
    rows = {p: {k: v for k, v in row.items() if k != "per_step"} for p, row in summary["policies"].items()}
    return {
        "side": "ours", "processes": config.parallel.num_workers,
        "dp_size": config.parallel.dp_size, "cp_size": config.parallel.cp_size,
        "bucket_size": config.scheduling.bucket_size,
        "torch_threads": result.records[0]["torch_threads"],
        "attention_backend": _attention(config),
        "wall_s": result.wall_s, "run_dir": result.run_dir, "machine": result.machine,
        "summary": {**{k: v for k, v in summary.items() if k != "policies"}, "policies": rows},
        "per_step": per_policy,
    }


def _attention(config: SkrullConfig) -> str:
    """model.attention_backend as the workers resolve it on their device (CUDA when they hold GPUs)."""
    import torch

    from workers.attention.kernels import resolve_backend

    setting = config.model.attention_backend
    device = torch.device("cuda" if config.resources.gpus_per_worker else "cpu")
    return f"DACP, {resolve_backend(setting, device)} varlen kernel (model.attention_backend={setting})"


def _step(record: dict[str, Any]) -> dict[str, Any]:
    """One bench train record in the peer's form; cpu_s: the CPU seconds of every worker process."""
    return {**{key: record.get(key) for key in STEP_KEYS}, "cpu_s": sum(record["rank_cpu_s"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench.peer.our_side", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, required=True, help="counted steps, after the warm-up")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", required=True, help="write the JSON result here")
    args = parser.parse_args(argv)
    config = side_config(args.config, args.overrides)
    result = run_ours(config, args.steps, tuple(args.policies.split(",")))
    Path(args.out).write_text(json.dumps(jsonable(result)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
