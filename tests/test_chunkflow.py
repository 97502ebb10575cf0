"""The chunkflow policy's plans, their JSON, their modeled cost, and what the rest of the system does with
them.

Its step's exactness and memory bound are tests/test_chunkflow_step.py; its losses beside skrull's on the
same batches, over several training steps, are tests/test_bench_train.py's smoke run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.config import ConfigError, load_config
from scheduling import POLICIES, CostModel, DacpPlan, SchedulingError, StepPlan, plan_step, simulate
from scheduling.chunkflow import chunk_spans, chunkflow
from scheduling.payload import Cursor, Sample, build_rank_payloads
from scheduling.plans import ChunkSpan
from scheduling.refit import PlannedStep, StepTiming, refit

COST = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=16, num_layers=2, formula="model",
                                 intermediate_size=128, vocab_size=1000)
LENGTHS = [300, 40, 90, 10, 130, 25, 61, 7, 100, 100]  # C = 100: 300 -> 3 chunks, 130 -> 2


def _spans_by_rank(step: StepPlan) -> dict[tuple[int, int], list[tuple[tuple[int, ...], ChunkSpan | None]]]:
    out: dict[tuple[int, int], list] = {}
    for dp, rank in enumerate(step.micro_batches):
        for mb in rank:
            for cp, seqs in enumerate(mb.local):
                out.setdefault((dp, cp), []).append((seqs, mb.chunk_on(cp)))
    return out


def test_long_sequences_become_dependent_chunks_and_short_ones_packed_chunks() -> None:
    step = chunkflow(LENGTHS, dp_size=2, cp_size=2, bucket_size=100, keep=2)
    step.check(LENGTHS, 100)  # every sequence once, every chunk <= C, chunks cover their sequence
    assert "chunkflow" in POLICIES and step == plan_step("chunkflow", LENGTHS, dp_size=2, cp_size=2,
                                                         bucket_size=100, cost=COST, chunkflow_keep=2)
    slots = _spans_by_rank(step)
    chunked = {seqs[0]: [] for rank in slots.values() for seqs, span in rank if span is not None}
    assert set(chunked) == {0, 4}
    for (dp, cp), rank in slots.items():
        for seqs, span in rank:
            if span is not None:
                chunked[seqs[0]].append(((dp, cp), span))
    # every chunk of a sequence on one rank, in order, the first n - K recomputed
    assert [s for _, s in chunked[0]] == list(chunk_spans(300, 100, keep=2))
    assert [(s.start, s.stop, s.recompute) for _, s in chunked[0]] == [(0, 100, True), (100, 200, False),
                                                                         (200, 300, False)]
    assert [(s.start, s.stop, s.recompute) for _, s in chunked[4]] == [(0, 100, False), (100, 130, False)]
    assert len({rank for rank, _ in chunked[0]}) == 1 and len({rank for rank, _ in chunked[4]}) == 1
    # short sequences packed whole into standalone chunks of <= C tokens
    packs = [seqs for rank in slots.values() for seqs, span in rank if span is None and seqs]
    assert sorted(i for pack in packs for i in pack) == [1, 2, 3, 5, 6, 7, 8, 9]
    assert all(sum(LENGTHS[i] for i in pack) <= 100 for pack in packs)
    assert len(packs) == 5  # best-fit decreasing: 100, 100, 90+10, 61+25+7, 40
    # every CP rank is a ChunkFlow rank: LPT by tokens over the 4 ranks (items 300, 130, 100, 100, 100,
    # 93, 40: the 300-token sequence alone, then each item to the rank with the fewest tokens)
    tokens = {rank: sum(span.num_tokens if span else sum(LENGTHS[i] for i in seqs) for seqs, span in items)
              for rank, items in slots.items()}
    assert tokens == {(0, 0): 300, (0, 1): 130 + 40, (1, 0): 100 + 100, (1, 1): 100 + 93}


def test_keep_is_a_knob_checked_by_name() -> None:
    with pytest.raises(SchedulingError, match="scheduling.chunkflow_keep"):
        plan_step("chunkflow", LENGTHS, dp_size=1, cp_size=1, bucket_size=100, cost=COST, chunkflow_keep=0)
    with pytest.raises(ConfigError, match="scheduling.chunkflow_keep"):
        load_config(None, ["scheduling.chunkflow_keep=0"])
    config = load_config(None, ["scheduling.policy=chunkflow", "scheduling.bucket_size=100",
                                "parallel.cp_size=1", "data.max_length=4000"])
    assert config.max_sequence_length == 4000  # chunkflow cuts what exceeds C * N: no cap there
    skrull = load_config(None, ["scheduling.bucket_size=100", "parallel.cp_size=1", "data.max_length=4000"])
    assert skrull.max_sequence_length == 100


def test_plans_without_chunks_keep_their_json_and_chunk_plans_round_trip() -> None:
    for policy in POLICIES:
        step = plan_step(policy, LENGTHS[1:], dp_size=2, cp_size=2, bucket_size=100, cost=COST)
        text = json.dumps(step.to_dict())
        assert ("chunks" in text) == (policy == "chunkflow")
    step = chunkflow(LENGTHS, dp_size=1, cp_size=2, bucket_size=100)
    assert StepPlan.from_dict(json.loads(json.dumps(step.to_dict()))) == step


def test_malformed_chunk_runs_are_refused() -> None:
    def mb(span: ChunkSpan | None, seqs: tuple[int, ...] = (0,)) -> DacpPlan:
        return DacpPlan(local=(seqs,), chunks=(span,) if span else ())

    first = ChunkSpan(chunk=0, num_chunks=2, start=0, stop=4)
    second = ChunkSpan(chunk=1, num_chunks=2, start=4, stop=6)
    StepPlan(micro_batches=((mb(first), mb(second), mb(None, (1,))),)).check([6, 3], 4)
    with pytest.raises(ValueError, match="must follow"):
        StepPlan(micro_batches=((mb(first), mb(None, (1,)), mb(second)),))
    with pytest.raises(ValueError, match="without its chunk 0"):
        StepPlan(micro_batches=((mb(second), mb(None, (1,))),))
    with pytest.raises(ValueError, match="ends at chunk 0"):
        StepPlan(micro_batches=((mb(None, (1,)), mb(first)),))
    with pytest.raises(SchedulingError, match="not at its length"):
        StepPlan(micro_batches=((mb(first), mb(second)),)).check([7], 4)
    with pytest.raises(ValueError, match="exactly one sequence"):
        DacpPlan(local=((0, 1),), chunks=(first,))
    with pytest.raises(ValueError, match="shards no sequence"):
        DacpPlan(local=((0,), ()), distributed=(1,), chunks=(first, None))


def test_a_later_chunk_costs_more_and_the_chunks_sum_to_the_sequence() -> None:
    terms = [COST.chunk_flop_terms(300, s.start, s.stop, labels=150) for s in chunk_spans(300, 100, keep=1)]
    attention = [t["attention"] for t in terms]
    assert attention[0] < attention[1] < attention[2]
    assert terms[0]["linear"] == pytest.approx(terms[2]["linear"])
    assert sum(sum(t.values()) for t in terms) == pytest.approx(COST.flops(300, 150))
    # chunk i of c tokens after s keys: c*s + c(c+1)/2 query-key pairs, 4h FLOPs each per layer
    assert attention[2] == pytest.approx(2 * 4 * 64 * (100 * 200 + 100 * 101 / 2))


def test_simulate_charges_each_chunk_and_the_recompute_as_an_extra_forward() -> None:
    lengths = [300]
    keep_all = chunkflow(lengths, dp_size=1, cp_size=1, bucket_size=100, keep=3)
    keep_one = chunkflow(lengths, dp_size=1, cp_size=1, bucket_size=100, keep=1)
    b = COST.micro_batch_overhead_s(1)
    terms = [COST.chunk_flop_terms(300, s.start, s.stop) for s in chunk_spans(300, 100, keep=1)]
    expected = sum(COST.t_comp(sum(t.values())) + b for t in terms)
    assert simulate(keep_all, lengths, COST).step_s == pytest.approx(expected)
    recompute = sum(COST.t_forward(t["linear"] + t["attention"]) for t in terms[:2])
    assert simulate(keep_one, lengths, COST).step_s == pytest.approx(expected + recompute)
    assert simulate(keep_one, lengths, COST).num_micro_batches == 3


def test_the_online_fit_skips_chunkflow_steps() -> None:
    lengths = tuple(LENGTHS)
    plan = chunkflow(lengths, dp_size=2, cp_size=1, bucket_size=100)
    planned = {s: PlannedStep(plan=plan, lengths=lengths) for s in range(1, 5)}
    timings = [StepTiming(step=s, micro_batch_s=(0.01,) * plan.num_micro_batches, optimizer_s=0.001)
               for s in range(1, 5)]
    assert refit(COST, planned, timings, world=2) is None  # nothing to fit, nothing crashes


def test_payloads_list_a_chunked_sample_once_and_count_its_chunk_tokens() -> None:
    from workers.metrics import computed_tokens

    samples = [Sample(sample_id=10 + i, input_ids=np.arange(1, n + 1), labels=np.arange(1, n + 1))
               for i, n in enumerate(LENGTHS)]
    plan = chunkflow(LENGTHS, dp_size=1, cp_size=2, bucket_size=100)
    payloads = build_rank_payloads(plan, samples, step=1, epoch=0, cursor=Cursor(epoch=0, rows=10),
                                   plan_ms=0.0)
    assert sorted(payloads[0, 0].sample_ids_by_dp_rank[0]) == [10 + i for i in range(len(LENGTHS))]
    tokens = sum(computed_tokens(payloads[0, r]) for r in range(2))
    idle = sum(1 for mb in plan.micro_batches[0] for seqs in mb.local if not seqs)
    assert tokens == sum(LENGTHS) + idle


def test_the_workers_group_a_sequences_chunks_into_one_unit() -> None:
    from workers.chunkflow import micro_batch_units

    spans = list(chunk_spans(300, 100, keep=1))
    assert micro_batch_units([None, *spans, None]) == [[0], [1, 2, 3], [4]]
    with pytest.raises(ValueError, match="end before its last"):
        micro_batch_units([spans[0], None])
    with pytest.raises(ValueError, match="does not follow"):
        micro_batch_units([spans[0], spans[2]])
    with pytest.raises(ValueError, match="ends inside"):
        micro_batch_units(spans[:2])
