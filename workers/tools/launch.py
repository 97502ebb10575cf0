"""Run a function on N local processes joined in one torch.distributed group (verify, bench, tests).

    results = run_workers(fn, world_size=3, args=(cases,))   # fn(rank, world_size, *args) -> picklable

Each process initializes gloo (CPU: the host's GPUs hidden from it) or NCCL (CUDA, one device per rank:
refused when there are fewer GPUs than ranks) over a free localhost port, calls `fn`, and writes its return
value to a temp file that the parent reads back in rank order. A failure in any rank raises in the parent
with that rank's traceback (torch.multiprocessing). `fn` must be importable by name (a module-level
function) because processes are spawned.

gloo ranks on a host without CUDA are forked from one fork server per calling process, which imported
what a rank needs once (workers/tools/rank_preload.py); each rank then starts in milliseconds instead of
~6-9 s of imports on 2 cores. Each rank gets the caller's environment and working directory as they are
at the call, as a spawned one would. CUDA ranks, and gloo ranks on a GPU host, are spawned: those must
hide or pick their device before anything initializes CUDA.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def check_gpus_for(backend: str, world_size: int) -> None:
    """NCCL needs a GPU of its own per rank (two ranks on one device fail in NCCL's init, "Duplicate
    GPU detected"); raises ValueError naming both counts before any process starts."""
    import torch

    if backend != "nccl":
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size > gpus:
        raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs (one each), this machine has "
                         f"{gpus}")


PRELOAD = ("workers.tools.rank_preload",)
"""What the fork server imports once (set before it starts; it lives as long as the calling process)."""


def start_method(backend: str) -> str:
    """forkserver for gloo ranks on a host without CUDA; spawn otherwise (see the module docstring)."""
    import torch

    return "forkserver" if backend == "gloo" and not torch.cuda.is_available() else "spawn"


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, out_dir: str,
           args: tuple, environ: dict[str, str], cwd: str) -> None:
    # A forked rank holds the fork server's environment and directory (as they were when the server
    # started): the caller's, now, are what a spawned rank would see.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    if backend == "gloo":
        # gloo ranks are CPU ranks on any host. Hidden before anything initializes CUDA, the GPUs of a GPU
        # host cannot draw in a default device, nor DeepSpeed, which picks its accelerator from
        # torch.cuda.is_available() and then moves the engine's model to it (gloo cannot reduce those).
        os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist

    # Several ranks share a few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any], world_size: int, args: tuple = (), backend: str | None = None
) -> list:
    """Spawn `world_size` processes running fn(rank, world_size, *args); their results in rank order."""
    import torch
    import torch.multiprocessing as mp

    backend = backend or default_backend()
    check_gpus_for(backend, world_size)
    method = start_method(backend)
    if method == "forkserver":
        mp.get_context(method).set_forkserver_preload(list(PRELOAD))
    with tempfile.TemporaryDirectory(prefix="skrull-workers-") as out_dir:
        entry_args = (fn, world_size, free_port(), backend, out_dir, args, dict(os.environ), os.getcwd())
        mp.start_processes(_entry, args=entry_args, nprocs=world_size, join=True, start_method=method)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
