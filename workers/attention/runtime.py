"""What one worker's DACP attention runs with: its varlen kernel and its CP group's ring communicator.

    worker start:  groups = ... cp_group ...
                   runtime = AttentionRuntime.create(cp_group, device, model.attention_backend)
                                 |-- kernel: make_kernel(backend, device)   "auto" resolved here, once
                                 '-- comm:   RingComm(cp_group)             None without CP (1 rank)
    every micro-batch: index = DacpIndex.build(layout, device)      (RankBatch.to, workers/attention/index.py)
    every call:        dacp_attention(q, k, v, index, runtime)

Both are built once, with the process group, and travel with it (the model call passes the runtime as
the `dacp_runtime` keyword to the attention function, docs/design.md section 7); nothing is looked up
per call. `default_runtime(device)` is the single-rank runtime of the "auto" backend, built once per
device, for calls that pass none (a plain `model(input_ids)`, single-process tools and tests).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.attention.comm import RingComm
from workers.attention.kernels import VarlenKernel, make_kernel


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionRuntime:
    kernel: VarlenKernel
    """The varlen kernel every attention call of this worker uses (built once)."""
    comm: RingComm | None
    """The CP group's ring communicator; None when there is no CP group or it has one rank."""

    @property
    def cp_size(self) -> int:
        return self.comm.size if self.comm is not None else 1

    @classmethod
    def create(cls, cp_group: dist.ProcessGroup | None, device: torch.device,
               backend: str = "auto") -> AttentionRuntime:
        """Build the kernel for `device` (`backend`: a `model.attention_backend` value) and the ring
        communicator of `cp_group`. Not collective: each rank builds its own, from the same arguments."""
        kernel = make_kernel(backend, torch.device(device))
        comm = RingComm(cp_group) if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        return cls(kernel=kernel, comm=comm)

    def single_rank(self) -> AttentionRuntime:
        """The same kernel without the ring: for calls whose stream is not sharded over the CP group."""
        return self if self.comm is None else dataclasses.replace(self, comm=None)


@functools.cache
def default_runtime(device: torch.device) -> AttentionRuntime:
    """The single-rank "auto" runtime of `device`, built on first use and then reused."""
    return AttentionRuntime.create(None, device)
