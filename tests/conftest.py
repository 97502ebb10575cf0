"""Shared fixtures and the suite's two tiers.

- One embedded local Ray for the whole session (`suite_ray`, used through `local_ray`), started on first use;
  a module that needs another Ray (its own environment, a multi-node cluster) stops it, and the next user
  starts it again. The tests are ordered so that this happens at most once or twice per session.
- One tiny training run (`tiny_run`) shared by every test that only reads a run directory.
- Tiers (scripts/test.sh): every test that starts Ray, a server or a training run in other processes is
  marked `slow` (by its fixtures here, or by its module); `scripts/test.sh --quick` runs the rest. A test
  left unmarked that initializes Ray fails, so the quick tier stays quick.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from app.data.ray_env import apply_ray_data_defaults
from workers.engine import use_extensions_cache_per_environment
from workers.tools.launch import free_port as _free_port

# The venv's bin first on PATH, as an activated venv has it (CI runs .venv/bin/python without activating):
# torch JIT-builds DeepSpeed's shm op with the first `ninja` on PATH, and the pip one in the venv (1.13)
# and a system one (1.11) hash the same build.ninja differently, so processes started with the two PATHs
# (an embedded run, test_ray_job's `ray start` head) rebuilt the op in turn: ~36 s of g++ each time.
_VENV_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = os.pathsep.join([_VENV_BIN, os.environ.get("PATH", "")])
# One DeepSpeed op cache per venv (workers/engine.py use_extensions_cache_per_environment), set here too so
# that it reaches every process a test starts, including those that build ops before any engine.
use_extensions_cache_per_environment()

# The product's Ray Data settings (app/data/ray_env.py, which `python -m app` applies at its start), so
# that tests that build pipelines in this process run the executor mode users get.
apply_ray_data_defaults()

# When Ray Train tears down a failed worker group, its torch backend first waits for every worker to
# destroy its process group, up to TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S (30 s by default), before it
# kills them. A SIGSTOPped worker (test_resilience's hung peer) never answers, so every hang cost those
# 30 s on top of the collective timeout. gloo's teardown of a live group takes milliseconds; 2 s is ample.
# Ray Train reads it in its controller, which inherits it from the environment of the embedded Ray's
# processes (started from this one).
os.environ.setdefault("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "2")
# Ray Train's controller polls its workers this often (2 s by default) to notice that training ended or a
# worker died, and to take each worker's report: Ray Train's result queue holds one report, so a worker
# reporting a step before the last one was polled waits for the next poll (train.log_every=1 reports every
# step of milliseconds here). Measured on a 6-step DP 2 tiny run, first step to the end of fit (the rest
# of the run is CPU-bound start-up): 2.6 s at 0.25 s (steps 0.25 s apart), 0.5 s at 0.05 s (2026-11-26);
# 3-step run: 33.7 s -> 27.6 s from 2 s to 0.25 s (2026-11-25). A poll is one cheap actor call per worker.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.05")
# DeepSpeed's ZeRO optimizer imports its Muon module on every engine build (even for AdamW), whose
# `@torch.compile` decorators import TorchInductor's compiler config: ~1.5 s of CPU per train worker
# process (measured in isolation, 2026-11-26). Only train.compile compiles (workers/compile.py), and the
# tests of it turn dynamo back on for themselves (tests/test_fast_step.py); DeepSpeed's decorated Muon
# functions are never called, so dynamo off changes no other computation.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# A `train` driver a test starts (tests/driver_process.py) must take Ctrl-C as from a user's shell. A process
# started in the background by a non-interactive shell (`cmd &`, as CI runners and nohup'd jobs do) inherits
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the Ctrl-C driver ignored the
# test's SIGINT and trained to its end (clean-clone runs started with `&`, 2026-11-26). A handler set here is
# reset to the default in every child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

RAY_FIXTURES = frozenset({"local_ray", "suite_ray", "tiny_run", "signaled_drivers"})
"""Fixtures that start Ray: a test using one (directly or through another fixture) is `slow`."""

# Module order: the quick tier first (a failure there answers in minutes), then the tests on the suite's
# embedded Ray, then those that start a Ray of their own (each stops the suite's: listed last, so that it
# is not started again).
LAST_MODULES = ("test_s3_storage.py", "test_ray_job.py", "test_elastic_cluster.py")


@contextmanager
def embedded_ray() -> Iterator[None]:
    """An embedded Ray, never attached to another Ray running on the machine.

    4 logical CPUs on 2 cores: Ray Data's file-listing task needs a whole CPU beside the workers' fractions
    (docs/design.md §9). While it runs, RAY_ADDRESS names it, so Ray Train's helper processes find it.
    """
    import ray

    from app.train.cluster import start_local_ray

    previous = os.environ.pop("RAY_ADDRESS", None)
    start_local_ray(4, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
        if previous is not None:
            os.environ["RAY_ADDRESS"] = previous


class SuiteRay:
    """The session's embedded Ray (see embedded_ray): started by `ensure`, kept until `stop` or the end.

    Starting one costs ~7 s and stopping it ~3 s on 2 cores; nine modules used to start their own.
    """

    def __init__(self) -> None:
        self._running: Any = None

    def ensure(self) -> None:
        if self._running is None:
            running = embedded_ray()
            running.__enter__()
            self._running = running

    def stop(self) -> None:
        """Shut the suite's Ray down (a module about to start a Ray of its own calls this)."""
        if self._running is not None:
            running, self._running = self._running, None
            running.__exit__(None, None, None)


@pytest.fixture(scope="session")
def suite_ray() -> Iterator[SuiteRay]:
    suite = SuiteRay()
    yield suite
    suite.stop()


@pytest.fixture(scope="module")
def local_ray(suite_ray: SuiteRay) -> Iterator[None]:
    """The suite's embedded Ray, up for the module (started if a module before stopped it)."""
    suite_ray.ensure()
    yield


TINY_RUN_STEPS = 6
TINY_RUN_SCHEDULE = ("train.lr_scheduler=cosine", "train.warmup_steps=2", "train.min_lr_ratio=0.1")
"""The shared run's learning rate: 2 warmup steps, then a half cosine to 10% of train.lr on step 6."""


@pytest.fixture(scope="session")
def tiny_run(suite_ray: SuiteRay, tmp_path_factory: pytest.TempPathFactory):
    """One tiny run shared by test_train_e2e, test_eval_loss, test_export and test_report: (its
    TrainSummary, MLflow URI).

    Its learning rate follows TINY_RUN_SCHEDULE (tests/test_train_e2e.py checks every step's).

    tests/test_train_e2e.py's config (24 samples of ~30 tokens, batches of 8, DP 1 x CP 2, skrull, 40% of the
    rows held out and evaluated every 2 steps) for TINY_RUN_STEPS = 6 steps, logged to a file MLflow store
    and, with wandb installed, to an offline W&B run in the run directory (tests/test_wandb_log.py), on the
    suite's Ray. Each of those modules used to train its own run (~40-60 s each on 2 cores).
    """
    from app.train.driver import train
    from tests.test_train_e2e import EVAL, _config

    suite_ray.ensure()
    root = tmp_path_factory.mktemp("tiny_run")
    uri = f"file:{root / 'mlruns'}"
    with_wandb = importlib.util.find_spec("wandb") is not None
    config = _config(root, "skrull", "scheduling.policy=skrull", f"train.steps={TINY_RUN_STEPS}",
                     f"train.mlflow_uri={uri}", *EVAL, *TINY_RUN_SCHEDULE,
                     *(["train.wandb_project=skrull-tests"] if with_wandb else []))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 refuses the file store unless asked
        env.setenv("WANDB_MODE", "offline")  # W&B writes <run_dir>/wandb/ only
        env.setenv("WANDB_SILENT", "true")
        summary = train(config, progress=False)
        if with_wandb:
            import wandb

            wandb.teardown()  # W&B's process (it read the environment above) ends, its files complete
    return summary, uri


@pytest.fixture(scope="session")
def signaled_drivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """tests/test_resilience.py's Ctrl-C driver and tests/test_embedded_run.py's SIGTERM driver, started at
    once by the first test that needs either: {"ctrl_c": SignaledDriver, "sigterm": SignaledDriver}.

    Each is a `train` process with its own embedded Ray, stopped by its signal from a thread of this
    process (tests/driver_process.py); one alone leaves about a third of 2 cores idle, and each took ~32 s
    of its module's time run alone. A driver still running when its test asks waits for it there.
    """
    from tests.test_embedded_run import sigterm_driver
    from tests.test_resilience import ctrl_c_driver

    drivers = {"ctrl_c": ctrl_c_driver(tmp_path_factory),
               "sigterm": sigterm_driver(tmp_path_factory.mktemp("embedded"))}
    for driver in drivers.values():
        driver.start()
    yield drivers
    for driver in drivers.values():  # a driver whose test was not selected still ends before the session
        driver.join()


@pytest.fixture
def free_port() -> Callable[[], int]:
    """A function returning a free TCP port on 127.0.0.1 (each call a new one)."""
    return _free_port


def _module_rank(item: pytest.Item) -> int:
    name = item.path.name
    if name in LAST_MODULES:
        return 2 + LAST_MODULES.index(name)
    return 1 if item.get_closest_marker("slow") else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a Ray fixture `slow`, then order: quick, suite Ray, own Ray (stable)."""
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_module_rank)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test outside the slow tier must not start Ray: its ray.init fails, naming the mark to add (a Ray
    started there would make `--quick` slow unnoticed)."""
    if item.get_closest_marker("slow"):
        return (yield)
    try:
        import ray
    except ImportError:  # a GPU image with torch alone (scripts/gpu_check.sh kernels): nothing can start Ray
        return (yield)

    def refuse(*args: Any, **kwargs: Any) -> None:
        pytest.fail(f"{item.nodeid} starts Ray: mark it slow (tests/conftest.py)", pytrace=False)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray, "init", refuse)
        return (yield)
