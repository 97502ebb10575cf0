"""`bench data`: this project's tokenize pipeline at 1 task and at every CPU, against `datasets.map`.

    the rows      data.path's first --rows rows (all by default), copied to one file of the source's
                  format (JSONL lines as they are, Parquet / datasets rows as Parquet); with data.sources
                  each source's first --rows rows, a file each, read as the run reads the mix (the same
                  rows a source's take leaves: app/data/sources.py)
    ray_1_task    tokenized_dataset(tasks=1).materialize()          (app/data/pipeline.py)
    ray_all_cpus  tokenized_dataset(tasks=CPUs).materialize()
    datasets_map  Dataset.from_parquet / load_dataset("text") + .map(tokenize, batched=True,
                  num_proc=CPUs): Hugging Face's multiprocess map, the peer users run today (a mix: each
                  source loaded and mapped so, then concatenated)

All three run the same function on the same rows: app/data/ray_ops.py `tokenize` (SourcesTokenizer: the
run's tokenizer, chat template, label rule and length limit, each source's row format, Arrow tables in and
out, data.tokenize_batch_size rows a call), so only the executor differs. Each variant's time is
read + tokenize until every row exists
(Ray: materialized in the object store; datasets: written to its Arrow cache, a fresh cache directory
each time, never a cached result). Warm on both sides: one untimed round first (Ray's worker processes and
their tokenizers stay up), and `datasets` runs in a process of its own (Ray's driver threads do not mix with
its fork) that loaded the tokenizer before forking, so its children start with it. Same priority: Ray
runs its task workers at a niceness of their own (its worker_niceness, 15), so the `datasets` process takes
the niceness a Ray task reports; on a shared machine both then yield alike to everything else. Then
--rounds rounds, the order rotated each round (1, N, D / N, D, 1 / D, 1, N), so drift on the machine
reaches every variant.

Checks: every variant returns the same number of rows, the same token count and the same digest of the
num_tokens and label_tokens columns of each source's rows in its order, else the bench fails (it measured
something else). (Each source's order, not the whole table's: a union hands on blocks of the sources
round-robin, `datasets` one source after the other; the run's stream does not depend on either.)
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config import ConfigError, SkrullConfig

VARIANTS = ("ray_1_task", "ray_all_cpus", "datasets_map")


@dataclass(frozen=True)
class Measured:
    """One run of one variant: wall seconds, rows, tokens tokenized (before truncation), output digest."""

    seconds: float
    rows: int
    tokens: int
    digest: str


def run_bench(config: SkrullConfig, *, rows: int | None, rounds: int, cpus: int) -> dict[str, Any]:
    """Write the sample, time every variant (see the module docstring); the `--json` document."""

    from app.data.resolved import resolve_data
    from app.train.cluster import ray_session

    if not config.data.source_configs():
        raise ConfigError(f"bench data reads rows from data.path (data.source=path or hf) or data.sources, "
                          f"not data.source={config.data.source}")
    with tempfile.TemporaryDirectory(prefix="skrull-bench-data-") as scratch:
        data_cfg = sample_config(config, Path(scratch), rows)
        data = resolve_data(data_cfg, max_length=config.max_sequence_length)
        peer_sources = tuple((str(source.data.files[0]), source.data.format, source.spec(data_cfg.tokenizer),
                              source.take) for source in data.sources)
        spec = (peer_sources, data_cfg.tokenize_batch_size, cpus)
        with ray_session(config, worker_logs=False, training=False):
            peer = DatasetsMap(spec, Path(scratch), niceness=ray_worker_niceness())
            runners = {"ray_1_task": lambda: ray_run(data, config.resources.data_cpus, 1),
                       "ray_all_cpus": lambda: ray_run(data, config.resources.data_cpus, cpus),
                       "datasets_map": peer.run}
            try:
                results = _rounds(runners, rounds)
            finally:
                peer.close()
    return summarize(results, cpus=cpus, rounds=rounds)


def sample_config(config: SkrullConfig, scratch: Path, rows: int | None) -> Any:
    """The DataConfig reading each source's first `rows` rows (None: all) from a file of its own."""
    import dataclasses

    from app.data.sources import source_data_config

    data = config.data
    written = []
    for index, entry in enumerate(data.source_configs()):
        path, fmt = write_sample(source_data_config(data, entry), scratch, rows, name=f"rows{index}")
        written.append(dataclasses.replace(entry, source="path", path=str(path), format=fmt, name="",
                                           split="train", data_files=(), id=entry.source_id))
    if not data.sources:
        (entry,) = written
        return dataclasses.replace(data, source="path", path=entry.path, format=entry.format, name="",
                                   split="train", data_files=())
    return dataclasses.replace(data, sources=tuple(written))


def write_sample(data: Any, scratch: Path, rows: int | None, name: str = "rows") -> tuple[Path, str]:
    """The first `rows` rows of data.path (None: all) as one file; (its path, "jsonl" or "parquet")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.readers import iter_local_rows, resolve_source

    source = resolve_source(data)
    batches = iter_local_rows(source, 4096)
    if source.format == "jsonl":
        path = scratch / f"{name}.jsonl"
        written = 0
        with path.open("w", encoding="utf-8") as out:
            for batch in batches:
                for row in batch[: None if rows is None else rows - written]:
                    out.write(row["json_line"] + "\n")
                    written += 1
                if rows is not None and written >= rows:
                    break
        return path, "jsonl"
    tables, written = [], 0
    for batch in batches:
        batch = batch[: None if rows is None else rows - written]
        tables.append(pa.Table.from_pylist(batch))
        written += len(batch)
        if rows is not None and written >= rows:
            break
    path = scratch / f"{name}.parquet"
    pq.write_table(pa.concat_tables(tables, promote_options="default"), path)
    return path, "parquet"


def ray_worker_niceness() -> int:
    """The niceness Ray runs its task workers at (what a tokenize task gets)."""
    import ray

    return int(ray.get(ray.remote(num_cpus=0)(_niceness).remote()))


def _niceness() -> int:
    return os.nice(0)


def ray_run(data: Any, num_cpus: float, tasks: int) -> Measured:
    """This project's pipeline with `tasks` tokenize tasks at once, materialized; then its digest."""
    from app.data.pipeline import tokenized_dataset

    start = time.perf_counter()
    dataset = tokenized_dataset(data, num_cpus=num_cpus, tasks=tasks).materialize()
    seconds = time.perf_counter() - start
    batches = dataset.select_columns(["raw_tokens", "num_tokens", "label_tokens", "source"]).iter_batches(
        batch_size=65536, batch_format="pyarrow")
    return _measured(seconds, batches)


_DIGESTED = ("num_tokens", "label_tokens")


def _measured(seconds: float, batches: Any) -> Measured:
    """Rows, raw tokens and a digest of (num_tokens, label_tokens) of each source's rows in their order,
    from Arrow batches (whatever the batching, and however the sources' rows interleave)."""
    import numpy as np

    digests: dict[str, dict[str, Any]] = {}
    rows = tokens = 0
    for batch in batches:
        sources = np.asarray(batch.column("source").to_numpy(zero_copy_only=False)).astype(str) \
            if "source" in batch.column_names else np.full(batch.num_rows, "")
        for source in dict.fromkeys(sources.tolist()):
            mine = sources == source
            per = digests.setdefault(source, {name: hashlib.sha256() for name in _DIGESTED})
            for name, digest in per.items():
                values = batch.column(name).to_numpy(zero_copy_only=False).astype("int64")
                digest.update(values[mine].tobytes())
        rows += batch.num_rows
        tokens += int(batch.column("raw_tokens").to_numpy(zero_copy_only=False).sum())
    digest = "".join(f"{source}:" + "".join(d.hexdigest()[:16] for d in per.values())
                     for source, per in sorted(digests.items()))
    return Measured(seconds=seconds, rows=rows, tokens=tokens, digest=digest)


class DatasetsMap:
    """The `datasets` variant in a process of its own (spawned: no Ray threads), one run per call."""

    def __init__(self, spec: tuple[Any, ...], scratch: Path, niceness: int = 0) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_datasets_worker, args=(child, spec, str(scratch), niceness),
                                        daemon=True)
        self._process.start()

    def run(self) -> Measured:
        self._conn.send("run")
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        self._conn.send("stop")
        self._process.join(timeout=30)


def _datasets_worker(conn: Any, spec: tuple[Any, ...], scratch: str, niceness: int) -> None:
    """Serve `run` requests: load the rows with `datasets` and map them (num_proc processes, which
    inherit this process's niceness and its loaded tokenizer)."""
    from app.data import ray_ops

    os.nice(max(0, niceness - os.nice(0)))
    sources, batch_size, num_proc = spec
    for _, _, tokenize_args, _ in sources:
        ray_ops._sources_tokenizer_of((tokenize_args,))  # loaded here; the forked map processes inherit it
    runs = 0
    while conn.recv() == "run":
        runs += 1
        try:
            conn.send(datasets_map(sources, batch_size, num_proc,
                                   cache_dir=os.path.join(scratch, f"hf-cache-{runs}")))
        except Exception as err:  # noqa: BLE001 - handed to the driver, which raises it
            conn.send(err)


def tokenize_table(batch: Any, sources: tuple[tuple[Any, ...], ...], batch_rows: int) -> Any:
    """ray_ops.tokenize's output of one batch as one table (a `datasets.map` function)."""
    import pyarrow as pa

    from app.data import ray_ops

    return pa.concat_tables(list(ray_ops.tokenize(batch, sources, batch_rows)))


def datasets_map(sources: tuple[tuple[Any, ...], ...], batch_size: int, num_proc: int, *,
                 cache_dir: str) -> Measured:
    """Load each source's file (path, format, its tokenize spec, its take) and map the pipeline's tokenize
    over it with `num_proc` processes, as a `datasets` user does; the sources' rows concatenated."""
    import functools
    import shutil

    import datasets

    datasets.disable_progress_bars()
    start = time.perf_counter()
    mapped = []
    for path, fmt, tokenize_args, take in sources:
        if fmt == "jsonl":  # raw lines, as this project's reader hands them to the same function
            loaded = datasets.load_dataset("text", data_files=path, split="train", cache_dir=cache_dir)
        else:
            loaded = datasets.Dataset.from_parquet(path, cache_dir=cache_dir)
        if take is not None:
            loaded = loaded.select(range(min(take, len(loaded))))
        tokenize = functools.partial(tokenize_table, sources=(tokenize_args,), batch_rows=batch_size)
        mapped.append(loaded.with_format("arrow").map(
            tokenize, batched=True, batch_size=batch_size, num_proc=num_proc,
            remove_columns=loaded.column_names, load_from_cache_file=False))
    combined = mapped[0] if len(mapped) == 1 else datasets.concatenate_datasets(mapped)
    seconds = time.perf_counter() - start
    table = combined.with_format("arrow")[:]
    result = _measured(seconds, table.to_batches(max_chunksize=65536))
    del mapped, combined, table
    shutil.rmtree(cache_dir, ignore_errors=True)
    return result


def _rounds(runners: dict[str, Any], rounds: int) -> dict[str, list[Measured]]:
    """One untimed warm-up round, then `rounds` rounds in rotated order; every run's Measured."""
    for name in VARIANTS:
        runners[name]()
    results: dict[str, list[Measured]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in VARIANTS[r % 3:] + VARIANTS[: r % 3]:
            results[name].append(runners[name]())
    return results


def summarize(results: dict[str, list[Measured]], *, cpus: int, rounds: int) -> dict[str, Any]:
    """Medians, rates and ratios; RuntimeError when the variants did not produce the same rows."""
    first = {name: runs[0] for name, runs in results.items()}
    outputs = {(m.rows, m.tokens, m.digest) for runs in results.values() for m in runs}
    if len(outputs) != 1:
        raise RuntimeError(f"the variants tokenized different rows: {first}")
    rows, tokens = first["ray_1_task"].rows, first["ray_1_task"].tokens
    seconds = {name: statistics.median(m.seconds for m in runs) for name, runs in results.items()}
    rows_per_s = {name: rows / s for name, s in seconds.items()}
    return {
        "rows": rows, "tokens": tokens, "cpus": cpus, "rounds": rounds,
        "seconds": {name: [round(m.seconds, 3) for m in runs] for name, runs in results.items()},
        "rows_per_s": {name: round(v, 1) for name, v in rows_per_s.items()},
        "tokens_per_s": {name: round(tokens / s, 1) for name, s in seconds.items()},
        "speedup_vs_one_task": round(rows_per_s["ray_all_cpus"] / rows_per_s["ray_1_task"], 3),
        "speedup_vs_datasets_map": round(rows_per_s["ray_all_cpus"] / rows_per_s["datasets_map"], 3),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }


def format_report(summary: dict[str, Any], where: str) -> str:
    """The terminal table of `summary` (median of the rounds)."""
    cpus = summary["cpus"]
    names = {"ray_1_task": "this pipeline, 1 task", "ray_all_cpus": f"this pipeline, {cpus} tasks",
             "datasets_map": f"datasets.map(num_proc={cpus})"}
    lines = [f"bench data: {summary['rows']} rows, {summary['tokens']} tokens of {where}; {cpus} CPUs, "
             f"median of {summary['rounds']} rounds (load average {summary['load_average']})",
             f"{'variant':<28} {'median s':>9} {'rows/s':>9} {'tokens/s':>11}  runs (s)"]
    for name in VARIANTS:
        runs = ", ".join(f"{s:.2f}" for s in summary["seconds"][name])
        lines.append(f"{names[name]:<28} {statistics.median(summary['seconds'][name]):>9.2f} "
                     f"{summary['rows_per_s'][name]:>9.1f} {summary['tokens_per_s'][name]:>11.0f}  {runs}")
    lines.append(f"{cpus} tasks vs 1 task: {summary['speedup_vs_one_task']:.2f}x; vs datasets.map: "
                 f"{summary['speedup_vs_datasets_map']:.2f}x (rows/s)")
    return "\n".join(lines)
