"""DACP attention (local varlen + zigzag ring over gloo) vs PyTorch SDPA on the unsharded sequences.

One spawn per CP size (2, 3, 4); each process runs every case and returns its shard of out, lse, dq,
dk, dv; the parent scatters them back by the batch's inverse mapping and compares with SDPA per
sequence. Tolerances: fp32 1e-5 abs + 1e-5 rel (the aten CPU flash op itself is ~5e-7 from SDPA, and
the ring adds only fp32 log-sum-exp merges and fp32 dK/dV sums over <= 4 blocks); bf16 2.5e-2 abs + rel
against an fp32 reference on the same bf16-rounded inputs (bf16 keeps 8 mantissa bits, ~4e-3 per op).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mp_utils import excess, sdpa_reference

from workers.batch import build_rank_batch
from workers.tools.launch import run_workers

SCALE = 0.3
TOL = {"fp32": 1e-5, "bf16": 2.5e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Plan:
    def __init__(self, local, distributed):
        self.local, self.distributed = tuple(map(tuple, local)), tuple(distributed)


def _cases(cp: int) -> list[dict]:
    rng = np.random.default_rng(cp)
    cases = []

    def add(lengths, local, dist, heads=4, groups=2, dtype="fp32"):
        cases.append(dict(lengths=list(lengths), local=local, dist=dist, heads=heads, groups=groups,
                          dtype=dtype, seed=len(cases) + 100 * cp))

    lengths = [int(x) for x in rng.integers(1, 40, size=2 * cp)]
    add(lengths, [list(range(r, len(lengths), cp)) for r in range(cp)], [])              # all local
    add(lengths, [[] for _ in range(cp)], list(range(len(lengths))))                      # all distributed
    add([1, 2, 1, 2], [[] for _ in range(cp)], [0, 1, 2, 3], heads=2, groups=2)  # shorter than N, MHA
    primes = [2, 3, 5, 7, 11, 13, 17, 31, 37, 53]
    local = [[] for _ in range(cp)]
    for i, r in enumerate(range(1, cp)):                                                  # rank 0: no local
        local[r] = [i]
    add(primes, local, list(range(cp - 1, len(primes))), heads=4, groups=1)                # MQA
    add([9, 64, 3, 41, 1], [[0, 2]] + [[] for _ in range(cp - 1)], [1, 3, 4], heads=4, groups=4)
    add([23, 50, 6, 33], [[2]] + [[] for _ in range(cp - 1)], [0, 1, 3], dtype="bf16")      # bf16
    add([5], [[] for _ in range(cp)], [], heads=2, groups=1)  # empty on every rank
    for _ in range(3):  # random mixes: random lengths, random local rank or distributed per sequence
        lengths = [int(x) for x in rng.integers(1, 70, size=int(rng.integers(1, 9)))]
        where = rng.integers(-1, cp, size=len(lengths))
        heads, groups = [(4, 2), (4, 4), (6, 3), (4, 1)][int(rng.integers(0, 4))]
        add(lengths, [[i for i, w in enumerate(where) if w == r] for r in range(cp)],
            [i for i, w in enumerate(where) if w == -1], heads=heads, groups=groups)
    return cases


def _full_tensors(case: dict) -> dict[str, list[torch.Tensor]]:
    """The unsharded per-sequence q, k, v, dout, identical in every process (seeded)."""
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    h, g, d = case["heads"], case["groups"], 8
    out: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": [], "dout": []}
    for n in case["lengths"]:
        for name, heads in (("q", h), ("k", g), ("v", g), ("dout", h)):
            out[name].append(torch.randn(n, heads, d, generator=gen).to(dtype))
    return out


def _stream(parts: list[torch.Tensor], batch, pad_fill: str) -> torch.Tensor:
    real = batch.seq_index >= 0
    shape = (batch.num_tokens, *parts[0].shape[1:])
    x = torch.randn(shape) if pad_fill == "random" else torch.zeros(shape)
    x = x.to(parts[0].dtype)
    for t in torch.nonzero(real).flatten().tolist():
        x[t] = parts[int(batch.seq_index[t])][int(batch.position_ids[t])]
    return x


def _groups_info(rank: int, world: int) -> dict:
    """ParallelGroups with dp=2 x cp=world/2: which world ranks each of this rank's groups holds."""
    import torch.distributed as dist

    from workers.distributed import ParallelGroups

    groups = ParallelGroups.create(world // 2)
    # The CP group's ring communicator is built with the group (None when the CP group has one rank).
    comm = groups.attention.comm
    info = {"dp_rank": groups.dp_rank, "cp_rank": groups.cp_rank,
            "ring": None if comm is None else [comm.size, comm.rank, comm.prev_peer, comm.next_peer]}
    for name in ("cp_group", "world_group"):
        members = torch.zeros(world)
        members[rank] = 1
        dist.all_reduce(members, group=getattr(groups, name))
        info[name] = torch.nonzero(members).flatten().tolist()
    try:
        ParallelGroups.create(world + 1)
    except ValueError as err:
        info["error"] = str(err)
    return info


def _worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist

    from workers.attention import AttentionRuntime, dacp_attention

    group = dist.new_group(list(range(world)))
    runtime = AttentionRuntime.create(group, torch.device("cpu"))  # once, reused by every case
    results: list = [_groups_info(rank, world) if world % 2 == 0 else None]
    for case in cases:
        full = _full_tensors(case)
        ids = [[0] * n for n in case["lengths"]]
        batch = build_rank_batch(Plan(case["local"], case["dist"]), ids, ids, cp_rank=rank, cp_size=world)
        q, k, v = (_stream(full[n], batch, "random").requires_grad_() for n in ("q", "k", "v"))
        # Pad rows get zero upstream gradient: in a model no loss depends on them.
        dout = _stream(full["dout"], batch, "zero")
        out, lse = dacp_attention(q, k, v, batch.layout, runtime, scale=SCALE)
        out.backward(dout)
        results.append(dict(seq=batch.seq_index, pos=batch.position_ids, out=out.detach(), lse=lse.T,
                            dq=q.grad, dk=k.grad, dv=v.grad))
    return results


def _check_cp(cp: int) -> list[str]:
    cases = _cases(cp)
    per_rank = run_workers(_worker, cp, args=(cases,), backend="gloo")
    failures = _check_groups(cp, [r[0] for r in per_rank])
    per_rank = [r[1:] for r in per_rank]
    for c, case in enumerate(cases):
        full = _full_tensors(case)
        refs = [sdpa_reference(*(full[n][i] for n in ("q", "k", "v", "dout")), SCALE)
                for i in range(len(case["lengths"]))]
        tol = TOL[case["dtype"]]
        seen = sorted((int(s), int(p)) for res in (r[c] for r in per_rank)
                      for s, p in zip(res["seq"], res["pos"], strict=True) if s >= 0)
        planned = [i for rank in case["local"] for i in rank] + case["dist"]
        expected = sorted((i, p) for i in planned for p in range(case["lengths"][i]))
        if seen != expected:
            failures.append(f"cp={cp} case {c}: tokens covered {len(seen)} != expected {len(expected)}")
        for res in (r[c] for r in per_rank):
            real = torch.nonzero(res["seq"] >= 0).flatten().tolist()
            for name in ("out", "lse", "dq", "dk", "dv"):
                ours = torch.stack([res[name][t] for t in real]) if real else torch.zeros(0)
                ref = (torch.stack([refs[int(res["seq"][t])][name][int(res["pos"][t])] for t in real])
                       if real else torch.zeros(0))
                bad = excess(ours, ref, tol, tol)
                if bad > 0:
                    failures.append(f"cp={cp} case {c} ({case['dtype']}, lengths={case['lengths']}, "
                                    f"local={case['local']}, dist={case['dist']}): {name} exceeds "
                                    f"tolerance {tol} by {bad:.3g}")
    return failures


def _check_groups(world: int, infos: list) -> list[str]:
    if world % 2:
        return []
    cp = world // 2
    want = [{"dp_rank": r // cp, "cp_rank": r % cp, "cp_group": [r // cp * cp + c for c in range(cp)],
             "world_group": list(range(world)),
             # [size, cp_rank, previous and next world rank] of the ring inside the CP group
             "ring": None if cp == 1 else [cp, r % cp, base + (r - 1) % cp, base + (r + 1) % cp]}
            for r, base in ((r, r // cp * cp) for r in range(world))]
    got = [{k: v for k, v in info.items() if k != "error"} for info in infos]
    errors = [] if got == want else [f"ParallelGroups(2, {cp}): got {got}, want {want}"]
    if not all("parallel.num_workers" in info.get("error", "") for info in infos):
        errors.append("ParallelGroups.create(world + 1) raised no ValueError naming parallel.num_workers")
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_dacp_ring_matches_sdpa(cp: int) -> None:
    failures = _check_cp(cp)
    assert not failures, "\n".join(failures)
