"""DP x CP process groups of one worker, created explicitly and handed to whatever communicates.

World ranks are laid out CP-contiguous (dp_size = 2, cp_size = 3):

    world rank   0 1 2 | 3 4 5
    dp_rank      0 0 0 | 1 1 1        CP groups: {0,1,2} {3,4,5}
    cp_rank      0 1 2 | 0 1 2        DP groups: {0,3} {1,4} {2,5}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroups:
    dp_rank: int
    cp_rank: int
    dp_size: int
    cp_size: int
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    world_group: dist.ProcessGroup

    @classmethod
    def create(cls, dp_size: int, cp_size: int) -> ParallelGroups:
        """Create every CP and DP group (new_group is collective: all ranks create all groups in order)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before ParallelGroups.create")
        world = dist.get_world_size()
        if dp_size < 1 or cp_size < 1 or dp_size * cp_size != world:
            raise ValueError(f"dp_size={dp_size} x parallel.cp_size={cp_size} must equal the world size "
                             f"{world}: set parallel.num_workers = dp_size * cp_size")
        rank = dist.get_rank()
        dp_rank, cp_rank = divmod(rank, cp_size)
        world_group = dist.new_group(list(range(world)))
        cp_group = dp_group = None
        for d in range(dp_size):
            group = dist.new_group([d * cp_size + c for c in range(cp_size)])
            if d == dp_rank:
                cp_group = group
        for c in range(cp_size):
            group = dist.new_group([d * cp_size + c for d in range(dp_size)])
            if c == cp_rank:
                dp_group = group
        return cls(dp_rank=dp_rank, cp_rank=cp_rank, dp_size=dp_size, cp_size=cp_size,
                   dp_group=dp_group, cp_group=cp_group, world_group=world_group)
