"""data.shuffle without Ray: the epoch's visiting order (scheduling/order.py) and the planner's random
access to the tokenized rows (scheduling/row_table.py), checked against numpy's and pyarrow's own."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from scheduling.order import epoch_order, visit_order
from scheduling.row_table import RowTable


@pytest.mark.parametrize("num_rows", [0, 1, 2, 7, 1000])
def test_an_epoch_visits_every_row_exactly_once(num_rows: int) -> None:
    order = epoch_order(num_rows, seed=3, epoch=1)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(num_rows))


def test_the_order_is_numpys_generator_seeded_by_seed_and_epoch() -> None:
    for seed, epoch in [(0, 0), (0, 5), (12345, 2), (2**63 + 7, 1)]:
        expected = np.random.default_rng([seed, epoch]).permutation(500)
        assert epoch_order(500, seed, epoch).tolist() == expected.tolist()


def test_the_order_differs_between_epochs_and_seeds_and_not_between_calls() -> None:
    orders = {(seed, epoch): tuple(epoch_order(1000, seed, epoch)) for seed in (0, 1) for epoch in (0, 1, 2)}
    assert len(set(orders.values())) == len(orders)  # every (seed, epoch) its own permutation
    np.random.seed(99)  # the legacy global state plays no part
    assert tuple(epoch_order(1000, 1, 2)) == orders[1, 2]


def test_a_negative_seed_is_taken_modulo_2_to_the_64() -> None:
    assert epoch_order(100, -1, 0).tolist() == epoch_order(100, 2**64 - 1, 0).tolist()


def test_another_process_computes_the_same_order() -> None:
    """What a restarted planner (a new process, any worker count) recomputes for a resumed epoch."""
    code = "from scheduling.order import epoch_order; print(epoch_order(300, 7, 4).tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(epoch_order(300, 7, 4).tolist())


def test_without_shuffle_an_epoch_is_the_stream_order() -> None:
    assert visit_order(5, seed=1, epoch=3, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    assert visit_order(5, seed=1, epoch=3, shuffle=True).tolist() == epoch_order(5, 1, 3).tolist()


def _tokenized_rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ids = rng.integers(0, 1000, size=int(rng.integers(0, 12))).tolist()
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:] if ids else [],
                     "status": ["ok", "malformed", "truncated"][i % 3], "num_tokens": len(ids)})
    return rows


def _table(rows: list[dict]) -> pa.Table:
    """As app/data/ray_ops.py writes them: list<int32> ids and labels, string status."""
    return pa.table({"input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
                     "labels": pa.array([r["labels"] for r in rows], pa.list_(pa.int32())),
                     "status": pa.array([r["status"] for r in rows], pa.string()),
                     "num_tokens": pa.array([r["num_tokens"] for r in rows], pa.int64())})


def test_row_table_reads_every_row_as_pyarrow_does_across_blocks_chunks_and_slices() -> None:
    rows = _tokenized_rows(300)
    whole = _table(rows)
    # Blocks of uneven sizes, one of two chunks, an empty one, all slices of one table (offsets not at 0).
    blocks = [whole.slice(0, 40), pa.concat_tables([whole.slice(40, 25), whole.slice(65, 35)]),
              whole.slice(100, 0), whole.slice(100, 200)]
    assert blocks[1].column("input_ids").num_chunks == 2
    table = RowTable.from_tables(blocks)
    assert len(table) == 300
    reference = whole.to_pylist()  # pyarrow's own reading of the same rows
    for position in epoch_order(300, 5, 0):
        input_ids, labels = table.tokens(int(position))
        assert input_ids.dtype == np.int64 and input_ids.tolist() == reference[position]["input_ids"]
        assert labels.tolist() == reference[position]["labels"]
        assert table.status(int(position)) == reference[position]["status"]
    with pytest.raises(IndexError):
        table.tokens(300)


def test_row_table_reads_large_lists_and_rows_without_a_status() -> None:
    table = RowTable.from_tables([pa.table({"input_ids": pa.array([[1, 2], [3]], pa.large_list(pa.int64())),
                                            "labels": pa.array([[1, 2], [3]], pa.large_list(pa.int64()))})])
    assert [table.status(p) for p in range(2)] == ["ok", "ok"]
    assert table.tokens(1)[0].tolist() == [3]


def test_an_empty_stream_has_no_row() -> None:
    assert len(RowTable.from_tables([])) == 0
