"""`python -m app plan`: a dry run of every scheduling policy on sampled global batches (modeled times), the
configured CP degrees (scheduling.cp_degrees) against [1, N] and dynamic_cp, the activation checkpointing
(chosen among its candidates with train.activation_checkpointing=auto: app/profiling/checkpointing.py), the
BucketSize C (derived from memory with scheduling.bucket_size=auto) and the memory per rank by term and at
ZeRO-2 and ZeRO-3 (modeled: app/profiling/memory.py)."""

from __future__ import annotations

import argparse
import json

from app.commands.common import add_config_arguments, add_json_argument, config_from_args
from app.config import SkrullConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_json_argument(parser)
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write a per-rank modeled-time chart (static CP beside Skrull) to this file")


def model_dims_json(config: SkrullConfig) -> dict[str, object]:
    """The model's dimensions as planned (app/model/dims.py) and where they come from: `plan --json`'s
    "model_dims"; "note" is the line said where config.json could not be read (else None)."""
    from app.config import DIMENSION_KEYS
    from app.model.dims import checkpoint_dims, dims_note, resolved_model

    resolved = resolved_model(config.model)
    source = "preset" if resolved is config.model else (
        "config.json" if checkpoint_dims(config.model) is not None else "config")
    return {**{key: getattr(resolved, key) for key in DIMENSION_KEYS}, "source": source,
            "note": dims_note(config.model)}


def run(args: argparse.Namespace) -> int:
    from app.model.support import check_model_support
    from app.profiling.budget import resolve_bucket_size
    from app.profiling.checkpointing import format_candidates
    from app.profiling.hardware import cost_model
    from app.profiling.memory import (
        configured_checkpointing,
        format_memory_table,
        format_terms,
        memory_table,
        memory_terms,
    )
    from app.profiling.plan_report import degree_line, format_table, plan_dry_run, plot_ranks

    config = config_from_args(args, derive_bucket_size=False)
    dims = model_dims_json(config)  # a model.* dimension config.json contradicts: exit 2
    config, budget = resolve_bucket_size(config)
    check_model_support(config)  # a model the DACP attention cannot run, a vocabulary it cannot embed: exit 2
    cost = cost_model(config)
    runs, summary, too_long, read, degrees = plan_dry_run(config, cost)
    choice = budget.checkpointing
    checkpointing = choice.as_json() if choice else {"setting": configured_checkpointing(config).name,
                                                     "source": "config"}
    if args.plot:
        plot_ranks(runs, args.plot)
    if args.json:
        # "policies" first and unchanged: scripts read it; "too_long" says what data.too_long changed,
        # "data" what the rows read were (by row format, malformed by reason; with data.sources "sources":
        # {id: {"rows", "tokens", "share"}}, the mix of those rows), "cp_degrees" the configured
        # CP degrees against [1, N] and dynamic_cp (app/profiling/plan_report.py degree_summary)
        # "bucket_size" the C planned with, "bucket_size_source" config | memory (bucket_size=auto),
        # "memory" the modeled bytes per rank at ZeRO-2 and ZeRO-3, without and with activation offload, and
        # "memory_terms" the run's own (its ZeRO stage); "checkpointing" the setting, and with
        # train.activation_checkpointing=auto every candidate's C, peak and modeled step
        # "model_dims" the dimensions planned with and their source (config.json, or the config's own where
        # config.json cannot be read: app/model/dims.py); "load" in each "memory" entry the modeled peak
        # per rank while the model is built and loaded (app/profiling/memory.py load_peak)
        print(json.dumps({"policies": summary, "too_long": too_long.as_json(), "data": read,
                          "model_dims": dims,
                          "cp_degrees": degrees, "bucket_size": budget.tokens,
                          "bucket_size_source": budget.source, "checkpointing": checkpointing,
                          "memory": {k: t.as_json() for k, t in memory_table(config).items()},
                          "memory_terms": memory_terms(config).as_json()}))
        return 0
    par, sched = config.parallel, config.scheduling
    batches = len(runs["skrull"].estimates)
    print(f"{config.run.name}: {batches} global batches of {sched.global_batch_size} sequences, "
          f"DP={par.dp_size} x CP={par.cp_size}, BucketSize={sched.bucket_size}, "
          f"hardware={cost.profile.name}, per-micro-batch cost b="
          f"{cost.micro_batch_overhead_s(par.dp_size * par.cp_size) * 1e3:.1f} ms "
          "(modeled times, not measurements)")
    if dims["note"]:
        print(dims["note"])
    print(budget.line())
    if choice:
        print(choice.line())
    if read.get("sources"):
        from app.data.scan import describe_sources

        print(f"data.sources over the {read['rows']} rows read: {describe_sources(read['sources'])}")
    if too_long.line():
        print(too_long.line())
    print(format_table(summary))
    print(degree_line(degrees))
    if choice:
        print("train.activation_checkpointing=auto: the candidates (modeled; app/profiling/checkpointing.py)")
        print(format_candidates(choice))
    terms = memory_terms(config)
    print(f"memory per rank over {terms.workers} ranks at ZeRO-{terms.zero_stage}, recompute "
          f"{terms.recompute}, kernels {terms.kernels} (modeled, not measured: app/profiling/memory.py)")
    print(format_terms(terms))
    if terms.workers == 1 and terms.zero_stage == 2 and config.train.one_rank_zero1:
        print("one worker runs ZeRO-2 as ZeRO-1 (train.one_rank_zero1: the same state, no per-micro-batch "
              "bucket work); the ZeRO-2 terms above bound it (docs/memory.md)")
    print("the same at ZeRO-2 and ZeRO-3, without and with activation offload:")
    print(format_memory_table(memory_table(config)))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
