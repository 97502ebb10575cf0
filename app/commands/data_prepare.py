"""`python -m app data prepare --config X --out DIR [--set ...] [--overwrite] [--json]`: tokenize once.

Resolves data.* as `train` does (before Ray starts: a bad path, tokenizer or template is exit 2), then on
Ray (embedded, or RAY_ADDRESS's cluster) tokenizes with data.tokenize_concurrency tasks at once (auto:
every CPU, nothing trains here; app/data/concurrency.py) and writes the rows as Parquet shards and their
manifest (app/data/prepared.py, app/data/prepare.py). Train from it with `--set data.source=prepared --set
data.path=DIR` and the same data.* settings (a difference is exit 2 naming the knob).

The tokenize tasks write the shards themselves (app/data/prepare.py), so a local DIR on a cluster of
several machines must be a filesystem they all mount (as run.storage_path); a shard the driver cannot see
afterwards is an error naming --out. Nothing is half-written:
    local DIR       the shards and the manifest go into a staging directory next to DIR, which replaces
                    DIR's part-*.parquet and manifest only when all are written (`staged_output`, as
                    `data synth`); a failure leaves DIR as it was
    object store    no rename exists there: the shards get names of their own (part-<token>-<hex>) and
                    the manifest, written last in one PUT, is the commit (a reader reads only the shards
                    it lists); then the shards of an earlier prepare are deleted. A failure deletes the
                    shards this prepare wrote and leaves the earlier manifest and its shards as they were
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import secrets
import time
from pathlib import Path
from typing import Any

from app.config import ConfigError, SkrullConfig

SHARD_PATTERN = "part-*.parquet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from app.commands.common import add_config_arguments, add_json_argument

    add_config_arguments(parser, required=True)
    parser.add_argument("--out", required=True, help="output directory or object-store URI (s3://...)")
    parser.add_argument("--overwrite", action="store_true", help="replace a prepared set already in --out")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from app.commands.common import config_from_args, format_summary

    summary = prepare(config_from_args(args), args.out, overwrite=args.overwrite)
    print(json.dumps(summary) if args.json else format_summary(summary, title="data prepare"))
    return 0


def prepare(config: SkrullConfig, out: str, *, overwrite: bool = False) -> dict[str, Any]:
    """Check everything, tokenize on Ray, write --out; the summary dict (`--json`)."""
    from app.data.concurrency import cluster_tokenize_tasks
    from app.data.resolved import resolve_data
    from app.train.cluster import ray_session
    from app.train.preflight import check_no_credentials_in_uris
    from workers.storage import Location, carries_credentials, redact_uri

    if config.data.source == "prepared":
        raise ConfigError("data.source=prepared is already prepared: `data prepare` reads the source a run "
                          "would tokenize (data.source synthetic, path or hf)")
    if carries_credentials(out):
        raise ConfigError(f"--out={redact_uri(out)!r} carries credentials: set them in the environment "
                          "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    check_no_credentials_in_uris(config)
    target = Location.of(out)
    _check_out(target, overwrite)
    data = resolve_data(config.data, max_length=config.max_sequence_length)
    started = time.perf_counter()
    with ray_session(config, worker_logs=False, training=False):
        tasks = cluster_tokenize_tasks(config, training=False)
        write = _write_local if target.is_local else _write_remote
        record = write(target, data, config, tasks)
    seconds = time.perf_counter() - started
    return {"out": str(target), "rows": record["rows"], "shards": len(record["shards"]),
            "tokens": record["tokens"], "label_tokens": record["label_tokens"],
            "counts": record["counts"], "formats": record["formats"], "sources": record["sources"],
            "tokenize_tasks": tasks,
            "seconds": round(seconds, 2), "rows_per_s": round(record["rows"] / max(seconds, 1e-9), 1)}


def _check_out(target: Any, overwrite: bool) -> None:
    """--out may be missing, empty, or a prepared set (with --overwrite); never someone else's files."""
    from app.data.prepared import MANIFEST

    try:
        if target.is_file():
            raise ConfigError(f"--out={str(target)!r} is a file, not a directory; choose another --out")
        names = target.listdir()
    except OSError as err:
        raise ConfigError(f"--out={str(target)!r} cannot be reached ({type(err).__name__}: "
                          f"{str(err).splitlines()[0]})") from None
    foreign = [name for name in names if name != MANIFEST and not fnmatch.fnmatch(name, SHARD_PATTERN)]
    if foreign:
        raise ConfigError(f"--out={str(target)!r} holds files `data prepare` did not write ({foreign[:3]}); "
                          "choose an empty or new --out")
    if names and not overwrite:
        raise ConfigError(f"--out={str(target)!r} already holds a prepared set ({len(names)} files); pass "
                          "--overwrite to replace it")


def _write_local(target: Any, data: Any, config: SkrullConfig, tasks: int) -> dict[str, Any]:
    from app.commands.staging import staged_output
    from app.data.prepare import write_prepared
    from app.data.prepared import MANIFEST
    from app.data.ray_ops import ShardTarget

    with staged_output(Path(target.uri), owned=(SHARD_PATTERN, MANIFEST)) as staging:
        record, _ = write_prepared(data, ShardTarget(str(staging)), num_cpus=config.resources.data_cpus,
                                   tasks=tasks, max_length=config.max_sequence_length)
        missing = [name for name, _ in record["shards"] if not (staging / name).is_file()]
        if missing:
            raise ConfigError(f"--out={str(target)!r}: {len(missing)} shards the tokenize tasks wrote are "
                              f"not there ({missing[0]}, ...): on a cluster of several machines --out must "
                              "be a filesystem every node mounts, or an object-store URI")
        (staging / MANIFEST).write_text(json.dumps(record, indent=1))
    return record


def _write_remote(target: Any, data: Any, config: SkrullConfig, tasks: int) -> dict[str, Any]:
    from app.data.prepare import write_prepared
    from app.data.prepared import MANIFEST
    from app.data.ray_ops import ShardTarget

    prefix = f"part-{secrets.token_hex(4)}-"
    try:
        record, _ = write_prepared(data, ShardTarget(target.uri, prefix), num_cpus=config.resources.data_cpus,
                                   tasks=tasks, max_length=config.max_sequence_length)
        (target / MANIFEST).write_text(json.dumps(record, indent=1))  # the commit
    except BaseException:
        for name in target.listdir():
            if name.startswith(prefix):
                with contextlib.suppress(OSError):  # the original error matters; an orphan is never read
                    (target / name).delete()
        raise
    kept = {name for name, _ in record["shards"]}
    for name in target.listdir():
        if fnmatch.fnmatch(name, SHARD_PATTERN) and name not in kept:
            (target / name).delete()
    return record
