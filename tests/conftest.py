"""Shared fixtures: an embedded local Ray per test module, and free loopback ports."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from workers.tools.launch import free_port as _free_port


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """An embedded Ray for one test module, never attached to another Ray running on the machine.

    4 logical CPUs on 2 cores: Ray Data's file-listing task needs a whole CPU beside the workers' fractions
    (docs/design.md §9). While it runs, RAY_ADDRESS names it, so Ray Train's helper processes find it.
    """
    import ray

    from app.driver import start_local_ray

    previous = os.environ.pop("RAY_ADDRESS", None)
    start_local_ray(4, log_to_driver=False)
    yield
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
    if previous is not None:
        os.environ["RAY_ADDRESS"] = previous


@pytest.fixture
def free_port() -> Callable[[], int]:
    """A function returning a free TCP port on 127.0.0.1 (each call a new one)."""
    return _free_port
