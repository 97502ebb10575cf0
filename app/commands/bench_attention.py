"""`python -m app bench attention`: DACP overlap vs the same work serialized vs static CP (CPU, gloo).

The measurement lives in workers/tools/bench_attention.py; this module parses arguments and prints.
"""

from __future__ import annotations

import argparse
import json

from app.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--cp", type=int, default=2, help="CP processes (default 2)")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-seqs", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--max-len", type=int, default=6000, help="clip sampled lengths to this")
    parser.add_argument("--bimodal-scale", type=float, default=0.1,
                        help="multiply the bimodal mix's lengths (8K-32K documents are too slow on 2 cores)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per variant (after 1 warm-up)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from workers.tools.bench_attention import run_benchmark

    try:
        report = run_benchmark(cp=args.cp, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                               num_seqs=args.num_seqs, max_len=args.max_len,
                               bimodal_scale=args.bimodal_scale, repeats=args.repeats, seed=args.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"DACP attention fwd+bwd, CP={args.cp} (gloo), H={args.heads} G={args.kv_heads} D={args.head_dim}; "
          "median over repeats of the slowest rank")
    for mix, r in report["mixes"].items():
        print(f"{mix:>9}: {len(r['lengths'])} seqs, {sum(r['lengths'])} tokens, {len(r['distributed'])} "
              f"distributed | dacp {r['ms']['dacp']} ms, serialized {r['ms']['serialized']} ms, static CP "
              f"{r['ms']['static_cp']} ms | serialized/dacp {r['serialized_over_dacp']}x, "
              f"static_cp/dacp {r['static_cp_over_dacp']}x")
    return 0
