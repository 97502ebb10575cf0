"""The planner actor on a local Ray: payloads per rank and step, cursor, skipped rows, errors."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from scheduling import CostModel  # noqa: E402
from scheduling.actor import (  # noqa: E402
    PlannerActor,
    PlannerClient,
    PlannerData,
    PlannerError,
    PlannerSettings,
)
from scheduling.payload import Cursor, RankPayload  # noqa: E402

COST = CostModel.from_model_dims(hidden_size=64, kv_hidden_size=32, num_layers=2)


def fetch_payload(planner, step: int, dp_rank: int, cp_rank: int) -> RankPayload:
    return PlannerClient(planner).fetch(step, dp_rank, cp_rank).payload


def _rows(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        length = int(rng.integers(2, 300))
        status = "malformed" if i % 7 == 3 else "ok"
        ids = list(range(length)) if status == "ok" else []
        rows.append({"input_ids": ids, "labels": ids, "status": status})
    return rows


def _settings(**overrides) -> PlannerSettings:
    base = dict(policy="skrull", dp_size=2, cp_size=2, bucket_size=256, global_batch_size=6,
                total_steps=3, prefetch=1)
    return PlannerSettings(**(base | overrides))


def test_every_rank_gets_its_step_and_the_cursor_advances(local_ray) -> None:
    dataset = ray.data.from_items(_rows(40))
    planner = PlannerActor.remote(dataset, _settings(), COST)
    seen_by_step = {}
    for step in (1, 2, 3):
        payloads = {(d, c): fetch_payload(planner, step, d, c) for d in range(2) for c in range(2)}
        counts = {len(p.micro_batches) for p in payloads.values()}
        assert len(counts) == 1, f"unequal micro-batch counts {counts}"  # ZeRO-2 needs equal backwards
        ids = payloads[0, 0].sample_ids_by_dp_rank
        assert all(p.sample_ids_by_dp_rank == ids for p in payloads.values())
        seen_by_step[step] = sorted(i for per_dp in ids for i in per_dp)
        assert payloads[0, 0].cursor.rows == seen_by_step[step][-1] + 1
    everything = [i for ids in seen_by_step.values() for i in ids]
    assert len(everything) == 18 and len(set(everything)) == 18
    assert all(i % 7 != 3 for i in everything), "malformed rows must be skipped"
    stats = ray.get(planner.stats.remote())
    assert stats["planned_step"] == 3 and stats["error"] is None
    assert stats["rows_by_status"]["malformed"] >= 2


def test_resume_from_cursor_continues_with_the_next_rows(local_ray) -> None:
    dataset = ray.data.from_items(_rows(40))
    first = PlannerActor.remote(dataset, _settings(total_steps=2), COST)
    for step in (1, 2):
        payload = fetch_payload(first, step, 0, 0)
        for d in range(2):
            for c in range(2):
                if (d, c) != (0, 0):
                    fetch_payload(first, step, d, c)
    resumed = PlannerActor.remote(dataset, _settings(total_steps=1), COST, payload.cursor, 3)
    fresh = PlannerActor.remote(dataset, _settings(total_steps=3), COST)
    for step in (1, 2):
        for d in range(2):
            for c in range(2):
                fetch_payload(fresh, step, d, c)
    assert (fetch_payload(resumed, 3, 1, 1).sample_ids_by_dp_rank
            == fetch_payload(fresh, 3, 1, 1).sample_ids_by_dp_rank)


def test_a_dataset_without_usable_rows_is_a_clear_error(local_ray) -> None:
    rows = [{"input_ids": [], "labels": [], "status": "malformed"} for _ in range(5)]
    planner = PlannerActor.remote(ray.data.from_items(rows), _settings(), COST, Cursor(epoch=0, rows=0))
    # The actor re-raises the planning thread's error to every waiting worker as a PlannerError.
    with pytest.raises(ray.exceptions.RayTaskError, match="no usable row") as caught:
        fetch_payload(planner, 1, 0, 0)
    assert isinstance(caught.value.as_instanceof_cause(), PlannerError)


def test_steps_beyond_one_epoch_cycle_the_data(local_ray) -> None:
    planner = PlannerActor.remote(ray.data.from_items(_rows(10)), _settings(total_steps=4, prefetch=8), COST)
    payloads = [fetch_payload(planner, step, 0, 0) for step in range(1, 5)]
    # 9 usable rows an epoch, 6 a step: a step's epoch is that of the row that completed its batch.
    assert [p.epoch for p in payloads] == [0, 1, 1, 2]
    for payload in payloads:
        ids = [i for per_dp in payload.sample_ids_by_dp_rank for i in per_dp]
        assert len(ids) == len(set(ids)) == 6


def test_the_planner_lead_rides_on_the_payload_fetch(local_ray) -> None:
    planner = PlannerActor.remote(ray.data.from_items(_rows(40)), _settings(total_steps=3, prefetch=2), COST)
    client = PlannerClient(planner)
    first = client.fetch(1, 0, 0)
    assert first.payload.step == 1 and 0 <= first.ahead_steps <= 2 and first.wait_s >= 0


def test_spare_ranks_get_the_step_with_empty_micro_batches(local_ray) -> None:
    planner = PlannerActor.remote(ray.data.from_items(_rows(40)), _settings(total_steps=2), COST)
    ray.get(planner.restart.remote("group-2", Cursor(epoch=0, rows=0), 1, 1, 1))  # DP 1 x CP 2 + 1 spare
    trained = [fetch_payload(planner, 1, 0, c) for c in range(2)]
    spare = fetch_payload(planner, 1, -1, 0)
    assert len(spare.micro_batches) == len(trained[0].micro_batches) > 0  # as many backwards as the others
    assert all(mb.num_tokens == 0 for mb in spare.micro_batches)
    assert spare.sample_ids_by_dp_rank == trained[0].sample_ids_by_dp_rank
    assert ray.get(planner.stats.remote())["consumed_step"] == 1  # step 1 is freed once the spare has it


def test_a_worker_waits_at_most_the_planner_timeout(local_ray) -> None:
    planner = PlannerActor.remote(ray.data.from_items(_rows(40)), _settings(total_steps=3, prefetch=1), COST)
    # Step 3 is never planned while nobody fetches step 1 (prefetch 1): the wait ends with a clear error.
    with pytest.raises(PlannerError, match=r"no plan for step 3 after scheduling.planner_timeout_s=0.5s; "
                                           r"the planner reports: error=None, planned_step=[01],"):
        PlannerClient(planner, timeout_s=0.5).fetch(3, 0, 0)


def test_a_dead_planner_is_reported_as_such(local_ray) -> None:
    planner = PlannerActor.remote(ray.data.from_items(_rows(40)), _settings(), COST)
    ray.kill(planner)
    with pytest.raises(PlannerError, match="the planner actor died before step 1"):
        PlannerClient(planner, timeout_s=30).fetch(1, 0, 0)


def _restarted(planner, session: str, start: Cursor, first_step: int, timeout_s: float = 60.0) -> None:
    """Wait until Ray runs the killed actor again (its constructor's error says so: ray.kill returns before
    the old process is gone), then `restart` it as a restarted worker group does."""
    deadline = time.monotonic() + timeout_s
    while "restarted after a crash" not in str(_stats_while_restarting(planner)["error"]):
        assert time.monotonic() < deadline, "the planner actor did not restart"
        time.sleep(0.2)
    ray.get(planner.restart.remote(session, start, first_step, 2), timeout=timeout_s)


def _stats_while_restarting(planner) -> dict:
    try:
        return ray.get(planner.stats.remote(), timeout=30)
    except ray.exceptions.ActorUnavailableError:
        return {"error": None}


def test_a_crashed_planner_restarts_with_a_dataset_too_large_to_travel_inline(local_ray) -> None:
    """Ray restarts a crashed actor by running its constructor again with the same arguments. A dataset of
    64 blocks pickles to more than Ray's 100 KiB inline limit, and Ray keeps such an argument in the object
    store only for the first construction (ray-project/ray#53727). A mapped dataset (as the tokenized one
    is) carries its map's statistics: 64 blocks pickle to about 1.8 MB. Handed over as PlannerData (what
    `train` does), the restarted planner has its data and continues from the cursor it is given."""
    dataset = ray.data.from_items(_rows(640), override_num_blocks=64).map_batches(
        lambda batch: batch, batch_size=None).materialize()
    assert len(ray.cloudpickle.dumps(dataset)) > 100 * 1024  # as an argument it would go to the object store
    data = PlannerData.put(dataset)
    planner = PlannerActor.options(max_restarts=-1, max_task_retries=0).remote(data, _settings(), COST)
    try:
        steps = {step: _fetch_all_ranks(planner, step) for step in (1, 2)}
        time.sleep(2)  # Ray frees a constructor argument it holds some time after the construction
        ray.kill(planner, no_restart=False)
        _restarted(planner, "group-2", steps[1][0, 0].cursor, 2)
        assert {r: _digest(p) for r, p in _fetch_all_ranks(planner, 2).items()} == \
            {r: _digest(p) for r, p in steps[2].items()}
    finally:
        ray.kill(planner)


# ------------------------------------------------------------------------------------------- data.shuffle
SHUFFLE_ROWS, SHUFFLE_BATCH = 42, 6
"""42 rows, 6 of them malformed (i % 7 == 3): 36 usable, 6 steps of 6 an epoch."""


def _usable_positions(rows: list[dict]) -> list[int]:
    return [i for i, row in enumerate(rows) if row["status"] == "ok"]


def _expected_batches(rows: list[dict], *, shuffle: bool, seed: int,
                      epochs: int) -> list[tuple[int, set[int], int]]:
    """(epoch, sample ids, cursor rows) of each step, written out from the contract: an epoch visits the
    rows in numpy's permutation seeded by [seed, epoch] (stream order without shuffle), skips unusable rows
    and cuts batches of SHUFFLE_BATCH; the cursor counts the rows visited up to a batch's last row."""
    usable = set(_usable_positions(rows))
    batches = []
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(len(rows)) if shuffle else range(len(rows))
        visited = [(k + 1, int(p)) for k, p in enumerate(order) if int(p) in usable]
        for first in range(0, len(visited), SHUFFLE_BATCH):
            chunk = visited[first:first + SHUFFLE_BATCH]
            batches.append((epoch, {p for _, p in chunk}, chunk[-1][0]))
    return batches


def _step_ids(payload: RankPayload) -> set[int]:
    return {i for per_dp in payload.sample_ids_by_dp_rank for i in per_dp}


def _fetch_all_ranks(planner, step: int, dp_size: int = 2) -> dict[tuple[int, int], RankPayload]:
    return {(d, c): fetch_payload(planner, step, d, c) for d in range(dp_size) for c in range(2)}


def _digest(payload: RankPayload) -> tuple:
    """What a rank trains on in a step: ids, epoch, cursor and every micro-batch's plan and token ids."""
    def tokens(arrays: dict[int, np.ndarray]) -> tuple:
        return tuple((key, array.tolist()) for key, array in sorted(arrays.items()))

    batches = tuple((mb.plan, tokens(mb.input_ids), tokens(mb.labels)) for mb in payload.micro_batches)
    return payload.step, payload.epoch, payload.cursor, payload.sample_ids_by_dp_rank, batches


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_epoch_visits_every_usable_sample_once_in_its_order(local_ray, shuffle: bool) -> None:
    rows = _rows(SHUFFLE_ROWS)
    steps = 2 * len(_usable_positions(rows)) // SHUFFLE_BATCH
    settings = _settings(total_steps=steps, prefetch=steps, global_batch_size=SHUFFLE_BATCH, shuffle=shuffle,
                         data_seed=11)
    planner = PlannerActor.remote(ray.data.from_items(rows, override_num_blocks=5), settings, COST)
    payloads = [fetch_payload(planner, step, 0, 0) for step in range(1, steps + 1)]
    got = [(p.epoch, _step_ids(p), p.cursor.rows) for p in payloads]
    assert got == _expected_batches(rows, shuffle=shuffle, seed=11, epochs=2)
    for epoch in (0, 1):
        ids = [i for p in payloads if p.epoch == epoch for per_dp in p.sample_ids_by_dp_rank for i in per_dp]
        assert sorted(ids) == _usable_positions(rows)  # every usable sample exactly once an epoch
    first, second = ([_step_ids(p) for p in payloads if p.epoch == e] for e in (0, 1))
    assert (first != second) == shuffle  # a new order each epoch when shuffling, the stream order when not


def test_a_shuffled_epoch_skips_the_held_out_positions(local_ray) -> None:
    """The eval split is by stream position (scheduling/holdout.py), whatever the visiting order."""
    from scheduling.holdout import held_out

    rows = _rows(SHUFFLE_ROWS)
    held = set(np.flatnonzero(held_out(np.arange(SHUFFLE_ROWS), seed=11, fraction=0.3)).tolist())
    train_ids = set(_usable_positions(rows)) - held
    steps = len(train_ids) // SHUFFLE_BATCH  # whole batches of epoch 0
    assert held and steps >= 2
    settings = _settings(total_steps=steps, prefetch=steps, global_batch_size=SHUFFLE_BATCH, shuffle=True,
                         data_seed=11, eval_fraction=0.3)
    planner = PlannerActor.remote(ray.data.from_items(rows, override_num_blocks=5), settings, COST)
    payloads = [fetch_payload(planner, step, 0, 0) for step in range(1, steps + 1)]
    order = [int(p) for p in np.random.default_rng([11, 0]).permutation(SHUFFLE_ROWS) if int(p) in train_ids]
    assert [_step_ids(p) for p in payloads] == [set(order[i:i + SHUFFLE_BATCH])
                                                for i in range(0, steps * SHUFFLE_BATCH, SHUFFLE_BATCH)]
    assert all(p.epoch == 0 for p in payloads)


def test_a_shuffled_planner_restarted_mid_epoch_publishes_the_same_remaining_steps(local_ray) -> None:
    """A resumed run: a new planner from step 4's cursor, and the same actor restarted through `restart`
    (what a restarted worker group calls) on another DP size, against one uninterrupted planner."""
    dataset = ray.data.from_items(_rows(SHUFFLE_ROWS), override_num_blocks=5)
    settings = _settings(global_batch_size=SHUFFLE_BATCH, shuffle=True, data_seed=3, total_steps=10,
                         prefetch=10)
    fresh = PlannerActor.remote(dataset, settings, COST)
    uninterrupted = {step: _fetch_all_ranks(fresh, step) for step in range(1, 11)}  # crosses into epoch 1
    cursor = uninterrupted[4][0, 0].cursor
    assert cursor.epoch == 0 and 0 < cursor.rows < SHUFFLE_ROWS  # mid-epoch, rows counted in visit order

    resumed = PlannerActor.remote(dataset, dataclasses.replace(settings, total_steps=6), COST, cursor, 5)
    for step in range(5, 11):
        assert {r: _digest(p) for r, p in _fetch_all_ranks(resumed, step).items()} == \
            {r: _digest(p) for r, p in uninterrupted[step].items()}, f"step {step}"

    ray.get(fresh.restart.remote("group-2", cursor, 5, 1))  # DP 1 x CP 2 from step 4's checkpoint
    for step in range(5, 11):
        smaller = _fetch_all_ranks(fresh, step, dp_size=1)
        assert _step_ids(smaller[0, 0]) == _step_ids(uninterrupted[step][0, 0])  # the same global batch
        assert smaller[0, 0].cursor == uninterrupted[step][0, 0].cursor


def test_the_row_table_of_a_materialized_dataset_is_its_stream(local_ray) -> None:
    """20k rows in 313 blocks (~64 rows each, as data.tokenize_batch_size makes them): the planner's random
    access (scheduling/row_table.py) reads every row as Ray Data's own iter_rows streams it. Prints the
    costs (pytest -rP): the pass that builds the table, a shuffled epoch of lookups, one iter_rows pass."""
    import time

    import pyarrow as pa

    from scheduling.actor import read_row_table
    from scheduling.order import epoch_order

    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 400, size=20_000)
    ids = pa.array([rng.integers(0, 150_000, n).tolist() for n in lengths], pa.list_(pa.int32()))
    whole = pa.table({"input_ids": ids, "labels": ids, "status": pa.array(["ok", "truncated"] * 10_000),
                      "reason": pa.array([""] * 20_000), "num_tokens": pa.array(lengths)})
    dataset = ray.data.from_arrow([whole.slice(i, 64) for i in range(0, 20_000, 64)]).materialize()
    started = time.perf_counter()
    table = read_row_table(dataset)
    built_s = time.perf_counter() - started
    started = time.perf_counter()
    looked_up = {int(p): table.tokens(int(p)) for p in epoch_order(len(table), 0, 0)}
    statuses = [table.status(p) for p in range(len(table))]
    epoch_s = time.perf_counter() - started
    started = time.perf_counter()
    stream = list(dataset.iter_rows())
    stream_s = time.perf_counter() - started
    assert len(table) == len(stream) == 20_000
    for position, row in enumerate(stream):
        input_ids, labels = looked_up[position]
        assert np.array_equal(input_ids, row["input_ids"]) and np.array_equal(labels, row["labels"])
        assert statuses[position] == row["status"]
    print(f"row table of 20k rows / 313 blocks: built in {built_s:.2f} s, a shuffled epoch of lookups "
          f"{epoch_s:.2f} s ({epoch_s / 20_000 * 1e6:.1f} us a row); one iter_rows pass {stream_s:.2f} s")


def test_a_mix_resumed_mid_epoch_continues_where_it_stopped(local_ray) -> None:
    """data.sources (issue 55): the planner mixes three sources 3:1:1 from a table that holds them in Ray
    Data's round-robin of blocks; a planner resumed from step 5's cursor publishes what an uninterrupted one
    does for the steps after (sample ids, tokens, source_tokens), into the next epoch; the samples' sources
    follow the weights."""
    from scheduling.mix import MixSpec

    rng = np.random.default_rng(5)
    sizes = {"a": 60, "b": 25, "c": 25}
    per_source = {name: [{"input_ids": [i] * int(rng.integers(2, 40)), "status": "ok", "source": name}
                         for i in range(n)] for name, n in sizes.items()}
    blocks = [per_source[name][k:k + 10] for k in range(0, 60, 10) for name in sizes if k < sizes[name]]
    rows = [dict(row, labels=row["input_ids"]) for block in blocks for row in block]
    dataset = ray.data.from_items(rows, override_num_blocks=len(blocks))
    settings = _settings(global_batch_size=SHUFFLE_BATCH, shuffle=True, data_seed=2, total_steps=20,
                         prefetch=20, mix=MixSpec((3, 1, 1), seed=2), source_ids=tuple(sizes))
    fresh = PlannerActor.remote(dataset, settings, COST)
    uninterrupted = {step: _fetch_all_ranks(fresh, step) for step in range(1, 21)}
    assert {uninterrupted[step][0, 0].epoch for step in uninterrupted} == {0, 1}
    cursor = uninterrupted[5][0, 0].cursor
    resumed = PlannerActor.remote(dataset, dataclasses.replace(settings, total_steps=15), COST, cursor, 6)
    for step in range(6, 21):
        got = _fetch_all_ranks(resumed, step)
        want = {r: _digest(p) for r, p in uninterrupted[step].items()}
        assert {r: _digest(p) for r, p in got.items()} == want, f"step {step}"
        assert got[0, 0].source_tokens == uninterrupted[step][0, 0].source_tokens
    tokens = {name: sum(uninterrupted[s][0, 0].source_tokens.get(name, 0) for s in range(1, 9))
              for name in sizes}
    assert sum(uninterrupted[1][0, 0].source_tokens.values()) == uninterrupted[1][0, 0].global_tokens
    assert tokens["a"] > tokens["b"] and tokens["a"] > tokens["c"]
