"""The measurement behind `python -m app bench attention`: DACP overlap vs serialized vs static CP.

For each length mix, every rank times one attention forward+backward (random q/k/v, H query heads,
G KV heads) of its stream under three executions of the same micro-batch:

    dacp        DACP plan, local attention computed while the first ring transfer is in flight
    serialized  same plan and work, local attention first, then the ring (no overlap)
    static_cp   every sequence sharded over the CP group (what static context parallelism does)

A step takes as long as its slowest rank, so each repeat reports the max over ranks (all_reduce MAX);
the median over repeats is printed with the ratios serialized/dacp and static_cp/dacp. On a 2-core
machine the ranks share cores with gloo's I/O threads, so overlap gains are small and noisy.
"""

from __future__ import annotations

import math

MIXES = ("long-tail", "bimodal")


def mix_lengths(mix: str, num: int, bimodal_scale: float, max_len: int, seed: int) -> list[int]:
    """long-tail: LMsysChat1M-like lengths; bimodal: ChatQA2-like (short chats + 8K-32K documents)."""
    from scheduling import sample_lengths

    name = {"long-tail": "lmsys", "bimodal": "chatqa2"}[mix]
    raw = sample_lengths(name, num, seed)
    scale = bimodal_scale if mix == "bimodal" else 1.0
    return [int(min(max_len, max(1, round(float(n) * scale)))) for n in raw]


def plans_for(lengths: list[int], cp: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    from scheduling import CostModel, DacpPlan, SchedulingError, plan_dacp

    cost = CostModel.from_model_dims(hidden_size=heads * head_dim, kv_hidden_size=kv_heads * head_dim,
                                     num_layers=1)
    # BucketSize 10% above an even split, and below the longest sequence: the long ones must be
    # sharded, the short ones stay local, as in a real DACP micro-batch.
    bucket = max(math.ceil(1.1 * sum(lengths) / cp), math.ceil(max(lengths) / cp) + 2)
    bucket = min(bucket, max(max(lengths) - 1, math.ceil(max(lengths) / cp) + 2))
    while True:
        try:
            dacp = plan_dacp(lengths, cp_size=cp, bucket_size=bucket, cost=cost)
            break
        except SchedulingError:
            bucket = math.ceil(bucket * 1.1)
    static = DacpPlan(local=((),) * cp, distributed=tuple(range(len(lengths))))
    return {"dacp": dacp, "serialized": dacp, "static_cp": static}


def _inputs(rank: int, world: int, plan, lengths: list[int], dims: tuple):
    import torch

    from workers.batch import build_rank_batch

    heads, kv_heads, head_dim = dims
    ids = [[0] * n for n in lengths]
    index = build_rank_batch(plan, ids, ids, cp_rank=rank, cp_size=world).to("cpu").index  # once, as training
    gen = torch.Generator().manual_seed(rank)
    return index, [torch.randn(index.layout.num_tokens, h, head_dim, generator=gen).requires_grad_()
                   for h in (heads, kv_heads, kv_heads)]


def _bench_rank(rank: int, world: int, cases: dict, dims: tuple, repeats: int) -> dict:
    """Repeats interleave the variants (a, b, c, a, b, c, ...) so machine noise hits all alike."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from workers.attention import AttentionRuntime, dacp_attention

    group = dist.new_group(list(range(world)))
    runtime = AttentionRuntime.create(group, torch.device("cpu"))  # gloo ranks: the CPU kernel
    results: dict[str, dict[str, float]] = {}
    for mix, (lengths, plans) in cases.items():
        inputs = {name: _inputs(rank, world, plan, lengths, dims) for name, plan in plans.items()}
        times: dict[str, list[float]] = {name: [] for name in plans}
        for it in range(repeats + 1):
            for name, (index, (q, k, v)) in inputs.items():
                dist.barrier(group=group)
                start = time.perf_counter()
                out, _ = dacp_attention(q, k, v, index, runtime, overlap=name != "serialized")
                out.backward(torch.ones_like(out))
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                if it:  # the first round is a warm-up
                    times[name].append(float(elapsed))
        results[mix] = {name: statistics.median(t) for name, t in times.items()}
    return results


def run_benchmark(*, cp: int, heads: int, kv_heads: int, head_dim: int, num_seqs: int, max_len: int,
                  bimodal_scale: float, repeats: int, seed: int) -> dict:
    """Time every variant on every mix over `cp` gloo processes; the report `bench attention` prints."""
    from workers.tools.launch import run_workers

    if cp < 2:
        raise ValueError("bench attention needs --cp >= 2 (there is no ring to overlap with one rank)")
    dims = (heads, kv_heads, head_dim)
    cases = {}
    for mix in MIXES:
        lengths = mix_lengths(mix, num_seqs, bimodal_scale, max_len, seed)
        cases[mix] = (lengths, plans_for(lengths, cp, *dims))
    timings = run_workers(_bench_rank, cp, args=(cases, dims, repeats), backend="gloo")[0]
    report = {"cp": cp, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "mixes": {}}
    for mix, t in timings.items():
        lengths, plans = cases[mix]
        report["mixes"][mix] = {
            "lengths": lengths, "distributed": list(plans["dacp"].distributed),
            "ms": {k: round(v * 1e3, 2) for k, v in t.items()},
            "serialized_over_dacp": round(t["serialized"] / t["dacp"], 3),
            "static_cp_over_dacp": round(t["static_cp"] / t["dacp"], 3),
        }
    return report
