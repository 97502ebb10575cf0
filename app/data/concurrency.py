"""How many Ray Data tokenize tasks run at once (data.tokenize_concurrency).

    N                  N tasks
    auto, `train`      (cluster CPUs - workers x resources.cpus_per_worker - resources.planner_cpus)
                       / resources.data_cpus, at least 1
    auto, `data prepare` / `bench data`: every CPU of the cluster / resources.data_cpus (nothing trains)
    one-machine Ray    auto is also capped at the machine's cores: an embedded Ray declares more logical
                       CPUs than cores (app/train/cluster.py), and a tokenize task is one busy Python
                       process, so more tasks than cores only add processes (and tokenizer loads)

The cluster CPUs are `ray.cluster_resources()["CPU"]` (on an embedded Ray: resources.num_cpus, by default
cores + 2). Ray Data runs the tasks side by side and hands their output on in stream order
(`preserve_order`, app/data/pipeline.py), so the rows, and the planner's sample ids, never depend on N.
"""

from __future__ import annotations

import math
import os

from app.config import SkrullConfig


def training_cpus(config: SkrullConfig) -> float:
    """The CPUs a run reserves for training: its largest worker group and its planner."""
    res = config.resources
    return config.parallel.worker_range[1] * res.cpus_per_worker + res.planner_cpus


def tokenize_tasks(config: SkrullConfig, cluster_cpus: float, *, training: bool = True,
                   cores: int | None = None) -> int:
    """Tokenize tasks at once for data.tokenize_concurrency (see the module docstring).

    training: subtract the run's training reservation (False for `data prepare` and `bench data`).
    cores: the cap when Ray runs on this machine only (local_cores()); None: no cap.
    """
    setting = config.data.tokenize_concurrency
    if setting != "auto":
        return int(setting)
    free = cluster_cpus - (training_cpus(config) if training else 0.0)
    per_task = config.resources.data_cpus
    tasks = math.floor(free / per_task + 1e-9) if per_task > 0 else math.floor(free)
    if cores is not None:
        tasks = min(tasks, cores)
    return max(1, tasks)


def cluster_tokenize_tasks(config: SkrullConfig, *, training: bool = True) -> int:
    """tokenize_tasks for the Ray this process is connected to."""
    import ray

    return tokenize_tasks(config, float(ray.cluster_resources().get("CPU", 0.0)), training=training,
                          cores=local_cores())


def local_cores() -> int | None:
    """This machine's cores when every alive Ray node is this process's own node, else None."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    alive = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    return (os.cpu_count() or 1) if alive == [here] else None
