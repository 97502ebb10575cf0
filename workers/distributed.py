"""DP x CP process groups of one worker, from a named device mesh, handed to whatever communicates.

World ranks are laid out CP-contiguous (dp_size = 2, cp_size = 3), the row-major order of a
("dp", "cp") mesh:

    world rank   0 1 2 | 3 4 5
    dp_rank      0 0 0 | 1 1 1        CP groups: {0,1,2} {3,4,5}
    cp_rank      0 1 2 | 0 1 2        (DP groups {0,3} {1,4} {2,5}: only DeepSpeed reduces over DP x CP)

The CP group carries the ring of the DACP attention, so its communicator (inside `attention`) lives here,
created once per worker with the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from workers.attention.runtime import AttentionRuntime


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroups:
    dp_rank: int
    cp_rank: int
    dp_size: int
    cp_size: int
    cp_group: dist.ProcessGroup
    world_group: dist.ProcessGroup
    attention: AttentionRuntime
    """The DACP attention's kernel and the CP group's ring communicator."""

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size

    @classmethod
    def create(cls, dp_size: int, cp_size: int, *, device: torch.device | None = None,
               attention_backend: str = "auto") -> ParallelGroups:
        """Build the ("dp", "cp") mesh (collective: every rank calls it with the same shape)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before ParallelGroups.create")
        world = dist.get_world_size()
        if dp_size < 1 or cp_size < 1 or dp_size * cp_size != world:
            raise ValueError(f"dp_size={dp_size} x parallel.cp_size={cp_size} must equal the world size "
                             f"{world}: set parallel.num_workers = dp_size * cp_size")
        device = device or torch.device("cpu")
        mesh = init_device_mesh(device.type, (dp_size, cp_size), mesh_dim_names=("dp", "cp"))
        cp_group = mesh.get_group("cp")
        return cls(dp_rank=mesh.get_local_rank("dp"), cp_rank=mesh.get_local_rank("cp"), dp_size=dp_size,
                   cp_size=cp_size, cp_group=cp_group,
                   # The mesh spans the whole default group (init_device_mesh requires it), so the world
                   # group is named explicitly here rather than reached by a collective's default.
                   world_group=dist.group.WORLD,
                   attention=AttentionRuntime.create(cp_group, device, attention_backend))
