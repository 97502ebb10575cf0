"""What one worker's DACP attention runs with: its varlen kernel and its rings' communicators.

    worker start:  groups = ... cp_group, subgroups ...           (workers/distributed.py)
                   runtime = AttentionRuntime.create(cp_group, device, model.attention_backend, subgroups)
                                 |-- kernel: make_kernel(backend, device)   "auto" resolved here, once
                                 |-- comm:   RingComm(cp_group)             None without CP (1 rank)
                                 '-- subgroup_comms: {d: RingComm(this rank's aligned subgroup of d ranks)}
    every micro-batch: index = DacpIndex.build(layout, device)      (RankBatch.to, workers/attention/index.py)
    every call:        dacp_attention(q, k, v, index, runtime)

Everything is built once, with the process groups, and travels with them (the model call passes the runtime
as the `dacp_runtime` keyword to the attention function, docs/design.md section 7); nothing is looked up
per call except a ring part's communicator by its degree (`comm_for`). `default_runtime(device)` is the
single-rank runtime of the "auto" backend, built once per device, for calls that pass none (a plain
`model(input_ids)`, single-process tools and tests).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

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
    subgroup_comms: Mapping[int, RingComm] = field(default_factory=dict)
    """degree d -> the ring communicator of this rank's aligned subgroup of d CP ranks (1 < d < cp_size):
    what the partial parts of a micro-batch (per-sequence CP degrees) ring over."""

    @property
    def cp_size(self) -> int:
        return self.comm.size if self.comm is not None else 1

    def comm_for(self, degree: int) -> RingComm | None:
        """The communicator of a degree-`degree` ring part: the CP group's for cp_size (None on one rank),
        this rank's subgroup's otherwise; ValueError when this worker has no such subgroup."""
        if degree == self.cp_size:
            return self.comm
        comm = self.subgroup_comms.get(degree)
        if comm is None:
            raise ValueError(f"the micro-batch shards sequences over {degree} of {self.cp_size} CP ranks, "
                             f"but this worker has no CP subgroup of {degree} ranks (it has degrees "
                             f"{sorted(self.subgroup_comms)}): ParallelGroups.create makes them")
        return comm

    @classmethod
    def create(cls, cp_group: dist.ProcessGroup | None, device: torch.device, backend: str = "auto",
               subgroups: Mapping[int, dist.ProcessGroup] | None = None) -> AttentionRuntime:
        """Build the kernel for `device` (`backend`: a `model.attention_backend` value), the ring
        communicator of `cp_group` and one of each of this rank's CP subgroups (`subgroups`: degree ->
        process group). Not collective: each rank builds its own, from the same arguments."""
        kernel = make_kernel(backend, torch.device(device))
        comm = RingComm(cp_group) if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        sub = {int(d): RingComm(group) for d, group in (subgroups or {}).items()}
        return cls(kernel=kernel, comm=comm, subgroup_comms=sub)

    def single_rank(self) -> AttentionRuntime:
        """The same kernel without any ring: for calls whose stream is not sharded over the CP group."""
        if self.comm is None and not self.subgroup_comms:
            return self
        return dataclasses.replace(self, comm=None, subgroup_comms={})


@functools.cache
def default_runtime(device: torch.device) -> AttentionRuntime:
    """The single-rank "auto" runtime of `device`, built on first use and then reused."""
    return AttentionRuntime.create(None, device)
