"""Batch assembly: every real token lands on exactly one rank with its true position and the target of
the WHOLE sequence's shift; shards are zigzag-balanced; pads carry no target; empty plans work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling import DacpPlan, SubgroupShards
from workers.batch import IGNORE_INDEX, build_rank_batch, padded_length


@st.composite
def plans(draw):
    cp = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 40), min_size=0, max_size=8))
    where = [draw(st.integers(-1, cp - 1)) for _ in lengths]  # -1: distributed
    local = tuple(tuple(i for i, w in enumerate(where) if w == r) for r in range(cp))
    dist = tuple(i for i, w in enumerate(where) if w == -1)
    return cp, lengths, DacpPlan(local=local, distributed=dist)


def _data(lengths, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 1000, n).tolist() for n in lengths]
    labels = [[t if rng.random() < 0.7 else IGNORE_INDEX for t in seq] for seq in ids]
    return ids, labels


@st.composite
def degree_plans(draw):
    """Plans with per-sequence CP degrees: each sequence local, distributed or on an aligned subgroup."""
    cp = draw(st.sampled_from([2, 3, 4, 6, 8]))
    lengths = draw(st.lists(st.integers(1, 40), min_size=0, max_size=10))
    degrees = [d for d in range(1, cp + 1) if cp % d == 0]
    local: list[list[int]] = [[] for _ in range(cp)]
    dist: list[int] = []
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(lengths)):
        d = draw(st.sampled_from(degrees))
        g = draw(st.integers(0, cp // d - 1))
        if d == 1:
            local[g].append(i)
        elif d == cp:
            dist.append(i)
        else:
            groups.setdefault((d, g), []).append(i)
    partial = tuple(SubgroupShards(degree=d, group=g, indices=tuple(groups[(d, g)]))
                    for d, g in sorted(groups, key=lambda k: (-k[0], k[1])))
    return cp, lengths, DacpPlan(local=tuple(map(tuple, local)), distributed=tuple(dist), partial=partial)


@settings(max_examples=40, deadline=None)
@given(plans())
def test_rank_streams_cover_every_token_once(case) -> None:
    _check_streams(*case)


@settings(max_examples=60, deadline=None)
@given(degree_plans())
def test_streams_with_cp_degrees_cover_every_token_once_within_the_planned_tokens(case) -> None:
    """Per-sequence CP degrees: every token once, with its target; each rank's stream holds
    DacpPlan.rank_tokens up to the zigzag padding (2 * ceil(S / 2d) vs the plan's ceil(S / d): at most one
    token more per sharded sequence), and its layout has one ring part per degree of partial_on(r)."""
    cp, lengths, plan = case
    _check_streams(cp, lengths, plan)
    ids, labels = _data(lengths)
    planned = plan.rank_tokens(lengths)
    for r in range(cp):
        b = build_rank_batch(plan, ids, labels, cp_rank=r, cp_size=cp)
        entries = plan.partial_on(r)
        sharded = len(plan.distributed) + sum(len(e.indices) for e in entries)
        assert planned[r] <= b.num_tokens <= planned[r] + sharded
        assert [p.degree for p in b.layout.partial] == [e.degree for e in entries]
        for part, entry in zip(b.layout.partial, entries, strict=True):
            assert part.chunk_lens == tuple(padded_length(lengths[i], entry.degree) // (2 * entry.degree)
                                            for i in entry.indices)
        assert b.layout.num_tokens == b.num_tokens
        # The ring parts' tokens sit after the local ones, in plan order: distributed, then each entry.
        offset = b.layout.num_local_tokens
        for part, indices in zip(b.layout.rings, [plan.distributed] + [e.indices for e in entries],
                                 strict=True):
            seqs = b.seq_index[offset:offset + part.num_tokens]
            assert set(seqs[seqs >= 0].tolist()) <= set(indices)
            offset += part.num_tokens


def _check_streams(cp, lengths, plan) -> None:
    ids, labels = _data(lengths)
    seen: dict[tuple[int, int], int] = {}
    total_labels = 0
    for r in range(cp):
        b = build_rank_batch(plan, ids, labels, cp_rank=r, cp_size=cp)
        assert b.layout.num_tokens == b.num_tokens == b.position_ids.numel() == b.targets.numel()
        assert b.num_label_tokens == int((b.targets != IGNORE_INDEX).sum())
        total_labels += b.num_label_tokens
        for t in range(b.num_tokens):
            s, p = int(b.seq_index[t]), int(b.position_ids[t])
            if s < 0:  # pad: no target, sits past the end of a distributed sequence
                assert int(b.targets[t]) == IGNORE_INDEX
                continue
            seen[(s, p)] = seen.get((s, p), 0) + 1
            assert int(b.input_ids[t]) == ids[s][p]
            want = labels[s][p + 1] if p + 1 < lengths[s] else IGNORE_INDEX
            assert int(b.targets[t]) == want
    planned = [i for i in plan.indices]
    assert seen == {(i, p): 1 for i in planned for p in range(lengths[i])}
    assert total_labels == sum(sum(1 for t in labels[i][1:] if t != IGNORE_INDEX) for i in planned)


def test_zigzag_layout_drawing() -> None:
    """The docstring's example: S_d = 10, N = 2 -> padded 12, chunks of 3, rank 0 holds 0 and 3."""
    ids, labels = [[1] * 4, [2] * 2, list(range(10, 20))], [[1] * 4, [2] * 2, list(range(10, 20))]
    plan = DacpPlan(local=((0, 1), ()), distributed=(2,))
    b0 = build_rank_batch(plan, ids, labels, cp_rank=0, cp_size=2)
    b1 = build_rank_batch(plan, ids, labels, cp_rank=1, cp_size=2)
    assert b0.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 9, 10, 11]
    assert b1.position_ids.tolist() == [3, 4, 5, 6, 7, 8]
    assert b0.targets[8].item() == 13  # d2 predicts d3, which lives on rank 1
    assert b0.targets[-3:].tolist() == [IGNORE_INDEX] * 3  # last token and two pads
    assert b0.layout.local_lens == (4, 2) and b0.layout.dist_chunk_lens == (3,)
    assert padded_length(1, 4) == 8 and padded_length(9, 2) == 12


def test_subgroup_shards_drawing() -> None:
    """workers/batch.py's drawing: N = 4, a degree-2 entry of group 1 holding e (S_e = 7, padded to 8, c = 2):
    rank 2 (j = 0) holds chunks 0 and 3, rank 3 (j = 1) chunks 1 and 2; ranks 0 and 1 hold nothing of it."""
    ids = [[5] * 3, list(range(10, 17)), list(range(20, 29))]
    plan = DacpPlan(local=((0,), (), (), ()), distributed=(2,),
                    partial=(SubgroupShards(degree=2, group=1, indices=(1,)),))
    b = [build_rank_batch(plan, ids, ids, cp_rank=r, cp_size=4) for r in range(4)]
    # The degree-4 sequence (S = 9, padded 16, c = 2) comes first on every rank, then e on ranks 2 and 3.
    assert b[2].position_ids.tolist() == [4, 5, 10, 11, 0, 1, 6, 7]
    assert b[3].position_ids.tolist() == [6, 7, 8, 9, 2, 3, 4, 5]
    assert b[2].seq_index[4:].tolist() == [1, 1, 1, -1] and b[3].seq_index[4:].tolist() == [1, 1, 1, 1]
    assert b[2].targets[4:].tolist() == [11, 12, IGNORE_INDEX, IGNORE_INDEX]  # e6 is the last token
    assert b[3].targets[4:].tolist() == [13, 14, 15, 16]  # e5 predicts e6, held by rank 2
    assert [len(x.layout.partial) for x in b] == [0, 0, 1, 1]
    assert b[2].layout.partial[0].degree == 2 and b[2].layout.partial[0].chunk_lens == (2,)
    assert b[0].num_tokens == 3 + 4 and b[1].num_tokens == 4
    # The device index: one ring index per part, stream rows after the locals, views of one copy each.
    index = b[2].to("cpu").index
    assert [(r.degree, r.start, r.stop) for r in index.rings] == [(4, 0, 4), (2, 4, 8)]
    sub = index.rings[1]
    assert sub.first.tolist() == [0, 1] and sub.second.tolist() == [2, 3] and sub.diag.cu_q.tolist() == [0, 4]
    assert sub.kfirst.cu_k.tolist() == [0, 2] and sub.qsecond.cu_q.tolist() == [0, 2]
    assert sub.diag.cu_q.untyped_storage().data_ptr() == index.local.cu_q.untyped_storage().data_ptr()
    assert sub.first.untyped_storage().data_ptr() == index.dist.first.untyped_storage().data_ptr()


def test_the_device_side_index_is_built_once_per_micro_batch() -> None:
    """RankBatch.to indexes the layout (cu_seqlens, max lengths, zigzag rows) and the label rows once;
    moving the moved batch again (the forward does) reuses it instead of rebuilding."""
    ids = [[1] * 4, [2] * 2, list(range(10, 20))]
    labels = [[IGNORE_INDEX, 1, 1, 1], [2, 2], list(range(10, 20))]
    plan = DacpPlan(local=((0, 1), ()), distributed=(2,))
    host = build_rank_batch(plan, ids, labels, cp_rank=0, cp_size=2)
    assert host.index is None
    assert host.label_rows.tolist() == torch.nonzero(host.targets != IGNORE_INDEX).flatten().tolist()
    moved = host.to("cpu")
    assert moved.to("cpu") is moved and moved.to(torch.device("cpu")) is moved
    index = moved.index
    assert index.local.cu_q.dtype == torch.int32 and index.local.cu_q.tolist() == [0, 4, 6]
    assert (index.local.max_q, index.diag.max_q, index.kfirst.max_k) == (4, 6, 3)
    assert index.diag.cu_q.tolist() == [0, 6] and index.kfirst.cu_k.tolist() == [0, 3]
    assert index.qsecond.cu_q.tolist() == [0, 3] and not index.qsecond.causal and index.diag.causal
    assert index.first.tolist() == [0, 1, 2] and index.second.tolist() == [3, 4, 5]  # rows of the shards
    # One device copy of all bounds: the blocks are views into it.
    assert index.local.cu_q.untyped_storage().data_ptr() == index.kfirst.cu_k.untyped_storage().data_ptr()


def test_empty_plan_and_errors() -> None:
    b = build_rank_batch(DacpPlan.empty(3), [], [], cp_rank=2, cp_size=3)
    assert b.num_tokens == 0 and b.num_label_tokens == 0 and b.input_ids.dtype == torch.int64
    with pytest.raises(ValueError, match="cp_size"):
        build_rank_batch(DacpPlan.empty(2), [], [], cp_rank=0, cp_size=3)
    with pytest.raises(ValueError, match="labels"):
        build_rank_batch(DacpPlan(local=((0,),)), [[1, 2]], [[1]], cp_rank=0, cp_size=1)
