"""The planner actor on a local Ray: payloads per rank and step, cursor, skipped rows, errors."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from scheduling import CostModel  # noqa: E402
from scheduling.actor import PlannerActor, PlannerClient, PlannerError, PlannerSettings  # noqa: E402
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
