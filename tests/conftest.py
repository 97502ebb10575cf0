"""Shared fixtures: an embedded local Ray per test module, one tiny training run shared by several modules,
and free loopback ports."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import pytest

from workers.engine import use_extensions_cache_per_environment
from workers.tools.launch import free_port as _free_port

# One DeepSpeed op cache per venv (workers/engine.py use_extensions_cache_per_environment), set here too so
# that it reaches every process a test starts, including those that build ops before any engine.
use_extensions_cache_per_environment()

# When Ray Train tears down a failed worker group, its torch backend first waits for every worker to
# destroy its process group, up to TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S (30 s by default), before it
# kills them. A SIGSTOPped worker (test_resilience's hung peer) never answers, so every hang cost those
# 30 s on top of the collective timeout. gloo's teardown of a live group takes milliseconds; 5 s is ample.
# Ray Train reads it in its controller, which inherits it from the environment of the embedded Ray's
# processes (started from this one).
os.environ.setdefault("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "5")


@contextmanager
def embedded_ray() -> Iterator[None]:
    """An embedded Ray, never attached to another Ray running on the machine.

    4 logical CPUs on 2 cores: Ray Data's file-listing task needs a whole CPU beside the workers' fractions
    (docs/design.md §9). While it runs, RAY_ADDRESS names it, so Ray Train's helper processes find it.
    """
    import ray

    from app.driver import start_local_ray

    previous = os.environ.pop("RAY_ADDRESS", None)
    start_local_ray(4, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
        if previous is not None:
            os.environ["RAY_ADDRESS"] = previous


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """An embedded Ray for one test module (see embedded_ray)."""
    with embedded_ray():
        yield


TINY_RUN_STEPS = 6


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """One tiny run shared by test_train_e2e, test_export and test_report: (its TrainSummary, MLflow URI).

    tests/test_train_e2e.py's config (24 samples of ~30 tokens, batches of 8, DP 1 x CP 2, skrull) for
    TINY_RUN_STEPS = 6 steps (two epochs), logged to a file MLflow store. Each of those modules used to
    train its own run of this config (2, 4 and 6 steps, ~60 s each on 2 cores); their assertions hold for
    this one: the three modules took 312 s before, 198 s after (2026-11-25). Trained on the module's Ray
    when one is up, else on an embedded Ray of its own (same size as local_ray's), shut down afterwards.
    """
    import ray

    from app.driver import train
    from tests.test_train_e2e import _config

    root = tmp_path_factory.mktemp("tiny_run")
    uri = f"file:{root / 'mlruns'}"
    config = _config(root, "skrull", "scheduling.policy=skrull", f"train.steps={TINY_RUN_STEPS}",
                     f"train.mlflow_uri={uri}")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 refuses the file store unless asked
        with nullcontext() if ray.is_initialized() else embedded_ray():
            summary = train(config, progress=False)
    return summary, uri


@pytest.fixture
def free_port() -> Callable[[], int]:
    """A function returning a free TCP port on 127.0.0.1 (each call a new one)."""
    return _free_port
