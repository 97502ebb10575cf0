"""Checks that run on the driver before any worker starts, so bad input fails fast with one message.

Before Ray (`preflight`): the config tree already rejected unknown keys, bad choices and a world size not
divisible by CP (its sections validate themselves, app/config.py); here the model source is resolved (a
hub id through its config only, honoring HF_HUB_OFFLINE), the data source and tokenizer are opened, the
hardware profile is loaded strictly and the output directory must be writable. The model must be one
the training path computes exactly (no sliding window shorter than the max sequence length, no logit
soft-capping, ...) and the tokenizer's ids must fit its vocabulary (app/model/support.py).

Secrets: a URI with credentials in it (user:password@, access_key / secret_key / session_token) is refused
(the environment holds them), and every message naming run.storage_path or data.path shows the URI with its
secrets redacted (workers/storage.py redact_uri / redact_text); the config snapshot holds redacted URIs.

With Ray up, before the trainer (`check_cluster_fits`, `check_epoch_fits`): the requested workers fit the
cluster's resources, and one global batch fits one epoch of usable rows. Every failure is a ConfigError,
which `python -m app` turns into exit code 2 and one line naming the knob.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from app.config import CREDENTIAL_HINT, ConfigError, ModelConfig, SkrullConfig
from app.rundir.resume_checkpoints import set_aside_unloadable_checkpoints
from workers.presets import TINY_PRESETS, is_tiny_preset
from workers.storage import Location, carries_credentials, is_remote, redact_text, redact_uri

# A Hugging Face hub id: "name" or "org/name", no path syntax.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def check_model_source(model: ModelConfig) -> None:
    """A tiny preset, an existing local directory, or a hub id whose config resolves (no weights read)."""
    name = model.name_or_path
    if is_tiny_preset(name) or Path(name).expanduser().is_dir():
        return
    looks_like_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
    if looks_like_path or not _HUB_ID.match(name):
        raise ConfigError(
            f"model.name_or_path={name!r} is not an existing directory, a hub id (org/name) or a "
            f"preset ({', '.join(TINY_PRESETS)}); fix model.name_or_path"
        )
    from transformers import AutoConfig

    # huggingface_hub reads HF_HUB_OFFLINE once, at import: a value set later in this process (a notebook,
    # a test) would be ignored and a typo would cost ~23 s of retries against an unreachable hub.
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    try:
        AutoConfig.from_pretrained(name, local_files_only=offline)  # the hub, or its local cache only
    except (OSError, ValueError) as err:
        hub = "the Hugging Face hub cache (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face hub"
        raise ConfigError(
            f"model.name_or_path={name!r} is not a preset ({', '.join(TINY_PRESETS)}), not a local "
            f"directory, and {hub} does not resolve it: {str(err).splitlines()[0]}; fix model.name_or_path"
        ) from None


def run_name(config: SkrullConfig) -> str:
    """run.name, or a fresh unique name when it is empty (timestamp plus a random suffix)."""
    return config.run.name or f"skrull-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


CONFIG_SNAPSHOT = "skrull_config.json"
"""The config a run started with (URIs redacted); a resumed run is compared with it (check_resume)."""
DATA_SNAPSHOT = "skrull_data.json"
"""The data the run started with: {"data.path": fingerprint, "data.eval_path": fingerprint or absent}
(app/data/fingerprint.py), compared like the math keys; a run without one (older) resumes unchecked."""
TEMPLATE_SNAPSHOT = "chat_template.jinja"
"""The chat template the run rendered its chats with (absent: data.chat_template=none, or an older run)."""
MATH_KEYS = (
    "model.name_or_path", "model.random_init", "model.dtype", "model.vocab_size", "model.hidden_size",
    "model.num_layers", "model.num_attention_heads", "model.num_key_value_heads", "model.intermediate_size",
    "data.source", "data.path", "data.format", "data.distribution", "data.num_samples", "data.seed",
    "data.length_scale", "data.tokenizer", "data.chat_template", "data.labels", "data.max_length",
    "data.too_long", "data.truncate_side", "scheduling.global_batch_size", "train.lr", "train.weight_decay",
    "train.warmup_steps", "train.grad_clip", "train.seed", "train.zero_stage",
    "data.eval_fraction", "data.eval_path", "data.shuffle", "data.format_type", "data.columns",
    "data.add_eos",
    "data.name", "data.split", "data.data_files",
    "model.lora.r", "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules",
)
"""Keys that change what a step computes; resuming with another value needs train.allow_config_change."""


LEGACY_VALUES: dict[str, Any] = {"data.shuffle": False, "data.format_type": "auto", "data.add_eos": False}
"""What a run snapshotted before a key existed did, where that differs from today's default: it read its
file data in stream order, and appended no EOS to `text` rows."""
LEGACY_RENAMES: dict[tuple[str, bool], str] = {("data.chat_template", True): "chatml",
                                               ("data.chat_template", False): "none"}
"""data.chat_template was a bool: true rendered ChatML, false plain text."""


def run_storage(config: SkrullConfig, name: str) -> Location:
    """<storage_path>/<name> (a local directory or an object-store URI, workers/storage.py), after checking
    that storage_path is usable and writable; nothing of the run is read or written yet."""
    storage = _storage_location(config.run.storage_path)
    _check_writable(storage)
    return storage / name


def run_location(config: SkrullConfig, name: str) -> Location:
    """run_storage, set_aside_unloadable_checkpoints, then check_resume: a new run, or an existing one to
    resume (same math, from a checkpoint that loads)."""
    run = run_storage(config, name)
    set_aside_unloadable_checkpoints(run)  # app/rundir/resume_checkpoints.py: resume only what loads
    check_resume(config, run)
    return run


def run_directory(config: SkrullConfig, name: str) -> Path:
    """run_location for commands that need a local run directory (`bench train`)."""
    if is_remote(config.run.storage_path):
        raise ConfigError(f"run.storage_path={redact_uri(config.run.storage_path)!r}: this command writes a "
                          "local run directory; point run.storage_path at a local or mounted directory")
    local = run_location(config, name).local
    assert local is not None
    return local


def _dotted(tree: dict[str, Any], key: str) -> Any:
    """The value at a dotted key of a config dict (nested sections: model.lora.r), or None when absent."""
    node: Any = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def recorded_step(run_dir: str | Path | Location) -> int:
    """The step of the newest checkpoint Ray Train recorded for the run (what a rerun resumes), or 0.

    Ray Train's controller records a checkpoint in this snapshot once every worker has reported it; a
    checkpoint directory not recorded there (the driver stopped first) is never resumed from.
    """
    try:
        snapshot = json.loads((Location.of(run_dir) / "checkpoint_manager_snapshot.json").read_text())
        return max((int(r["metrics"]["step"]) for r in snapshot["checkpoint_results"]), default=0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def check_resume(config: SkrullConfig, run_dir: str | Path | Location,
                 data: dict[str, Any] | None = None) -> bool:
    """Whether this call resumes a checkpoint of the run (False: it starts fresh).

    A finished run is not rerun. A run without a complete checkpoint has nothing to resume: it starts
    fresh with this config, whatever its snapshot says (a start that failed before its first checkpoint
    must not block its own fix). Resuming a checkpoint, one ConfigError lists every math key that differs
    from the run's snapshot, and with `data` (this call's data fingerprints, `preflight`'s result) every
    dataset whose files differ from those the run started with (DATA_SNAPSHOT), unless
    train.allow_config_change.
    """
    run_dir = Location.of(run_dir)
    done = recorded_step(run_dir)
    if config.train.steps and done >= config.train.steps:
        raise ConfigError(f"run {run_dir.name!r} already trained {done} steps (train.steps="
                          f"{config.train.steps}); raise train.steps to train it further, or use another "
                          "run.name")
    snapshot = run_dir / CONFIG_SNAPSHOT
    if done == 0 or config.train.allow_config_change or not snapshot.exists():
        return done > 0
    changed = _changed_math(json.loads(snapshot.read_text()), snapshot_record(config))
    if data is not None:
        changed += _changed_data(run_dir, data)
    if changed:
        raise ConfigError(
            f"run {run_dir.name!r} exists and resuming it would change its math: {'; '.join(changed)}. "
            "Use another run.name, or --set train.allow_config_change=true to resume anyway"
        )
    return True


def _changed_math(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every math key that differs (URIs compared redacted: snapshots hold them so)."""
    defaults = SkrullConfig().to_dict()  # a run snapshotted before a key existed ran with its default

    def value(tree: dict[str, Any], key: str) -> Any:
        found = _dotted(tree, key)
        if found is None:
            found = LEGACY_VALUES[key] if key in LEGACY_VALUES else _dotted(defaults, key)
        found = LEGACY_RENAMES.get((key, found), found) if isinstance(found, bool) else found
        found = list(found) if isinstance(found, tuple) else found  # the JSON snapshot holds lists
        return redact_uri(found) if isinstance(found, str) else found

    return [f"{key}: {value(before, key)!r} -> {value(now, key)!r}" for key in MATH_KEYS
            if value(before, key) != value(now, key)]


def _changed_data(run_dir: Location, data: dict[str, Any]) -> list[str]:
    """`data.path: the data changed (...)` for every dataset whose fingerprint differs from the run's."""
    from app.data.fingerprint import describe_change

    recorded = run_dir / DATA_SNAPSHOT
    if not recorded.exists():
        return []  # a run from before data fingerprints: resumed as before
    before = json.loads(recorded.read_text())
    return [f"{key}: the data changed ({describe_change(before[key], data[key])})" for key in data
            if key in before and before[key] != data[key]]


def snapshot_record(config: SkrullConfig) -> dict[str, Any]:
    """The config as the snapshot holds it: every URI without its secrets (redact_uri)."""
    def redacted(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: redacted(value) for key, value in node.items()}
        return redact_uri(node) if isinstance(node, str) else node

    return redacted(config.to_dict())


def write_snapshot(config: SkrullConfig, run_dir: str | Path | Location, data: dict[str, Any] | None = None,
                   *, fresh: bool = True) -> bool:
    """Record the config (and `data`, the data fingerprints) of a run that starts fresh; a resumed run
    (`fresh=False`) keeps the first ones. Each file is written atomically.

    Returns True when a different snapshot of an earlier call was replaced (a run that never reached a
    checkpoint, started again).
    """
    run_dir = Location.of(run_dir)
    snapshot, record = run_dir / CONFIG_SNAPSHOT, snapshot_record(config)
    replaced = False
    if not snapshot.exists() or fresh:
        replaced = snapshot.exists() and json.loads(snapshot.read_text()) != record
        snapshot.write_text(json.dumps(record, indent=1))
    if data is not None and (fresh or not (run_dir / DATA_SNAPSHOT).exists()):
        (run_dir / DATA_SNAPSHOT).write_text(json.dumps(data, indent=1))
    if fresh or not (run_dir / TEMPLATE_SNAPSHOT).exists():
        _write_template_snapshot(config, run_dir)
    return replaced


def _write_template_snapshot(config: SkrullConfig, run_dir: Location) -> None:
    """The chat template text the run renders with (app/model/export_tokenizer.py run_chat_template), so that
    `export` ships exactly it even when the Jinja file or the tokenizer's template changed since."""
    from app.model.export_tokenizer import run_chat_template

    text = run_chat_template(config.data)
    target = run_dir / TEMPLATE_SNAPSHOT
    if text is not None:
        target.write_text(text)
    elif target.exists():
        target.delete()


_REMOTE_HINT = ("check that the bucket exists, the endpoint (endpoint_override=HOST:PORT&scheme=http in the "
                "URI, or AWS_ENDPOINT_URL) and the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE; AWS_DEFAULT_REGION)")


def _storage_location(storage_path: str) -> Location:
    """run.storage_path as a Location; a URI no pyarrow filesystem understands is a ConfigError."""
    try:
        storage = Location.of(storage_path)
        storage.filesystem  # noqa: B018 - parses the URI (scheme, query options) now
    except (ValueError, OSError, ImportError) as err:
        raise ConfigError(f"run.storage_path={redact_uri(storage_path)!r} is not a directory or a filesystem "
                          f"URI pyarrow understands ({redact_text(str(err), storage_path)}); fix "
                          "run.storage_path") from None
    return storage


def _check_writable(storage: Location) -> None:
    """run.storage_path exists (or can be made) and accepts files: checked by writing one and removing it.

    On an object store this is one PUT and one DELETE under the prefix: it fails on a missing bucket,
    an unreachable endpoint (after the SDK's retries, ~6 s measured against a closed port) or bad
    credentials.
    """
    local = storage.local
    if local is not None:
        try:
            local.mkdir(parents=True, exist_ok=True)
            probe = local / f".skrull-write-test-{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ConfigError(
                f"run.storage_path={str(local)!r} is not a writable directory ({err.strerror}); "
                "point run.storage_path at a directory you can write"
            ) from None
        return
    probe = storage / f".skrull-write-test-{secrets.token_hex(4)}"
    try:
        probe.write_text("")
        probe.delete()
    except OSError as err:
        why = redact_text(str(err).splitlines()[0], storage.uri)
        raise ConfigError(f"run.storage_path={str(storage)!r} is not writable ({why}); {_REMOTE_HINT}, or "
                          "fix run.storage_path") from None


def preflight(config: SkrullConfig) -> dict[str, Any]:
    """Model, data source, tokenizer, hardware profile: everything that can be checked without Ray.

    Returns the data fingerprints of the run ({"data.path": ..., "data.eval_path": ...}, the second only
    with data.eval_path; app/data/fingerprint.py), read from the files the checks resolved.
    """
    from app.data.chat_template import check_chat_template
    from app.data.fingerprint import data_fingerprint
    from app.data.formats import check_format_settings
    from app.data.pipeline import template_settings
    from app.data.readers import resolve_source
    from app.data.tokenizer import load_tokenizer
    from app.model.support import check_model_support
    from app.profiling.hardware import load_hardware_profile
    from app.sinks.mlflow import check_mlflow
    from app.sinks.wandb import check_wandb

    check_no_credentials_in_uris(config)
    check_mlflow(config.train.mlflow_uri)
    check_wandb(config.train.wandb_project)
    check_model_source(config.model)
    check_format_settings(config.data.format_type, config.data.columns)  # app/data/formats/
    source = resolve_source(config.data) if config.data.source != "synthetic" else None
    eval_source = check_eval_source(config)
    tokenizer = load_tokenizer(config.data.tokenizer)
    check_model_support(config, tokenizer)  # app/model/support.py
    check_chat_template(tokenizer, template_settings(config.data, None))  # app/data/chat_template.py
    load_hardware_profile(config.hardware.profile)
    fingerprints = {"data.path": data_fingerprint(config.data, source)}
    if eval_source is not None:
        fingerprints["data.eval_path"] = data_fingerprint(config.data, eval_source, config.data.eval_path)
    return fingerprints


def check_no_credentials_in_uris(config: SkrullConfig) -> None:
    """A URI with credentials in it is refused (every message and file naming it would carry them): they
    go in the environment. run.storage_path is checked when the config loads (RunConfig)."""
    for key, uri in (("data.path", config.data.path), ("data.eval_path", config.data.eval_path)):
        if carries_credentials(uri):
            raise ConfigError(f"{key}={redact_uri(uri)!r} carries credentials (user:password@ or "
                              f"{CREDENTIAL_HINT}")
    if carries_credentials(config.train.mlflow_uri):
        raise ConfigError(f"train.mlflow_uri={redact_uri(config.train.mlflow_uri)!r} carries credentials "
                          "(user:password@): remove them and set MLFLOW_TRACKING_USERNAME / "
                          "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment")


def check_eval_source(config: SkrullConfig) -> Any:
    """train.eval_every needs an eval set; data.eval_path must be a readable dataset (errors name it).

    Returns data.eval_path's resolved DataSource, or None without data.eval_path.
    """
    from app.data import DataError
    from app.data.readers import resolve_source
    from app.data.split import as_eval_path_error, eval_data_config

    data = config.data
    if config.train.eval_every and not (data.eval_fraction or data.eval_path):
        raise ConfigError(f"train.eval_every={config.train.eval_every} needs an eval set: set "
                          "data.eval_fraction (hold samples out) or data.eval_path, or train.eval_every=0")
    if not data.eval_path:
        return None
    try:
        return resolve_source(eval_data_config(data))
    except DataError as err:
        raise as_eval_path_error(err, data) from None


def required_resources(config: SkrullConfig) -> dict[str, float]:
    """What a run needs to start: its (minimum) train workers, the planner and one Ray Data actor."""
    res, workers = config.resources, config.parallel.worker_range[0]
    need = {"CPU": workers * res.cpus_per_worker + res.planner_cpus + res.data_cpus}
    if res.gpus_per_worker:
        need["GPU"] = workers * res.gpus_per_worker
    need |= {name: workers * amount for name, amount in res.worker_resources.items()}
    return need


def check_cluster_fits(config: SkrullConfig, cluster: dict[str, Any], *, embedded: bool) -> str | None:
    """ConfigError when an embedded Ray cannot hold the run; on an external cluster, a warning to print.

    An embedded Ray never grows, so a request beyond it would wait forever (Ray Train retries the worker
    group's start every minute); a cluster at RAY_ADDRESS may have an autoscaler that adds nodes, so there
    the same finding is only a warning.
    """
    need = required_resources(config)
    short = {k: (v, float(cluster.get(k, 0.0))) for k, v in need.items() if v > float(cluster.get(k, 0.0))}
    if not short:
        return None
    what = ", ".join(f"{v:g} {k} needed, {have:g} available" for k, (v, have) in short.items())
    knobs = ("parallel.num_workers, resources.cpus_per_worker, resources.gpus_per_worker, "
             "resources.data_cpus, resources.planner_cpus")
    if embedded:
        hint = " or resources.num_cpus (logical CPUs of the embedded Ray)" if "CPU" in short else ""
        raise ConfigError(f"the run does not fit this machine's Ray ({what}): lower {knobs}{hint}")
    return f"warning: the cluster has too few resources right now ({what}); waiting for the autoscaler. " \
           f"If none comes, lower {knobs}"


def check_embedded_cpus(config: SkrullConfig, num_cpus: float) -> None:
    """check_cluster_fits for an embedded Ray of `num_cpus` logical CPUs, before it starts (~10 s saved on
    a run that cannot fit). Only CPUs are known then: GPUs and custom resources are checked once Ray is up."""
    cluster = required_resources(config) | {"CPU": num_cpus}
    check_cluster_fits(config, cluster, embedded=True)


def check_epoch_fits(config: SkrullConfig, usable_rows: int) -> None:
    """One global batch must not repeat samples: it may hold at most one epoch's usable rows."""
    size = config.scheduling.global_batch_size
    if size > usable_rows:
        raise ConfigError(
            f"scheduling.global_batch_size={size} is larger than the {usable_rows} usable rows of one epoch, "
            "so a step would train samples twice; lower scheduling.global_batch_size or add data"
        )
