"""DACP attention with per-sequence CP degrees (docs/design.md §13) vs PyTorch SDPA per sequence.

CP = 4 over gloo, one spawn: the ranks build their groups with ParallelGroups.create (the CP group plus its
aligned subgroups {0,1} {2,3} of degree 2) and run micro-batches holding local sequences (degree 1), one
or two degree-2 subgroup rings and the degree-4 ring at once, lengths not multiples of 2d; each returns its
shard of out, lse, dq, dk, dv, which the parent scatters back by the batch's inverse mapping and compares
with SDPA on the whole sequence. fp32 tolerance 1e-5 abs + rel, as tests/test_attention_ring.py (the rings
add only fp32 log-sum-exp merges and fp32 dK/dV sums). The round-robin driver of the rings is checked
in-process: every ring's first transfer is posted before the local attention, and no ring runs to its end
before the others start.
"""

from __future__ import annotations

import pytest
import torch
from mp_utils import excess, sdpa_reference

from scheduling import DacpPlan, SubgroupShards
from workers.batch import build_rank_batch
from workers.tools.launch import run_workers

CP = 4
SCALE = 0.3
TOL = 1e-5


def _plan(local, dist=(), partial=()) -> DacpPlan:
    return DacpPlan(local=tuple(map(tuple, local)), distributed=tuple(dist),
                    partial=tuple(SubgroupShards(degree=d, group=g, indices=tuple(i)) for d, g, i in partial))


# (lengths, plan, heads, kv heads, overlap): indices in the plan refer to lengths.
CASES = [
    # degrees 1, 2 (both subgroups) and 4 in one micro-batch; 37 % 8, 13 % 4, 6 % 4, 23 % 4 != 0
    ([5, 9, 3, 11, 37, 13, 6, 23],
     _plan([[0], [1], [], [2, 3]], [4], [(2, 0, [5, 6]), (2, 1, [7])]), 4, 2, True),
    # the same work serialized (overlap=False: local first, then each ring alone)
    ([5, 9, 3, 11, 37, 13, 6, 23],
     _plan([[0], [1], [], [2, 3]], [4], [(2, 0, [5, 6]), (2, 1, [7])]), 4, 2, False),
    # subgroup rings only (no degree-4 sequence); rank 3 holds no token at all; MQA
    ([10, 1, 7, 2],
     _plan([[], [], [0], []], [], [(2, 0, [1, 2, 3])]), 4, 1, True),
    # one subgroup ring beside the degree-4 ring, sequences shorter than 2d (mostly pad), MHA
    ([2, 1, 30, 3, 50],
     _plan([[3], [], [], []], [2, 4], [(2, 1, [0, 1])]), 2, 2, True),
]


def _full_tensors(lengths: list[int], heads: int, groups: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """The unsharded per-sequence q, k, v, dout, identical in every process (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": [], "dout": []}
    for n in lengths:
        for name, h in (("q", heads), ("k", groups), ("v", groups), ("dout", heads)):
            out[name].append(torch.randn(n, h, 8, generator=gen))
    return out


def _stream(parts: list[torch.Tensor], batch, pad: str) -> torch.Tensor:
    """One rank's packed stream of `parts` (pads random or zero)."""
    shape = (batch.num_tokens, *parts[0].shape[1:])
    x = torch.randn(shape) if pad == "random" else torch.zeros(shape)
    for t in torch.nonzero(batch.seq_index >= 0).flatten().tolist():
        x[t] = parts[int(batch.seq_index[t])][int(batch.position_ids[t])]
    return x


def _members(group, rank: int, world: int) -> list[int]:
    import torch.distributed as dist

    members = torch.zeros(world)
    members[rank] = 1
    dist.all_reduce(members, group=group)
    return torch.nonzero(members).flatten().tolist()


def _worker(rank: int, world: int, cases: list) -> dict:
    from workers.attention import dacp_attention
    from workers.distributed import ParallelGroups

    groups = ParallelGroups.create(world)  # the CP group and its subgroups, as a training worker makes them
    runtime = groups.attention
    rings = runtime.subgroup_comms
    info = {"subgroups": {d: _members(g, rank, world) for d, g in groups.subgroups.items()},
            "rings": {d: [c.size, c.rank, c.prev_peer, c.next_peer] for d, c in rings.items()}}
    results = []
    for c, (lengths, plan, heads, kv_heads, overlap) in enumerate(cases):
        full = _full_tensors(lengths, heads, kv_heads, seed=c)
        ids = [[0] * n for n in lengths]
        batch = build_rank_batch(plan, ids, ids, cp_rank=rank, cp_size=world).to("cpu")
        q, k, v = (_stream(full[n], batch, "random").requires_grad_() for n in ("q", "k", "v"))
        dout = _stream(full["dout"], batch, "zero")  # pads: no loss depends on them
        out, lse = dacp_attention(q, k, v, batch.index, runtime, scale=SCALE, overlap=overlap)
        out.backward(dout)
        results.append(dict(seq=batch.seq_index, pos=batch.position_ids, out=out.detach(), lse=lse.T,
                            dq=q.grad, dk=k.grad, dv=v.grad))
    return {"info": info, "results": results}


@pytest.mark.slow  # CP = 4 processes, like tests/test_attention_ring.py
def test_degrees_1_2_4_in_one_micro_batch_match_sdpa() -> None:
    per_rank = run_workers(_worker, CP, args=(CASES,), backend="gloo")
    # Degree-2 subgroups {0,1} {2,3}: each rank's ring runs inside its own pair.
    for rank, got in enumerate(per_rank):
        pair = [rank // 2 * 2, rank // 2 * 2 + 1]
        peer = pair[1 - rank % 2]
        assert got["info"] == {"subgroups": {2: pair}, "rings": {2: [2, rank % 2, peer, peer]}}, rank
    worst: dict[str, float] = {}
    for c, (lengths, plan, heads, kv_heads, _) in enumerate(CASES):
        full = _full_tensors(lengths, heads, kv_heads, seed=c)
        refs = [sdpa_reference(*(full[n][i] for n in ("q", "k", "v", "dout")), SCALE)
                for i in range(len(lengths))]
        shards = [r["results"][c] for r in per_rank]
        seen = sorted((int(s), int(p)) for res in shards for s, p in zip(res["seq"], res["pos"], strict=True)
                      if s >= 0)
        assert seen == sorted((i, p) for i in plan.indices for p in range(lengths[i])), f"case {c}"
        for res in shards:
            real = torch.nonzero(res["seq"] >= 0).flatten().tolist()
            if not real:
                continue
            for name in ("out", "lse", "dq", "dk", "dv"):
                ours = torch.stack([res[name][t] for t in real])
                ref = torch.stack([refs[int(res["seq"][t])][name][int(res["pos"][t])] for t in real])
                worst[name] = max(worst.get(name, 0.0), float((ours.double() - ref.double()).abs().max()))
                assert excess(ours, ref, TOL, TOL) <= 0, f"case {c}: {name} off by {excess(ours, ref, 0, 0)}"
    print("max abs error vs SDPA:", {k: f"{v:.2e}" for k, v in worst.items()})


def test_rings_advance_round_robin_around_the_local_attention() -> None:
    """run_rings: round 0 posts every ring's first transfer, then the local work, then one step of each
    ring per round (a ring of 2 steps and one of 4 interleave; neither waits for the other to finish)."""
    from workers.attention.ring import run_rings

    log: list[str] = []

    def ring(name: str, steps: int):
        log.append(f"{name}:post")
        yield
        for step in range(steps):
            if step:
                yield
            log.append(f"{name}:{step}")
        return name

    assert run_rings([ring("A", 4), ring("B", 2)], lambda: log.append("local")) == ["A", "B"]
    assert log == ["A:post", "B:post", "local", "A:0", "B:0", "A:1", "B:1", "A:2", "A:3"]
    log.clear()
    serial = run_rings([ring("A", 2), ring("B", 2)], lambda: log.append("local"), concurrent=False)
    assert serial == ["A", "B"]
    assert log == ["local", "A:post", "A:0", "A:1", "B:post", "B:0", "B:1"]
    log.clear()
    assert run_rings([], lambda: log.append("local")) == [] and log == ["local"]
