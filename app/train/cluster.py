"""The Ray a driver command runs on: the cluster at RAY_ADDRESS, or an embedded one on loopback.

Resources on a small machine: Ray Data's file-listing task needs one whole CPU even when every worker holds
a fraction, so an embedded Ray declares more logical CPUs than cores (cores + 2 by default; docs/design.md
§9). An embedded Ray that cannot hold the run is refused before it starts (app/train/preflight.py
check_embedded_cpus).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from app.config import SkrullConfig
from app.train.signals import raise_terminated


@contextlib.contextmanager
def ray_session(config: SkrullConfig, *, worker_logs: bool = True, training: bool = True) -> Iterator[bool]:
    """Join RAY_ADDRESS's cluster, or start an embedded one sized for Ray Data + planner + workers.

    training=False (`data prepare`, `bench data`): the embedded Ray need not hold the run's workers.
    A Ray that is already initialized in this process is used as it is (and left running). An embedded Ray
    never attaches to another Ray on the machine by accident (`address="local"`), and while it runs
    RAY_ADDRESS names it, so that Ray Train's helper processes find this instance and not another one.
    Yields whether the Ray is an embedded one (it cannot grow: resources beyond it are an error).
    """
    import ray

    if ray.is_initialized():
        yield not os.environ.get("RAY_ADDRESS")
        return
    previous = os.environ.get("RAY_ADDRESS")
    sigterm = signal.getsignal(signal.SIGTERM)
    if previous:
        ray.init(address=previous, log_to_driver=worker_logs)
    else:
        from app.train.preflight import check_embedded_cpus

        num_cpus = embedded_num_cpus(config)
        if training:
            check_embedded_cpus(config, num_cpus)
        start_local_ray(num_cpus, log_to_driver=worker_logs)
    if sigterm is raise_terminated and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, sigterm)  # ray.init replaced it (sigterm_stops_like_ctrl_c)
    try:
        yield not previous
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)


def embedded_num_cpus(config: SkrullConfig) -> float:
    """The logical CPUs of an embedded Ray: resources.num_cpus, or 0 = this machine's cores + 2."""
    return config.resources.num_cpus or (os.cpu_count() or 1) + 2


def start_local_ray(num_cpus: float, *, log_to_driver: bool) -> str:
    """Start an embedded Ray on loopback whose address every process of it knows; returns the address.

    The GCS port is chosen up front so that the address can go into its processes' environment: Ray Train's
    detached placement-group cleaner (and anything else calling Ray's state API from inside the cluster)
    resolves "the" cluster from RAY_ADDRESS, and without it picks the newest Ray on the machine, which may
    be someone's `ray start` cluster. The caller owns os.environ["RAY_ADDRESS"], set here for the driver.

    Loopback only (docs/gpu-cluster.md, "Where Ray comes from"): Ray 2.60's servers (the GCS, raylet,
    object manager and core worker gRPC servers, the dashboard and its agent, the runtime-env agent, the
    metrics exporters) bind loopback when the node IP is a loopback address, and otherwise the node IP or the
    wildcard (measured: "::" for the gRPC servers), so the node IP must really be 127.0.0.1. ray.init
    turns `_node_ip_address="127.0.0.1"` into the machine's reachable address (ray/_private/services.py
    `resolve_ip_for_localhost`) unless Ray's ENABLE_RAY_CLUSTER is off, which Ray reads once, at import,
    from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: both are switched off while ray.init starts the node (the
    processes it starts inherit the variable), then put back. The workers' torch.distributed store and
    gloo sockets: workers/loopback.py, and GLOO_SOCKET_IFNAME (the loopback interface) in its processes'
    environment.
    """
    import ray
    from ray._private import ray_constants

    from workers.tools.launch import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    # The environment of every process of this Ray: the raylet inherits it from here and hands it to each
    # worker it starts. Not a job runtime_env: with one, the raylet starts every worker process of the
    # job through Ray's setup_worker.py, one more interpreter start each (~0.5 CPU-s).
    job_env = {"RAY_ADDRESS": address, "GLOO_SOCKET_IFNAME": loopback_interface(),
               # Ray Train's preemption watcher (an actor per worker group) waits for a node to be drained:
               # one machine has no other node to move to, and the actor costs ~3 CPU-s per group start.
               "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    # RAY_GCS_SERVER_PORT: read by ray.init when it starts the head node.
    startup_env = {"RAY_GCS_SERVER_PORT": str(port), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} | job_env
    saved = {key: os.environ.get(key) for key in startup_env}
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(startup_env)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=num_cpus, log_to_driver=log_to_driver,
                 _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1")
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    os.environ["RAY_ADDRESS"] = address
    return address


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 ("lo" on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def on_this_node() -> Any:
    """Pin a driver-side actor (planner, progress monitor) to the driver's node: losing a worker node
    must not take them along (their state is the run's, not a worker's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
