"""torch.distributed on loopback only, for a run on an embedded (single-machine) Ray.

Ray Train's own torch backend (ray/train/torch/config.py, `_TorchBackend.on_start`) lets rank 0's
`init_process_group("env://")` create the rendezvous TCPStore, and torch's TCPStore server binds the
wildcard address whatever MASTER_ADDR says (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp,
`UvTcpServer::makeWithPort`: "::" or "0.0.0.0"; torch 2.13): reachable from the network for the run's
whole life. Its one way to choose the interface is `master_listen_fd`, a socket the caller bound. So on an
embedded Ray the process group is made here instead:

    world rank 0: bind a socket to 127.0.0.1:0 and keep it (its port goes to every rank)
    every rank:   TCPStore(127.0.0.1, port; rank 0 serving on that socket), then
                  init_process_group(backend, store=..., rank, world_size, timeout)

gloo's own listening sockets follow GLOO_SOCKET_IFNAME, which the embedded Ray's job environment sets to
the loopback interface (app/train/cluster.py start_local_ray). A run on a RAY_ADDRESS cluster keeps Ray
Train's backend: its workers are on several machines and must reach each other.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

LOOPBACK = "127.0.0.1"
_LISTENING: dict[str, socket.socket] = {}
"""World rank 0's bound store socket, kept in its worker process from `_bind_store_socket` to the
process group's creation."""


def _bind_store_socket() -> int:
    """On world rank 0: bind the store's socket to loopback (any free port), keep it; return the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    _LISTENING["store"] = sock
    return sock.getsockname()[1]


def _join_process_group(backend: str, world_rank: int, world_size: int, port: int, timeout_s: int) -> None:
    """Create this rank's store (rank 0 serves it on the bound socket) and the default process group."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)  # what other code reads
    timeout = timedelta(seconds=timeout_s)
    if world_rank == 0:
        listen_fd = _LISTENING.pop("store").detach()  # the store's server owns the descriptor from here
        store = dist.TCPStore(LOOPBACK, port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=listen_fd)
    else:
        store = dist.TCPStore(LOOPBACK, port, world_size, False, timeout)
    dist.init_process_group(backend=backend, store=store, rank=world_rank, world_size=world_size,
                            timeout=timeout)


class _LoopbackTorchBackend(_TorchBackend):
    """Ray Train's torch backend with the process group made by `_join_process_group` (start-up only;
    shutdown and the rest are Ray Train's)."""

    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        import ray
        from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup

        backend = backend_config.backend or "gloo"
        port = worker_group.execute_single(0, _bind_store_socket)
        if not isinstance(worker_group, V1WorkerGroup):  # as Ray Train's own on_start does
            worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(rank, _join_process_group, backend=backend,
                                                   world_rank=rank, world_size=len(worker_group), port=port,
                                                   timeout_s=backend_config.timeout_s)
                 for rank in range(len(worker_group))])


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """TorchConfig whose process group listens on 127.0.0.1 only (every worker on this machine)."""

    @property
    def backend_cls(self) -> type:
        return _LoopbackTorchBackend
