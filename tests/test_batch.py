"""Batch assembly: every real token lands on exactly one rank with its true position and the target of
the WHOLE sequence's shift; shards are zigzag-balanced; pads carry no target; empty plans work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling import DacpPlan
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


@settings(max_examples=40, deadline=None)
@given(plans())
def test_rank_streams_cover_every_token_once(case) -> None:
    cp, lengths, plan = case
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
