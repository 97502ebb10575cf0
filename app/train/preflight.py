"""Checks that run on the driver before any worker starts, so bad input fails fast with one message.

Before Ray (`preflight`): the config tree already rejected unknown keys, bad choices and a world size not
divisible by CP (its sections validate themselves, app/config.py); here the model source is resolved (a
hub id through its config only, honoring HF_HUB_OFFLINE), the data is resolved once (app/data/resolved.py:
sources, tokenizer, chat template, fingerprints; the result is returned for the driver to hand on) and the
hardware profile is loaded strictly. The model must be one the training path computes exactly (no sliding
window shorter than the max sequence length, no logit soft-capping, ...) and the tokenizer's ids must fit
its vocabulary (app/model/support.py). The run directory is checked by app/rundir/location.py.

Secrets: a URI with credentials in it (user:password@, access_key / secret_key / session_token) is refused
(the environment holds them), and every message naming run.storage_path or data.path shows the URI with its
secrets redacted (workers/storage.py redact_uri / redact_text); the config snapshot holds redacted URIs.

With Ray up, before the trainer (`check_cluster_fits`, `check_epoch_fits`): the requested workers fit the
cluster's resources, and one global batch fits one epoch of usable rows. Every failure is a ConfigError,
which `python -m app` turns into exit code 2 and one line naming the knob.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.config import CREDENTIAL_HINT, ConfigError, ModelConfig, SkrullConfig
from workers.presets import TINY_PRESETS, is_tiny_preset
from workers.storage import carries_credentials, redact_uri

if TYPE_CHECKING:
    from app.data.resolved import ResolvedData

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


def preflight(config: SkrullConfig) -> ResolvedData:
    """Model, data source, tokenizer, hardware profile: everything that can be checked without Ray.

    Returns the run's data as resolved here (app/data/resolved.py: the sources, the tokenizer, the template
    settings and the data fingerprints), which the driver hands on, so none of it is resolved twice.
    """
    from app.data.resolved import resolve_data
    from app.model.dims import resolved_model
    from app.model.support import check_model_support
    from app.profiling.hardware import load_hardware_profile
    from app.sinks.mlflow import check_mlflow
    from app.sinks.wandb import check_wandb

    check_no_credentials_in_uris(config)
    check_mlflow(config.train.mlflow_uri)
    check_wandb(config.train.wandb_project)
    check_model_source(config.model)
    resolved_model(config.model)  # a model.* dimension its config.json contradicts (app/model/dims.py)
    check_eval_every(config)
    check_kernels(config)
    data = resolve_data(config.data, max_length=config.max_sequence_length)
    check_model_support(config, data.tokenizer)  # app/model/support.py
    load_hardware_profile(config.hardware.profile)
    return data


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_local_cpu_memory(config: SkrullConfig) -> None:
    """scheduling.bucket_size=auto on CPU workers sizes C from hardware.profile's device memory, which the
    workers of one node share (app/profiling/memory.py). In a local run (no RAY_ADDRESS: an embedded Ray,
    every worker on this host) a profile with more memory than this host has (a GPU's, such as h100's 80
    GB) would size micro-batches that cannot fit here, and the warm-up micro-batch of C tokens would be
    killed for memory: one error naming the knobs instead, before Ray starts. 5% of slack: a profile of
    this kind of machine states its memory in round numbers."""
    if config.scheduling.bucket_size != "auto" or config.resources.gpus_per_worker > 0 \
            or os.environ.get("RAY_ADDRESS"):
        return
    from app.profiling.hardware import load_hardware_profile

    device_memory_bytes = load_hardware_profile(config.hardware.profile).device_memory_bytes
    host = host_memory_bytes()
    if device_memory_bytes > 1.05 * host:
        raise ConfigError(
            f"scheduling.bucket_size=auto sizes C from hardware.profile={config.hardware.profile}'s "
            f"{device_memory_bytes / 1e9:.1f} GB of device memory, which this run's CPU workers share, but "
            f"this host has {host / 1e9:.1f} GB: use a profile of this machine (hardware.profile=cpu, or "
            "one `python -m app profile` measures here), or set scheduling.bucket_size")


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


def check_kernels(config: SkrullConfig) -> None:
    """model.kernels=liger needs liger-kernel where the workers run (found here: one image for driver and
    workers is the cluster recipe's, docs/gpu-cluster.md); a CPU run is refused by the config itself."""
    from workers.kernels import kernels_problem

    problem = kernels_problem(config.model.kernels, on_gpu=config.resources.gpus_per_worker > 0)
    if problem:
        raise ConfigError(problem)


def check_eval_every(config: SkrullConfig) -> None:
    """train.eval_every needs an eval set (data.eval_path itself is resolved with the data)."""
    data = config.data
    if config.train.eval_every and not (data.eval_fraction or data.eval_path):
        raise ConfigError(f"train.eval_every={config.train.eval_every} needs an eval set: set "
                          "data.eval_fraction (hold samples out) or data.eval_path, or train.eval_every=0")


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
