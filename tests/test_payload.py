"""Per-rank payloads: every sample reaches exactly the ranks that need it, and counts are global."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling import CostModel, plan_step
from scheduling.payload import IGNORE_INDEX, Cursor, Sample, build_rank_payloads

COST = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=32, num_layers=2)


def _samples(lengths: list[int]) -> list[Sample]:
    out = []
    for i, length in enumerate(lengths):
        ids = np.arange(length, dtype=np.int64) + 1000 * i
        labels = ids.copy()
        labels[: length // 2] = IGNORE_INDEX  # a "prompt" half without loss
        out.append(Sample(sample_id=100 + i, input_ids=ids, labels=labels))
    return out


@pytest.mark.parametrize("policy", ["skrull", "static_cp", "sorted"])
def test_payloads_cover_every_sample_once_per_dp_rank(policy: str) -> None:
    lengths = [3, 900, 40, 17, 1200, 5, 64, 300, 2, 777, 31, 8]
    samples = _samples(lengths)
    plan = plan_step(policy, lengths, dp_size=2, cp_size=3, bucket_size=700, cost=COST)
    payloads = build_rank_payloads(plan, samples, step=4, epoch=1, cursor=Cursor(epoch=1, rows=12),
                                   plan_ms=0.5)
    assert set(payloads) == {(d, c) for d in range(2) for c in range(3)}
    expected_labels = sum(int(np.count_nonzero(s.labels[1:] != IGNORE_INDEX)) for s in samples)
    seen: list[int] = []
    for (dp, cp), payload in payloads.items():
        assert payload.global_label_tokens == expected_labels
        assert payload.global_tokens == sum(lengths)
        assert len(payload.micro_batches) == plan.num_micro_batches
        for mb, planned in zip(payload.micro_batches, plan.micro_batches[dp], strict=True):
            needed = set(planned.local[cp]) | set(planned.distributed)
            assert set(mb.input_ids) == needed  # nothing missing, nothing another rank keeps locally
            for i in needed:
                np.testing.assert_array_equal(mb.input_ids[i], samples[i].input_ids)
                np.testing.assert_array_equal(mb.labels[i], samples[i].labels)
            if cp == 0:
                seen.extend(planned.indices)
    assert sorted(seen) == list(range(len(lengths)))
    ids_by_dp = payloads[0, 0].sample_ids_by_dp_rank
    assert sorted(i for ids in ids_by_dp for i in ids) == [100 + i for i in range(len(lengths))]


def test_sample_rejects_mismatched_labels() -> None:
    with pytest.raises(ValueError, match="equal and non-empty"):
        Sample(sample_id=0, input_ids=np.arange(3), labels=np.arange(2))


def test_a_global_batch_without_label_tokens_is_an_error() -> None:
    """Never a silent 0.0 loss: the guard names the knobs that can empty a batch."""
    lengths = [5, 9, 1]
    samples = [Sample(sample_id=i, input_ids=np.arange(n), labels=np.full(n, IGNORE_INDEX))
               for i, n in enumerate(lengths)]
    # The one label token of the last sample is its first token: the loss never sees it (shifted away).
    samples[2] = Sample(sample_id=2, input_ids=np.arange(1), labels=np.zeros(1, dtype=np.int64))
    plan = plan_step("skrull", lengths, dp_size=1, cp_size=1, bucket_size=100, cost=COST)
    with pytest.raises(ValueError, match=r"step 7: .*no label token.*data.labels.*data.too_long.*"
                                         r"data.truncate_side"):
        build_rank_payloads(plan, samples, step=7, epoch=0, cursor=Cursor(epoch=0, rows=3), plan_ms=0.0)
    samples[1] = _samples([9])[0]  # one sample with label tokens is enough
    assert build_rank_payloads(plan, samples, step=7, epoch=0, cursor=Cursor(epoch=0, rows=3),
                               plan_ms=0.0)[0, 0].global_label_tokens == 5


def test_statuses_truncated_empty_is_counted_not_trained() -> None:
    from scheduling.payload import ROW_STATUSES, USABLE_STATUSES

    assert "truncated_empty" in ROW_STATUSES and "truncated_empty" not in USABLE_STATUSES
    assert set(USABLE_STATUSES) == {"ok", "truncated"} and set(USABLE_STATUSES) <= set(ROW_STATUSES)
