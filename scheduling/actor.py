"""The planner actor: the only Ray code under scheduling/.

    Ray Data blocks ─once─▶ RowTable ─visit order─▶ [ planning thread ]──ray.put──▶ object store
     (stream order)        (row by position)         accumulate K samples          one payload per (dp, cp)
                                                     plan_step(policy, lengths)    rank and step
                                                     build_rank_payloads           │
                                                                                   ▼
                                                              payload(step, dp, cp) ◀── each train worker

The planning thread runs up to `prefetch` steps ahead of the slowest worker, so planning and the object
store transfer hide behind training. The actor owns the data cursor: a payload carries the (epoch, rows)
position after its step, which the workers checkpoint, so a resumed run skips exactly what was consumed.
Sample ids are stream positions within an epoch (the stream order is deterministic), so each id appears once
per epoch in the run's samples.jsonl.

Visit order (scheduling/order.py): with `shuffle` (data.shuffle, file and hub data) epoch e visits the rows
in epoch_order(rows, data.seed, e), otherwise in stream order; either way the cursor's `rows` counts rows
visited in that order, and the ids stay stream positions. The actor reads the materialized dataset's
planner columns once into a RowTable (scheduling/row_table.py, zero-copy views of the fetched blocks) and
looks rows up by position from there, so a permuted epoch costs no re-read of the stream.

Online calibration (scheduling.calibration=online, scheduling/refit.py): the planner keeps each step's plan;
world rank 0 sends every log window's measured micro-batch and optimizer laps (`observe`), and the planner
refits the profile's time terms from the newest `calibration_window` steps and plans every later step with
the fitted profile. Every fit starts from the same anchor (the starting profile, or the fit a checkpoint
carried), not from the previous fit, so where the windows cannot tell terms apart the fits do not drift.
The newest fit rides on every payload fetch (Fetched.calibration), so the driver writes it to the run
directory and the workers' checkpoints carry it; `restart` adopts a checkpoint's fit. Skrull's
plans then weigh balanced_packed and dynamic_cp too, and over its first `calibration_window` steps without a
fit it runs its candidates in turn (scheduling/skrull.py `explore`) so the fit sees what it chooses between.

Eval set (EvalSource): with data.eval_fraction the reader skips the held-out positions
(scheduling/holdout.py), so they never train and never reach samples.jsonl; `eval_payloads` plans the
held-out rows (or data.eval_path's dataset) with the run's policy for the asking group's shape, once per
shape (scheduling/eval_plan.py), and keeps one object-store ref per rank.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from scheduling import CostModel, plan_step
from scheduling.calibration import Calibration
from scheduling.eval_plan import plan_eval
from scheduling.holdout import is_held_out
from scheduling.mix import MixSpec, StreamRows, stream_rows
from scheduling.order import visit_order
from scheduling.payload import (
    USABLE_STATUSES,
    Cursor,
    RankPayload,
    RowStatus,
    Sample,
    build_rank_payloads,
    spare_payload,
)
from scheduling.refit import PlannedStep
from scheduling.row_table import RowTable
from scheduling.simulate import simulate


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerSettings:
    policy: str
    dp_size: int
    cp_size: int
    bucket_size: int
    global_batch_size: int
    total_steps: int
    prefetch: int
    seed: int = 0
    static_cp_micro_batch: int = 1
    spares: int = 0
    """Worker ranks beyond dp_size * cp_size (workers/distributed.py): each fetches an empty payload."""
    eval_fraction: float = 0.0
    """data.eval_fraction: usable rows held out (scheduling/holdout.py) are skipped by training."""
    data_seed: int = 0
    """data.seed: the held-out split's seed and the shuffle's."""
    shuffle: bool = False
    """data.shuffle (never for the synthetic source): visit each epoch in epoch_order(rows, data_seed,
    epoch) (scheduling/order.py) instead of the stream order."""
    cp_degrees: tuple[int, ...] | None = None
    """scheduling.cp_degrees, resolved (SkrullConfig.cp_degrees): the CP degrees the skrull policy's DACP
    may give a sequence (docs/design.md §13); None: [1, cp_size], the two-level DACP of the paper."""
    calibration: bool = False
    """scheduling.calibration=online (module docstring); False: the profile as given, today's plans."""
    calibration_window: int = 8
    """scheduling.calibration_window: the newest steps the fit uses, and skrull's exploration length."""
    chunkflow_keep: int = 1
    """scheduling.chunkflow_keep: the chunkflow policy's K (scheduling/chunkflow.py)."""
    mix: MixSpec | None = None
    """data.sources' weights, data.seed and data.mix_exhausted: the stream is their weighted interleave
    (scheduling/mix.py); None: the dataset's rows in order (one source)."""
    source_ids: tuple[str, ...] = ()
    """data.sources' ids, in order (with `mix`)."""

    def __post_init__(self) -> None:
        if self.total_steps < 1 or self.global_batch_size < self.dp_size or self.prefetch < 1:
            raise ValueError(f"invalid planner settings: {self}")


def read_row_table(dataset: Any) -> RowTable:
    """The planner columns of a (materialized) Ray dataset, by stream position: one pass over its blocks.

    Whole blocks as Ray fetched them (`batch_size=None`: no re-batching copy; Arrow blocks come zero-copy
    from the object store); RowTable keeps views of the planner's columns only. Not `select_columns`
    first: that is a Ray Data map, tasks that need CPUs the trainer may hold (docs/design.md §9).
    """
    return RowTable.from_tables(dataset.iter_batches(batch_size=None, batch_format="pyarrow"))


@dataclass(frozen=True)
class PlannerData:
    """The planner's datasets by reference: what `train` hands the PlannerActor's constructor.

    Ray restarts a crashed actor by running its constructor again with the same arguments. An argument too
    large to travel inside the task (a tokenized Dataset of 64 blocks pickles to about 1.8 MB; Ray's
    inline limit is 100 KiB) goes to the object store, where Ray keeps it only for the first construction
    (ray-project/ray#53727), so the restart would fail. This box pickles to a few hundred bytes whatever the
    data; its creator holds it, and with it the datasets, for as long as the actor may restart.
    """

    train: ray.ObjectRef
    eval: ray.ObjectRef | None = None
    """data.eval_path's dataset (EvalSource); None: the eval set, if any, is held out of `train`."""

    @classmethod
    def put(cls, dataset: Any, eval_dataset: Any = None) -> PlannerData:
        return cls(ray.put(dataset), None if eval_dataset is None else ray.put(eval_dataset))

    def datasets(self) -> tuple[Any, Any]:
        """(training dataset, eval dataset or None)."""
        return ray.get(self.train), None if self.eval is None else ray.get(self.eval)


def _restarted_by_ray() -> bool:
    """Whether Ray restarted this actor after a crash (its property reads Ray's own deprecated
    `actor_id`, whose warning would reach every run's log)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


class PlannerError(RuntimeError):
    """The planner could not produce a step (data ran out, or no valid plan); workers re-raise it."""


class _Superseded(Exception):
    """Internal: a restart replaced this planning thread's session; it stops without an error."""


@ray.remote(num_cpus=0, max_concurrency=256)
class PlannerActor:
    """Plans global batches ahead of training and hands each rank its payload (see module docstring)."""

    def __init__(
        self,
        dataset: Any,
        settings: PlannerSettings,
        cost: CostModel,
        start: Cursor | None = None,
        first_step: int = 1,
        eval_dataset: Any = None,
    ) -> None:
        """`dataset`: a PlannerData (a restartable actor's), or the training dataset itself."""
        if isinstance(dataset, PlannerData):
            dataset, eval_dataset = dataset.datasets()
        self._dataset = dataset
        self._rows: RowTable | None = None
        self._stream: StreamRows | None = None
        self._rows_lock = threading.Lock()
        self._eval = EvalSource(dataset, eval_dataset, settings, self._positions)
        self._cost = cost
        self._initial_cost = cost
        self._anchor = cost  # what every fit is relative to: the starting profile, or a checkpoint's fit
        self._calibration = Calibration(settings.calibration_window)
        self._plan_ms: list[float] = []
        self._status_counts: dict[str, int] = {}
        self._cond = threading.Condition()
        self._generation = 0
        self._session: str | None = None
        self._begin(settings, start or Cursor(epoch=0, rows=0), first_step)
        if _restarted_by_ray():
            # Ray restarted this actor after a crash: it does not know where the run stands, so it hands
            # out nothing until a (re)started worker group tells it the checkpoint's cursor (restart()).
            self._fail(PlannerError("the planner actor was restarted after a crash; waiting for the worker "
                                    "group to restart from its newest checkpoint"))

    def restart(self, session: str, start: Cursor, first_step: int, dp_size: int, spares: int = 0,
                calibration: dict[str, Any] | None = None) -> None:
        """Plan again from `start` for step `first_step` on, for `dp_size` DP ranks and `spares` spare ranks
        (idempotent per session); `calibration`: the checkpoint's fit, adopted unless this planner has
        one of its own (a planner restarted by Ray, or a new `train` call, starts without).

        A (re)started worker group calls this with the cursor of the checkpoint it resumed from, so the
        stream continues exactly after the last sample that checkpoint consumed; payloads planned for the
        previous group are dropped, and the old planning thread stops at its next step.
        """
        with self._cond:
            if session == self._session:
                return
            self._session = session
            if calibration is not None and self._calibration.adopt(calibration):
                self._cost = dataclasses.replace(self._cost, profile=self._calibration.profile)
                self._anchor = self._cost
            shape = (self._settings.dp_size, self._settings.spares)
            if (start, first_step, (dp_size, spares)) == (self._start, self._first_step, shape) \
                    and self._consumed == first_step - 1 and self._error is None:
                return  # what is planned so far is exactly what the new group needs: keep it
            settings = dataclasses.replace(self._settings, dp_size=dp_size, spares=spares,
                                           total_steps=self._last_step - first_step + 1)
        self._begin(settings, start, first_step)

    def _begin(self, settings: PlannerSettings, start: Cursor, first_step: int) -> None:
        with self._cond:
            self._generation += 1
            self._settings = settings
            self._start = start
            self._first_step = first_step
            self._last_step = first_step + settings.total_steps - 1
            self._ready: dict[int, dict[tuple[int, int], ray.ObjectRef]] = {}
            self._fetched: dict[int, set[tuple[int, int]]] = {}
            self._consumed = first_step - 1  # highest step every rank has fetched
            self._planned = first_step - 1
            self._error: BaseException | None = None
            self._calibration.begin(explore=settings.calibration and settings.policy == "skrull")
            self._cond.notify_all()
        generation = self._generation
        threading.Thread(target=self._run, args=(generation,), name="skrull-planner", daemon=True).start()

    # ---------------------------------------------------------------------------------------- workers
    def payload(self, step: int, dp_rank: int,
                cp_rank: int) -> tuple[list[ray.ObjectRef], int, dict[str, Any] | None]:
        """Block until `step` is planned; return ([ref] of this rank's RankPayload, the planned step, the
        newest online fit or None).

        A list keeps the payload a reference (the worker pulls it from the object store); the planned step
        tells the worker how far ahead the planner is, and the fit what profile the planner now plans with
        (a checkpoint of this step keeps it), without a second actor call. A spare rank asks with
        dp_rank -1 and its index as cp_rank.
        """
        with self._cond:
            self._cond.wait_for(lambda: step <= self._planned or self._error is not None)
            if step > self._planned:
                raise PlannerError(f"planner failed before step {step}: {self._error}") from self._error
            ref = self._ready[step][dp_rank, cp_rank]
            fetched = self._fetched.setdefault(step, set())
            fetched.add((dp_rank, cp_rank))
            if len(fetched) == len(self._ready[step]):
                # Every rank holds its ref now; dropping ours lets the object store free the step.
                del self._ready[step], self._fetched[step]
                self._consumed = max(self._consumed, step)
                self._cond.notify_all()
            return [ref], self._planned, self._calibration.record

    def eval_payloads(self, dp_size: int, spares: int, dp_rank: int, cp_rank: int) -> list[ray.ObjectRef]:
        """[ref] of this rank's eval payloads (a tuple of RankPayload over every eval batch).

        Planned on the first call for a worker-group shape (dp_size, spares) and kept in the object store
        until the shape changes, so a group plans its eval set once, not on every eval.
        """
        return [self._eval.refs(self._settings, self._cost, dp_size, spares)[dp_rank, cp_rank]]

    def observe(self, session: str, timings: list[dict[str, Any]]) -> None:
        """World rank 0's laps of a log window (PlannerClient.observe); refits the profile from them.

        Laps of an older start of the worker group (a `restart` re-planned those steps) are ignored."""
        with self._cond:
            if session != self._session or not self._settings.calibration:
                return
            settings, anchor = self._settings, self._anchor
        world = settings.dp_size * settings.cp_size + settings.spares
        fitted = self._calibration.observe(timings, anchor, world=world)
        if fitted is not None:
            self._cost = dataclasses.replace(anchor, profile=fitted)

    def calibration(self) -> dict[str, Any] | None:
        """The newest fit (Refit.to_dict with its version), or None."""
        return self._calibration.record

    def stats(self) -> dict[str, Any]:
        """Planning time, how far ahead the planner is, and the data rows seen by status."""
        with self._cond:
            plan_ms = np.asarray(self._plan_ms or [0.0])
            return {
                "planned_step": self._planned,
                "consumed_step": self._consumed,
                "ahead_steps": self._planned - self._consumed,
                "plan_ms_median": float(np.median(plan_ms)),
                "plan_ms_max": float(plan_ms.max()),
                "rows_by_status": dict(self._status_counts),
                "error": None if self._error is None else repr(self._error),
            }

    # ---------------------------------------------------------------------------------------- planning
    def _fail(self, error: BaseException) -> None:
        """Stop planning this session; every waiting and later payload() call raises `error`."""
        with self._cond:
            self._generation += 1  # the planning thread stops at its next publish
            self._error = error
            self._cond.notify_all()

    def _run(self, generation: int) -> None:
        try:
            self._plan_all(generation)
        except _Superseded:
            return
        except BaseException as err:  # surfaced to every waiting worker by payload()
            with self._cond:
                if generation == self._generation:
                    self._error = err
                    self._cond.notify_all()

    def _plan_all(self, generation: int) -> None:
        s = self._settings
        last_step = self._last_step
        batch: list[Sample] = []
        step = self._first_step
        for epoch, visited, sample in self._usable_rows(self._start):
            batch.append(sample)
            if len(batch) < s.global_batch_size:
                continue
            self._publish(generation, s, step, epoch, batch, Cursor(epoch=epoch, rows=visited))
            batch = []
            if step == last_step:
                return
            step += 1

    def _table(self) -> RowTable:
        """The dataset's planner columns by table row, read once per actor (module docstring)."""
        with self._rows_lock:
            if self._rows is None:
                self._rows = read_row_table(self._dataset)
                s = self._settings
                if s.mix is not None:  # the driver's scan checked that every source has rows
                    self._stream = stream_rows(self._rows.source_codes, self._rows.source_names,
                                               s.source_ids, s.mix)
            return self._rows

    def _positions(self) -> tuple[RowTable, np.ndarray | None]:
        """(the table, the table row of each stream position or None: the table's own order)."""
        table = self._table()
        return table, None if self._stream is None else self._stream.table_rows

    def _usable_rows(self, start: Cursor) -> Iterator[tuple[int, int, Sample]]:
        """(epoch, rows visited in the epoch, sample) of usable rows from the cursor on, cycling epochs.

        Each epoch visits the rows in `visit_order` (the stream order, or the epoch's permutation); the
        sample id is the row's stream position either way. `train.steps` decides when to stop, so the
        data repeats as often as needed; an epoch without a single usable row would repeat forever, so it
        is an error instead.
        """
        s = self._settings
        table, rows = self._positions()
        length = len(table) if rows is None else len(rows)
        epoch = start.epoch
        skip = start.rows
        while True:
            usable = 0
            order = visit_order(length, seed=s.data_seed, epoch=epoch, shuffle=s.shuffle)
            for visited in range(skip, len(order)):
                position = int(order[visited])
                row = position if rows is None else int(rows[position])
                status = table.status(row)
                with self._cond:
                    self._status_counts[status] = self._status_counts.get(status, 0) + 1
                if status in USABLE_STATUSES and not self._eval.holds_out(position):
                    usable += 1
                    input_ids, labels = table.tokens(row)
                    source = table.source_names[table.source_codes[row]] if s.mix is not None else ""
                    yield epoch, visited + 1, Sample(sample_id=position, input_ids=input_ids, labels=labels,
                                                     source=source)
            if usable == 0 and skip == 0:
                raise PlannerError(
                    f"epoch {epoch} of the dataset has no usable row (rows by status: "
                    f"{self._status_counts}); check data.path / data.source and data.too_long"
                )
            epoch += 1
            skip = 0

    def _publish(self, generation: int, s: PlannerSettings, step: int, epoch: int, batch: list[Sample],
                 cursor: Cursor) -> None:
        started = time.perf_counter()
        cost = self._cost  # one profile for the whole step (a fit may replace it meanwhile)
        lengths = [sample.num_tokens for sample in batch]
        labels = [sample.num_label_tokens for sample in batch]
        step_plan = plan_step(
            s.policy, lengths, dp_size=s.dp_size, cp_size=s.cp_size, bucket_size=s.bucket_size,
            cost=cost, seed=s.seed + step, static_cp_micro_batch=s.static_cp_micro_batch, labels=labels,
            cp_degrees=s.cp_degrees, baselines=s.calibration, explore=self._calibration.explore(step),
            chunkflow_keep=s.chunkflow_keep,
        )
        plan_ms = (time.perf_counter() - started) * 1e3
        estimate = simulate(step_plan, lengths, cost, labels=labels)
        initial = simulate(step_plan, lengths, self._initial_cost, labels=labels) \
            if cost is not self._initial_cost else estimate
        self._calibration.remember(step, PlannedStep(plan=step_plan, lengths=tuple(lengths),
                                                     labels=tuple(labels)))
        payloads = build_rank_payloads(step_plan, batch, step=step, epoch=epoch, cursor=cursor,
                                       plan_ms=plan_ms, estimate=estimate,
                                       flops_at_peak_s=self._flops_at_peak_s(lengths, labels),
                                       predicted_step_s_initial=initial.total_s)
        refs = {rank: ray.put(payload) for rank, payload in payloads.items()}
        if s.spares:
            spare = ray.put(spare_payload(payloads[0, 0], 0))
            refs.update({(-1, index): spare for index in range(s.spares)})
        with self._cond:
            if generation != self._generation:
                raise _Superseded
            self._plan_ms.append(plan_ms)
            self._ready[step] = refs
            self._planned = step
            self._cond.notify_all()
            # Stay at most `prefetch` steps ahead of the slowest rank (or stop when restarted).
            self._cond.wait_for(lambda: self._planned - self._consumed < s.prefetch
                                or generation != self._generation)
            if generation != self._generation:
                raise _Superseded

    def _flops_at_peak_s(self, lengths: list[int], labels: list[int]) -> float:
        """The step's model training FLOPs / the profile's peak FLOP/s (RankPayload.flops_at_peak_s)."""
        profile = self._cost.profile
        forward = float(np.sum(self._cost.flops(np.asarray(lengths), np.asarray(labels))))
        return forward * profile.train_flops_factor / profile.peak_flops


class EvalSource:
    """The planner's eval set: held-out rows of the training dataset, or a separate eval dataset.

    `holds_out(position)` is what the training stream skips (data.eval_fraction; never with a separate
    eval dataset, whose ids are positions in its own stream). `refs` plans the eval set for a group shape
    (scheduling/eval_plan.py) and keeps one object-store ref per rank until the shape changes.
    """

    def __init__(self, dataset: Any, eval_dataset: Any, settings: PlannerSettings,
                 positions: Any = None) -> None:
        self._dataset = eval_dataset if eval_dataset is not None else dataset
        self._separate = eval_dataset is not None
        self._positions = positions
        """The planner's (table, stream rows) (PlannerActor._positions): the held-out rows' source."""
        self._fraction = 0.0 if self._separate else settings.eval_fraction
        self._seed = settings.data_seed
        self._lock = threading.Lock()
        self._shape: tuple[int, int] | None = None
        self._refs: dict[tuple[int, int], ray.ObjectRef] = {}

    def holds_out(self, position: int) -> bool:
        return bool(self._fraction) and is_held_out(position, seed=self._seed, fraction=self._fraction)

    def samples(self) -> list[Sample]:
        """The eval set's usable rows in stream order (sample id = position in its stream)."""
        if not (self._separate or self._fraction):
            raise PlannerError("no eval set: set data.eval_fraction or data.eval_path")
        if not self._separate and self._positions is not None:
            return self._held_out_samples()
        samples = []
        for position, row in enumerate(self._dataset.iter_rows()):
            if str(row.get("status", RowStatus.OK)) not in USABLE_STATUSES:
                continue
            if self._separate or self.holds_out(position):
                samples.append(Sample(sample_id=position, input_ids=np.asarray(row["input_ids"], np.int64),
                                      labels=np.asarray(row["labels"], dtype=np.int64)))
        return samples

    def _held_out_samples(self) -> list[Sample]:
        """The usable held-out rows of the training stream (sample id = stream position), from the planner's
        table: with data.sources a position is a place in the mixed stream, not in the dataset."""
        table, rows = self._positions()
        samples = []
        for position in range(len(table) if rows is None else len(rows)):
            row = position if rows is None else int(rows[position])
            if table.status(row) in USABLE_STATUSES and self.holds_out(position):
                input_ids, labels = table.tokens(row)
                samples.append(Sample(sample_id=position, input_ids=input_ids, labels=labels))
        return samples

    def refs(self, s: PlannerSettings, cost: CostModel, dp_size: int,
             spares: int) -> dict[tuple[int, int], ray.ObjectRef]:
        with self._lock:
            if self._shape != (dp_size, spares):
                planned = plan_eval(self.samples(), policy=s.policy, batch_size=s.global_batch_size,
                                    dp_size=dp_size, cp_size=s.cp_size, bucket_size=s.bucket_size, cost=cost,
                                    seed=s.seed, static_cp_micro_batch=s.static_cp_micro_batch, spares=spares)
                self._refs = {rank: ray.put(payloads) for rank, payloads in planned.items()}
                self._shape = (dp_size, spares)
            return self._refs


@dataclass(frozen=True, slots=True)
class Fetched:
    payload: RankPayload
    wait_s: float
    """Seconds the worker waited for the planner and the object store."""
    ahead_steps: int
    """Steps beyond this one the planner had already published (0: training waits on planning)."""
    calibration: dict[str, Any] | None = None
    """The planner's newest online fit when the step was fetched (scheduling/calibration.py `record`)."""


class PlannerClient:
    """The worker's side of the planner actor: one blocking call per step, then the object-store pull.

    A worker never waits forever: after `timeout_s` (scheduling.planner_timeout_s) without its payload, or
    as soon as the actor is found dead, it raises PlannerError carrying what the planner reported, which
    ends this start of the worker group (Ray Train restarts it from the newest checkpoint when
    train.max_failures allows, and the restart re-plans from that checkpoint's cursor).
    """

    def __init__(self, planner: Any, timeout_s: float | None = None) -> None:
        self._planner = planner
        self._timeout_s = timeout_s

    def observe(self, session: str, metrics: list[dict[str, Any]], *, first_step: int) -> None:
        """Send a log window's laps to the planner (fire and forget: nothing waits for the fit).
        `first_step`: this start's first step, whose laps the fit leaves out."""
        timings = [{"step": m["step"], "micro_batch_s": m["micro_batch_s"], "optimizer_s": m["optimizer_s"],
                    "first_of_session": m["step"] == first_step} for m in metrics if "micro_batch_s" in m]
        if timings:
            self._planner.observe.remote(session, timings)

    def fetch(self, step: int, dp_rank: int, cp_rank: int) -> Fetched:
        started = time.perf_counter()
        try:
            (ref,), planned, calibration = ray.get(self._planner.payload.remote(step, dp_rank, cp_rank),
                                      timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError:
            state = self._planner_state()
            raise PlannerError(f"no plan for step {step} after scheduling.planner_timeout_s="
                               f"{self._timeout_s:g}s; the planner reports: {state}") from None
        except ray.exceptions.RayActorError as err:
            raise PlannerError(f"the planner actor died before step {step} was handed out "
                               f"({type(err).__name__}: {str(err).splitlines()[0]})") from err
        payload = ray.get(ref)
        return Fetched(payload=payload, wait_s=time.perf_counter() - started, ahead_steps=planned - step,
                       calibration=calibration)

    def _planner_state(self) -> str:
        try:
            stats = ray.get(self._planner.stats.remote(), timeout=10)
        except Exception as err:  # noqa: BLE001 - the state is only context for the error being raised
            return f"no answer ({type(err).__name__})"
        return (f"error={stats['error']}, planned_step={stats['planned_step']}, "
                f"consumed_step={stats['consumed_step']}")
