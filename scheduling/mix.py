"""The weighted interleave of several sources (data.sources): which source each position of the stream reads.

Each source s with weight w_s (normalized) gets one *pick time* per row it contributes, a jittered grid

    t_s(k) = (k + u_s,k) / w_s        k = 0, 1, 2, ...   u_s,k uniform in [0, 1) from PCG64(seed, s)

and the mixed stream takes the picks of all sources in time order (ties: the lower source index). Every
interval [k / w_s, (k+1) / w_s) holds exactly one pick of s, so any prefix of the stream holds each source
within one row of its share (3:1:1 -> 60/20/20 over any 2,000 rows, to a tenth of a point), while the jitter
makes the order of the sources random (seeded: data.seed). The picks of a source depend only on (seed, s,
w), never on the other sources' sizes, so the order can be computed without knowing how long they are
(`MixStream`, for `data preview` and `plan`) or all at once from the sizes (`mix_order`, for the planner and
the data summary), and both give the same stream.

When a source runs out (its k-th pick and k = its rows):
    stop    the stream ends at that pick (the rows before it are the stream; Hugging Face's
            interleave_datasets `first_exhausted`)
    cycle   the source starts again from its first row (row k mod rows), and the stream ends right after
            the pick that reads the last row of the last source to finish its first pass (every row of every
            source is in the stream at least once; `all_exhausted`)

A stream position p is a sample id (scheduling/order.py permutes positions per epoch with data.shuffle);
(source(p), row(p)) say which row of which source it reads, so the stream does not depend on how Ray Data
interleaved the sources' blocks. Pure numpy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

_UINT64 = (1 << 64) - 1
_MIX_WORD = 0x6D6978  # "mix": keeps these streams apart from scheduling/order.py's for the same seed
_DRAW = 4096


@dataclass(frozen=True, slots=True)
class MixSpec:
    """data.sources' weights (in order), data.seed and data.mix_exhausted."""

    weights: tuple[float, ...]
    seed: int = 0
    exhausted: Literal["stop", "cycle"] = "stop"

    def __post_init__(self) -> None:
        if not self.weights or any(not np.isfinite(w) or w <= 0 for w in self.weights):
            raise ValueError(f"mix weights must be > 0, got {self.weights}")
        if self.exhausted not in ("stop", "cycle"):
            raise ValueError(f"mix_exhausted={self.exhausted!r} is not one of: stop, cycle")

    @property
    def shares(self) -> np.ndarray:
        weights = np.asarray(self.weights, dtype=np.float64)
        return weights / weights.sum()


def _uniforms(spec: MixSpec, source: int, count: int) -> np.ndarray:
    """The first `count` jitters u_s,k of source `source` (a prefix of the same stream for any count)."""
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [spec.seed & _UINT64, _MIX_WORD, source])))
    return generator.random(count)


def pick_times(spec: MixSpec, source: int, count: int) -> np.ndarray:
    """t_s(k) for k < count (increasing)."""
    return (np.arange(count, dtype=np.float64) + _uniforms(spec, source, count)) / spec.shares[source]


@dataclass(frozen=True, slots=True)
class MixOrder:
    """The mixed stream: position p reads row `rows[p]` of source `sources[p]`."""

    sources: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.sources)

    def counts(self, num_sources: int) -> np.ndarray:
        """Stream positions per source."""
        return np.bincount(self.sources, minlength=num_sources)


def mix_order(counts: Iterable[int], spec: MixSpec) -> MixOrder:
    """The whole mixed stream of sources with `counts` rows (module docstring); ValueError for a source
    without rows (the caller names it first)."""
    sizes = np.asarray(list(counts), dtype=np.int64)
    if len(sizes) != len(spec.weights) or (sizes < 1).any():
        raise ValueError(f"every source needs rows: {sizes.tolist()} for {len(spec.weights)} sources")
    last = [pick_times(spec, s, int(n) + 1)[-2:] for s, n in enumerate(sizes)]  # t_s(n-1), t_s(n)
    if spec.exhausted == "stop":
        end, inclusive = min(t[1] for t in last), False
    else:
        end, inclusive = max(t[0] for t in last), True
    times, sources, picks = [], [], []
    for s in range(len(sizes)):
        count = int(np.floor(end * spec.shares[s])) + 2  # >= the picks before `end`: one per interval
        t = pick_times(spec, s, count)
        keep = t <= end if inclusive else t < end
        times.append(t[keep])
        sources.append(np.full(int(keep.sum()), s, dtype=np.int64))
        picks.append(np.flatnonzero(keep))
    time, source, pick = (np.concatenate(parts) for parts in (times, sources, picks))
    order = np.lexsort((source, time))
    source = source[order]
    return MixOrder(sources=source, rows=pick[order] % sizes[source])


def rows_needed(counts: Iterable[int], spec: MixSpec) -> list[int]:
    """How many leading rows of each source the stream can read, for any seed: with `stop`, source r's
    picks before the end are at most ceil(w_r * min_s (n_s + 1) / w_s) (one per interval, and the end is
    before every source's pick n_s); with `cycle`, all. An over-count in `counts` only raises the bound."""
    sizes = [int(n) for n in counts]
    if spec.exhausted == "cycle":
        return sizes
    shares = spec.shares
    end = min((n + 1) / shares[s] for s, n in enumerate(sizes))
    return [min(n, int(np.ceil(end * shares[r] - 1e-9)) + 1) for r, n in enumerate(sizes)]


class MixStream:
    """The mixed stream read lazily from the sources' rows (data preview, plan): yields (source, row).

    `sources` are callables returning a fresh iterator over each source's rows (called again when `cycle`
    restarts a source). Same stream as mix_order over the sources' row counts.
    """

    def __init__(self, sources: list[Callable[[], Iterator[Any]]], spec: MixSpec) -> None:
        if len(sources) != len(spec.weights):
            raise ValueError(f"{len(sources)} sources for {len(spec.weights)} weights")
        self._open, self._spec = sources, spec

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        spec = self._spec
        readers = [_Lookahead(open_rows()) for open_rows in self._open]
        jitter = [_Jitter(spec, s) for s in range(len(readers))]
        first_pass = [True] * len(readers)
        heap = [(jitter[s].time(0), s, 0) for s in range(len(readers))]
        heapq.heapify(heap)
        while heap:
            _, s, k = heapq.heappop(heap)
            reader = readers[s]
            if reader.empty:
                if spec.exhausted == "stop" or first_pass[s]:
                    return  # stop: the stream ends here; cycle: a source without a single row
                readers[s] = reader = _Lookahead(self._open[s]())
            row = reader.take()
            if reader.empty and first_pass[s]:
                first_pass[s] = False
            yield s, row
            if spec.exhausted == "cycle" and not any(first_pass):
                return
            heapq.heappush(heap, (jitter[s].time(k + 1), s, k + 1))


class _Jitter:
    """t_s(k) of one source, drawn in chunks (the same values as pick_times)."""

    def __init__(self, spec: MixSpec, source: int) -> None:
        self._spec, self._source = spec, source
        self._times = np.zeros(0)

    def time(self, k: int) -> float:
        if k >= len(self._times):
            self._times = pick_times(self._spec, self._source, max(_DRAW, 2 * (k + 1)))
        return float(self._times[k])


class _Lookahead:
    """An iterator that knows whether it has another item."""

    _END = object()

    def __init__(self, items: Iterator[Any]) -> None:
        self._items = iter(items)
        self._next = next(self._items, self._END)

    @property
    def empty(self) -> bool:
        return self._next is self._END

    def take(self) -> Any:
        item, self._next = self._next, next(self._items, self._END)
        return item


@dataclass(frozen=True, slots=True)
class StreamRows:
    """Stream position -> the row of a table holding every source's rows (in any interleave of the
    sources, each source's rows in their own order), and its source index."""

    table_rows: np.ndarray
    sources: np.ndarray

    def __len__(self) -> int:
        return len(self.table_rows)


def stream_rows(codes: np.ndarray, names: list[str], ids: tuple[str, ...], spec: MixSpec) -> StreamRows:
    """The mixed stream over a table whose row i came from source `names[codes[i]]` (an id of `ids`).

    The k-th row of source s in the table is that source's row k (the pipeline keeps each source's order,
    whatever order Ray Data interleaved their blocks in). ValueError naming a source without rows."""
    codes = np.asarray(codes)
    code_of = {name: code for code, name in enumerate(names)}
    rows_of = [np.flatnonzero(codes == code_of[source_id]) if source_id in code_of else np.zeros(0, np.int64)
               for source_id in ids]
    empty = [source_id for source_id, rows in zip(ids, rows_of, strict=True) if not len(rows)]
    if empty:
        raise ValueError(f"source {empty[0]!r} has no rows")
    order = mix_order([len(rows) for rows in rows_of], spec)
    starts = np.concatenate([[0], np.cumsum([len(rows) for rows in rows_of])[:-1]]).astype(np.int64)
    flat = np.concatenate(rows_of)
    return StreamRows(table_rows=flat[starts[order.sources] + order.rows], sources=order.sources)
