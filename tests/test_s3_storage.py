"""Runs and data on an object store: a real S3-protocol server (moto_server) on loopback, no mock in-process.

The module starts `moto_server` on 127.0.0.1 and a free port, creates a bucket through it and sets the
AWS_* credentials in the environment the way a user would (before the module's Ray starts, so Ray's worker
processes inherit them). Everything the run writes is then read back through a fresh boto3 client, which
shares no code with pyarrow's S3 filesystem that wrote it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.config import ConfigError, DataConfig, load_config
from tests.run_configs import SMALL_VOCAB, shuffled_step_ids
from workers.storage import Location
from workers.tools.launch import free_port

pytestmark = pytest.mark.slow

BUCKET = "skrull-test"
NUM_SAMPLES = 16
BATCH = 8


@dataclass(frozen=True)
class S3Server:
    port: int
    client: object
    """A boto3 S3 client of the server (the reference reader)."""

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def uri(self, key: str, bucket: str = BUCKET) -> str:
        return f"s3://{bucket}/{key}?endpoint_override={self.endpoint}&scheme=http"

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        # Keys ending in "/" are the empty directory markers pyarrow's S3 filesystem creates: not files.
        keys = (o["Key"] for page in pages for o in page.get("Contents", []))
        return sorted(key for key in keys if not key.endswith("/"))

    def text(self, key: str) -> str:
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()


def _wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with code {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not listen on port {port} within {timeout_s} s")


@pytest.fixture(scope="module")
def s3(suite_ray) -> Iterator[S3Server]:
    """moto_server on loopback with one bucket; AWS credentials in the environment; stopped by its pid.

    The suite's Ray is restarted around the module: its processes must inherit these credentials, as a
    user's embedded Ray inherits the shell's, and no later module's Ray may keep them.
    """
    import boto3

    moto = Path(sys.executable).parent / "moto_server"  # from the dev extra: moto[server]
    port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "skrull-test-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", "skrull-test-secret")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        process = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        suite_ray.stop()
        try:
            _wait_for_port(port, process)
            client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
            client.create_bucket(Bucket=BUCKET)
            yield S3Server(port=port, client=client)
        finally:
            suite_ray.stop()
            process.terminate()
            process.wait(timeout=30)


# -- the storage module, on a local path and on the server ---------------------------------------------------
@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path: Path) -> Iterator[tuple[Location, object]]:
    """(a fresh directory Location, a reader of one of its files by relative key using another client)."""
    if request.param == "local":
        yield Location.of(tmp_path / "root"), lambda key: (tmp_path / "root" / key).read_text()
        return
    s3 = request.getfixturevalue("s3")
    prefix = f"unit-{request.node.name.replace('[', '-').rstrip(']')}-{time.monotonic_ns()}"
    yield Location.of(s3.uri(prefix)), lambda key: s3.text(f"{prefix}/{key}")


def test_location_reads_writes_appends_lists_and_removes(root) -> None:
    where, reference = root
    assert not where.exists() and where.listdir() == [] and where.files() == []
    (where / "run" / "config.json").write_text('{"a": 1}')
    (where / "run" / "config.json").write_text('{"a": 2}')  # atomic replace
    log = where / "run" / "samples.jsonl"
    log.append_lines(["first"])
    log.append_lines(["second", "third"])
    (where / "run" / "logs" / "driver.log").write_text("hello\n")
    assert reference("run/config.json") == '{"a": 2}'
    assert reference("run/samples.jsonl") == "first\nsecond\nthird\n"
    assert log.read_text() == "first\nsecond\nthird\n"
    assert (where / "run").is_dir() and log.is_file() and not (where / "nope").exists()
    assert (where / "run").listdir() == ["config.json", "logs", "samples.jsonl"]
    assert [f.name for f in (where / "run").files()] == ["config.json", "driver.log", "samples.jsonl"]
    (where / "run").delete()
    assert not (where / "run").exists() and (where / "run").files() == []
    (where / "run").delete()  # removing what is gone is not an error


def test_a_read_while_another_process_replaces_the_object_is_one_whole_version(s3: S3Server) -> None:
    """pyarrow reads an object as a HEAD (its size) and then a ranged GET: an object replaced in between
    came back cut to the old size or with a garbage tail (a lease renewed mid-read parsed as broken JSON).
    Another client rewrites one key every 50 ms (a lease renews every few seconds), each version new and
    alternately short and long, as a lease's renewals are; every read is one whole version."""
    import threading

    key = f"torn-{time.monotonic_ns()}.json"
    written = ['{"renewed": 0}']
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=written[0].encode())
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            text = json.dumps({"renewed": len(written), "pad": "x" * 64 * (len(written) % 2)})
            written.append(text)
            s3.client.put_object(Bucket=BUCKET, Key=key, Body=text.encode())
            stop.wait(0.05)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        where = Location.of(s3.uri(key))
        seen: list[bytes] = []
        deadline = time.monotonic() + 30  # reads until the writer has replaced the object 20 times
        while (len(seen) < 150 or len(written) <= 20) and time.monotonic() < deadline:
            seen.append(where.read_bytes())
    finally:
        stop.set()
        writer.join(timeout=30)
    assert len(written) > 20, "the writer did not keep up: nothing was read mid-replacement"
    torn = [data for data in seen if data.decode("utf-8", "replace") not in set(written)]
    assert not torn, torn[:3]


def test_a_uri_keeps_its_query_and_hides_secrets() -> None:
    run = Location.of("s3://b/runs?endpoint_override=h:1&scheme=http&secret_key=SECRET") / "x"
    assert run.uri == "s3://b/runs/x?endpoint_override=h:1&scheme=http&secret_key=SECRET"
    assert run.path == "b/runs/x" and run.name == "x" and not run.is_local
    assert "SECRET" not in str(run) and "endpoint_override=h:1" in str(run)
    local = Location.of("relative/dir")
    assert local.is_local and local.local == Path("relative/dir").resolve()


def test_aws_endpoint_url_from_the_environment_is_enough(s3: S3Server, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3.endpoint}")
    plain = Location(f"s3://{BUCKET}/env-endpoint/{time.monotonic_ns()}.txt")
    plain.write_text("via AWS_ENDPOINT_URL")
    assert s3.text(plain.path.split("/", 1)[1]) == "via AWS_ENDPOINT_URL"


def test_preflight_names_the_key_of_an_unusable_store(s3: S3Server) -> None:
    from app.data.readers import resolve_source
    from app.rundir.location import run_location

    config = load_config("configs/tiny-cpu.yaml", [f"run.storage_path={s3.uri('runs', bucket='missing')}"])
    with pytest.raises(ConfigError, match=r"run\.storage_path=.*(NO_SUCH_BUCKET|does not exist).*"
                                          r"AWS_ACCESS_KEY_ID"):
        run_location(config, "x")
    unknown = load_config("configs/tiny-cpu.yaml", ["run.storage_path=nosuch://b/runs"])
    with pytest.raises(ConfigError, match=r"run\.storage_path='nosuch://b/runs' is not a directory or a "
                                          r"filesystem URI"):
        run_location(unknown, "x")
    with pytest.raises(ConfigError, match=r"data\.path=.*does not exist"):
        resolve_source(DataConfig(source="path", path=s3.uri("data/none.parquet")))
    with pytest.raises(ConfigError, match=r"data\.format=hf"):
        resolve_source(DataConfig(source="path", path=s3.uri("data/none"), format="hf"))


def test_data_on_the_store_reads_like_the_same_local_files(s3: S3Server, tmp_path: Path) -> None:
    """resolve_source + iter_local_rows (the `plan` path) through S3 give exactly the local files' rows."""
    from pyarrow import fs

    from app.data.readers import iter_local_rows, resolve_source

    _synth_parquet(tmp_path / "d", n=12)
    fs.copy_files(str(tmp_path / "d"), f"{BUCKET}/rows-test", source_filesystem=fs.LocalFileSystem(),
                  destination_filesystem=Location.of(s3.uri("rows-test")).filesystem)
    remote = resolve_source(DataConfig(source="path", path=s3.uri("rows-test")))
    local = resolve_source(DataConfig(source="path", path=str(tmp_path / "d")))
    assert remote.format == local.format == "parquet" and remote.columns == local.columns
    assert remote.files == (f"{BUCKET}/rows-test/part-00000.parquet",)
    assert list(iter_local_rows(remote, 5)) == list(iter_local_rows(local, 5))


def test_the_driver_mirror_keeps_driver_files_and_never_touches_the_workers(s3: S3Server) -> None:
    """pull_mirror brings back the driver's files only; push_mirror adds to them and removes the mirror."""
    from workers.storage import pull_mirror, push_mirror

    run = Location.of(s3.uri(f"mirror-{time.monotonic_ns()}"))
    prefix = run.path.split("/", 1)[1]
    for key, text in [("logs/driver.log", "call 1\n"), ("samples.jsonl", "{}\n"),
                      ("skrull_config.json", "{}"), ("checkpoint_2026/latest", "step2"),
                      ("checkpoint_manager_snapshot.json", "{}")]:
        (run / key).write_text(text)
    mirror = pull_mirror(run)
    assert sorted(str(p.relative_to(mirror)) for p in mirror.rglob("*") if p.is_file()) == ["logs/driver.log"]
    with (mirror / "logs" / "driver.log").open("a") as log:
        log.write("call 2\n")
    (mirror / "tensorboard").mkdir()
    (mirror / "tensorboard" / "events").write_text("e")
    push_mirror(mirror, run)
    assert not mirror.exists()
    assert s3.text(f"{prefix}/logs/driver.log") == "call 1\ncall 2\n"
    assert s3.text(f"{prefix}/tensorboard/events") == "e" and s3.text(f"{prefix}/samples.jsonl") == "{}\n"
    assert len(s3.keys(prefix)) == 6


def test_a_config_error_of_a_new_s3_run_leaves_nothing_behind(s3: S3Server) -> None:
    """run_console's "nothing half-written" rule on a store: a new run is removed there and locally; an
    existing run keeps everything and gets the mirror copied in."""
    from app.rundir.snapshot import write_snapshot
    from app.train.console import run_console
    from workers.storage import pull_mirror

    config = load_config("configs/tiny-cpu.yaml")
    for existed in (False, True):
        run = Location.of(s3.uri(f"cfg-error-{existed}"))
        write_snapshot(config, run, template="{{ messages }}")  # any template text
        mirror = pull_mirror(run)
        console = run_console(mirror, quiet=False, out=None, existed=existed, remote=run)
        with pytest.raises(ConfigError), console:
            (mirror / "data_summary.json").write_text("{}")
            raise ConfigError("scheduling.global_batch_size is too large")
        assert not mirror.exists()
        expected = [f"cfg-error-{existed}/{name}"
                    for name in ("chat_template.jinja", "data_summary.json", "skrull_config.json")]
        assert s3.keys(f"cfg-error-{existed}/") == (expected if existed else [])


def _synth_parquet(out: Path, n: int) -> None:
    """`data synth` (the command's own writer): n LMSYS-like chats, short (length scale 0.1)."""
    from app.commands.data import synthesize

    synthesize(argparse.Namespace(dist="lmsys", n=n, out=str(out), seed=0, length_scale=0.1, tokenizer="qwen",
                                  rows_per_file=50_000, overwrite=False))


# -- a training run on the store ---------------------------------------------------------------------------
def _run_config(s3: S3Server, steps: int, *extra: str):
    return load_config("configs/tiny-cpu.yaml", [
        f"run.storage_path={s3.uri('runs')}", "run.name=s3run", "data.source=path",
        f"data.path={s3.uri('data/x.parquet')}", "data.shuffle=true", f"scheduling.global_batch_size={BATCH}",
        f"train.steps={steps}", "train.checkpoint_every=2", "train.keep_checkpoints=0", SMALL_VOCAB, *extra])


@pytest.fixture(scope="module")
def runs(s3: S3Server, local_ray, tmp_path_factory) -> dict[str, object]:
    """Train 2 steps (a checkpoint at 2) on S3 data into S3; test_rerunning_the_name_resumes_... resumes it.

    The resumed call runs in that test, not here: each of the two Ray runs is charged to its own test.
    """
    from pyarrow import fs

    from app.train.driver import train

    data = tmp_path_factory.mktemp("synth")
    _synth_parquet(data, n=NUM_SAMPLES)
    fs.copy_files(str(data / "part-00000.parquet"), f"{BUCKET}/data/x.parquet",
                  source_filesystem=fs.LocalFileSystem(),
                  destination_filesystem=Location.of(s3.uri("data")).filesystem)
    first = train(_run_config(s3, 2, "train.export_on_finish=false"), progress=False, quiet=True)
    return {"first": first, "after_first": s3.keys("runs/s3run/"),
            "first_log": s3.text("runs/s3run/logs/driver.log")}


def test_a_run_on_s3_writes_its_checkpoints_samples_and_config_to_the_bucket(s3: S3Server, runs) -> None:
    first, keys = runs["first"], runs["after_first"]
    assert first.steps == 2 and first.resumed_from_step is None
    assert first.run_dir == s3.uri("runs/s3run")
    assert first.checkpoint and first.checkpoint.startswith(f"s3://{BUCKET}/runs/s3run/checkpoint_")
    checkpoints = {k.split("/")[2] for k in keys if k.split("/")[2].startswith("checkpoint_20")}
    assert len(checkpoints) == 1, keys  # step 2: DeepSpeed's files and the cursor
    name = checkpoints.pop()
    assert {f"runs/s3run/{name}/latest", f"runs/s3run/{name}/step2/mp_rank_00_model_states.pt"} <= set(keys)
    state = json.loads(s3.text(f"runs/s3run/{name}/skrull_state.json"))
    assert state["step"] == 2 and state["dp_size"] == 1 and state["cp_size"] == 2
    snapshot = json.loads(s3.text("runs/s3run/skrull_config.json"))
    assert snapshot["run"]["storage_path"] == s3.uri("runs") and snapshot["train"]["steps"] == 2
    # The driver's mirror was copied in: the captured log and the TensorBoard event file.
    assert "runs/s3run/logs/driver.log" in keys
    assert any(k.startswith("runs/s3run/tensorboard/events.out.tfevents") for k in keys)


def test_rerunning_the_name_resumes_from_the_buckets_checkpoint(s3: S3Server, runs) -> None:
    from app.train.driver import train

    resumed = train(_run_config(s3, 4), progress=False, quiet=True)
    assert resumed.resumed_from_step == 2 and [h["step"] for h in resumed.history] == [3, 4]
    # 4 steps x 8 samples = two epochs of 16, written by world rank 0 through S3 across both calls:
    # every sample id exactly once per epoch, every step once, each step the next batch of its epoch's
    # shuffled order (data.shuffle) across the resume.
    by_epoch: dict[int, list[int]] = defaultdict(list)
    by_step: dict[int, set[int]] = defaultdict(set)
    steps = []
    for line in s3.text("runs/s3run/samples.jsonl").splitlines():
        record = json.loads(line)
        by_epoch[record["epoch"]].extend(record["sample_ids"])
        by_step[record["step"]].update(record["sample_ids"])
        steps.append(record["step"])
    assert steps == [1, 2, 3, 4]
    assert by_step == {step: shuffled_step_ids(step, NUM_SAMPLES, BATCH) for step in steps}
    assert {epoch: sorted(ids) for epoch, ids in by_epoch.items()} == {
        0: list(range(NUM_SAMPLES)), 1: list(range(NUM_SAMPLES))}
    # The resumed call kept the first call's log (pulled into its mirror, appended, copied back) and added
    # its own TensorBoard event file beside the first one.
    keys = s3.keys("runs/s3run/")
    assert s3.text("runs/s3run/logs/driver.log").startswith(runs["first_log"])
    assert sum(k.startswith("runs/s3run/tensorboard/events.out.tfevents") for k in keys) == 2
    assert any(k.startswith("runs/s3run/checkpoint_20") and "/step4/" in k for k in keys)  # the new one
    _check_the_model_in_the_bucket(s3, runs, resumed, keys)


def _check_the_model_in_the_bucket(s3: S3Server, runs, resumed, keys: list[str]) -> None:
    """The first call (train.export_on_finish=false) left no model; the resumed one (the default) wrote
    hf/ into the bucket from its workers, which gives the logits of `export`'s files within 1e-6 (`export`
    of the run directory in the bucket: its newest checkpoint, fetched to local disk), and left no staging
    behind."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from app.model.export import export

    assert runs["first"].export is None and not [k for k in runs["after_first"] if "hf" in k.split("/")[2]]
    assert resumed.export == s3.uri("runs/s3run/hf")
    assert not [k for k in keys if ".hf-export" in k]
    with tempfile.TemporaryDirectory() as tmp:
        own, exported = Path(tmp, "hf"), Path(tmp, "export")
        for key in (k for k in keys if k.startswith("runs/s3run/hf/")):
            (own / key[len("runs/s3run/hf/"):]).parent.mkdir(parents=True, exist_ok=True)
            s3.client.download_file(BUCKET, key, str(own / key[len("runs/s3run/hf/"):]))
        # `export` reads the run directory in the bucket: its config, Ray Train's newest checkpoint (4)
        result = export(resumed.run_dir, str(exported), dtype="fp32")
        assert result.step == 4 and result.kind == "model"
        assert {p.name for p in own.iterdir()} == {p.name for p in exported.iterdir()}
        ids = torch.randint(0, 773, (1, 40), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours, theirs = (AutoModelForCausalLM.from_pretrained(str(d)).eval()(ids).logits
                            for d in (own, exported))
        assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-6


def test_data_prepare_writes_its_shards_and_manifest_to_the_bucket(s3: S3Server, runs, capsys) -> None:
    """`data prepare --out s3://...` on the module's Ray: the shards, then the manifest (the commit), in the
    bucket; the rows read back through data.source=prepared equal the bucket data tokenized here. Again with
    --overwrite: new shards, then the old ones deleted; without it: exit 2, nothing touched."""
    from app.__main__ import main
    from app.data.preview import preview_rows
    from app.data.readers import iter_local_rows, resolve_source
    from app.data.resolved import template_settings
    from app.data.template import tokenize_rows

    source = s3.uri("data/x.parquet")
    argv = ["data", "prepare", "--config", "configs/tiny-cpu.yaml", "--out", s3.uri("prepared"), "--json",
            "--set", "data.source=path", "--set", f"data.path={source}", "--set", SMALL_VOCAB]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == NUM_SAMPLES
    manifest = json.loads(s3.text("prepared/skrull_prepared.json"))
    first = [f"prepared/{name}" for name, _ in manifest["shards"]]
    assert s3.keys("prepared/") == sorted(["prepared/skrull_prepared.json", *first])
    assert manifest["source"]["data.path"] == source
    config = load_config("configs/tiny-cpu.yaml", ["data.source=prepared", f"data.path={s3.uri('prepared')}",
                                                   SMALL_VOCAB])
    rows, tok = preview_rows(config, NUM_SAMPLES + 1)
    raw = load_config("configs/tiny-cpu.yaml", ["data.source=path", f"data.path={source}", SMALL_VOCAB])
    ref = tokenize_rows([r for b in iter_local_rows(resolve_source(raw.data), 64) for r in b], tok,
                        template_settings(raw.data, raw.max_sequence_length))
    assert [r.input_ids for r in rows] == [ids.tolist() for ids in ref.input_ids]
    assert [r.labels for r in rows] == [labels.tolist() for labels in ref.labels]
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    again = json.loads(s3.text("prepared/skrull_prepared.json"))
    second = [f"prepared/{name}" for name, _ in again["shards"]]
    assert not set(first) & set(second)
    assert s3.keys("prepared/") == sorted(["prepared/skrull_prepared.json", *second])


# -- one writer per run: the lease on the store (app/rundir/lock.py; the local lock: test_run_safety.py) --
def _lease_run(s3: S3Server) -> Location:
    return Location.of(s3.uri(f"lease-{time.monotonic_ns()}"))


def test_a_second_holder_of_an_s3_run_is_refused_and_the_heartbeat_renews(s3: S3Server) -> None:
    from app.rundir.lock import LEASE_FILE, Lease, RunLocked

    run = _lease_run(s3)
    first = Lease(run, out=sys.stderr, heartbeat_s=0.2, settle_s=0.05)
    first.acquire()
    try:  # a failure must not leave the heartbeat thread renewing against a stopped server
        granted = json.loads((run / LEASE_FILE).read_text())
        with pytest.raises(RunLocked, match=rf"host {socket.gethostname()}, pid {os.getpid()}, started "
                                            r".*renewed \d+ s ago"):
            Lease(run, out=sys.stderr, settle_s=0.05).acquire()
        deadline = time.monotonic() + 10
        while json.loads((run / LEASE_FILE).read_text())["renewed"] == granted["renewed"]:
            assert time.monotonic() < deadline, "the heartbeat never renewed the lease"
            time.sleep(0.1)
    finally:
        first.release()
    assert not (run / LEASE_FILE).exists()


@pytest.mark.parametrize("holder", ["expired", "dead_here"])
def test_a_stale_s3_lease_is_taken_over_with_a_warning(s3: S3Server, capsys, holder: str) -> None:
    """Not renewed for longer than the bound (another host), or renewed just now by a process of this
    host that no longer exists."""
    from app.rundir.lock import LEASE_FILE, LEASE_TIMEOUT_S, Lease

    run = _lease_run(s3)
    gone = subprocess.Popen(["true"])
    gone.wait()
    if holder == "expired":
        stale = {"host": "elsewhere", "pid": 1, "renewed": time.time() - LEASE_TIMEOUT_S - 5}
    else:
        stale = {"host": socket.gethostname(), "pid": gone.pid, "renewed": time.time()}
    (run / LEASE_FILE).write_text(json.dumps({**stale, "started": "2026-01-01T00:00:00", "token": "old"}))
    lease = Lease(run, out=sys.stderr, settle_s=0.05)
    lease.acquire()
    assert json.loads((run / LEASE_FILE).read_text())["pid"] == os.getpid()
    lease.release()
    err = capsys.readouterr().err
    assert "taking over the lease" in err and f"pid {stale['pid']}" in err


def test_a_holder_whose_lease_was_taken_over_stops_and_leaves_it_alone(s3: S3Server) -> None:
    from app.rundir.lock import LEASE_FILE, Lease

    run, lost = _lease_run(s3), []
    lease = Lease(run, out=sys.stderr, on_lost=lambda: lost.append(True), settle_s=0.05)
    lease.acquire()
    taker = {"host": "elsewhere", "pid": 7, "started": "now", "token": "taker", "renewed": time.time()}
    (run / LEASE_FILE).write_text(json.dumps(taker))
    assert lease.renew() is False and lost == [True]
    lease.release()
    assert json.loads((run / LEASE_FILE).read_text())["token"] == "taker"
