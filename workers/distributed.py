"""DP x CP process groups of one worker, created explicitly, handed to whatever communicates.

World ranks are laid out CP-contiguous (dp_size = 2, cp_size = 3), the row-major order of a
("dp", "cp") grid:

    world rank   0 1 2 | 3 4 5 | 6
    dp_rank      0 0 0 | 1 1 1 | -        CP groups: {0,1,2} {3,4,5}
    cp_rank      0 1 2 | 0 1 2 | -        rank 6: a spare (7 workers, cp_size 3)

Spare ranks. An elastic run (parallel.num_workers: [min, max]) trains on whatever worker count Ray Train
offers, which need not be a multiple of cp_size. The largest multiple trains; the remaining `spares`
ranks (fewer than cp_size, always the highest world ranks) hold no data: they stay in the world group as
ZeRO-2 data-parallel replicas that contribute exactly zero gradient each micro-batch (docs/design.md §10),
so the model's math is the same as on the trained ranks alone and every collective still has all ranks.

The groups are made with `dist.new_group` rather than a DeviceMesh because a mesh must span the whole world
(spares have no place in it) and because the CP groups must carry the run's collective timeout
(`train.collective_timeout_s`) explicitly: a sub-group created without one gets torch's default. The CP
group carries the ring of the DACP attention, so its communicator (inside `attention`) lives here.

CP subgroups (per-sequence CP degrees, docs/design.md §13). A plan may shard a sequence over an aligned
subgroup of d CP ranks, [g*d, (g+1)*d) inside the CP group, for any 1 < d < cp_size dividing cp_size. Every
such subgroup of every CP group gets its own process group, made here once per worker with the same
timeout, in one fixed order on every rank (new_group is collective: every rank calls it for every group,
members or not); a rank keeps the one subgroup of each degree it belongs to, and its attention runtime one
ring communicator per degree. With cp_size 4 (dp 2): CP groups {0,1,2,3} {4,5,6,7}, degree-2 subgroups
{0,1} {2,3} {4,5} {6,7}; rank 6 keeps {6,7}. Spare ranks keep none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.attention.runtime import AttentionRuntime


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroups:
    dp_rank: int
    """This rank's DP index; -1 on a spare rank."""
    cp_rank: int
    dp_size: int
    cp_size: int
    spares: int
    """Ranks beyond dp_size * cp_size: in the world group, without data (see the module docstring)."""
    cp_group: dist.ProcessGroup | None
    """This rank's CP group; None on a spare rank."""
    world_group: dist.ProcessGroup
    attention: AttentionRuntime
    """The DACP attention's kernel and the ring communicators of the CP group and of its subgroups."""
    subgroups: Mapping[int, dist.ProcessGroup] = field(default_factory=dict)
    """degree d -> this rank's aligned subgroup of d CP ranks (1 < d < cp_size); empty on a spare rank."""

    @property
    def is_spare(self) -> bool:
        return self.dp_rank < 0

    @property
    def trained_ranks(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def world_size(self) -> int:
        """Every rank, spares included: the ranks DeepSpeed averages gradients over."""
        return self.trained_ranks + self.spares

    @property
    def shape(self) -> str:
        """"DP 2 x CP 3 (+1 spare)": for logs."""
        extra = f" (+{self.spares} spare)" if self.spares else ""
        return f"DP {self.dp_size} x CP {self.cp_size}{extra}"

    @classmethod
    def create(cls, cp_size: int, *, device: torch.device | None = None, attention_backend: str = "auto",
               timeout: timedelta | None = None, degrees: Iterable[int] | None = None) -> ParallelGroups:
        """Split the world into CP groups of `cp_size` (+ spares), and each CP group into its aligned
        subgroups of every degree in `degrees` (None: every 1 < d < cp_size dividing it); collective: every
        rank calls it alike."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before ParallelGroups.create")
        world, rank = dist.get_world_size(), dist.get_rank()
        if cp_size < 1 or world < cp_size:
            raise ValueError(f"{world} workers cannot hold one CP group of parallel.cp_size={cp_size}: "
                             "set parallel.num_workers to a multiple of parallel.cp_size")
        dp_size, spares = divmod(world, cp_size)
        cp_groups = [dist.new_group(list(range(d * cp_size, (d + 1) * cp_size)), timeout=timeout)
                     for d in range(dp_size)]  # every rank creates every group (new_group is collective)
        device = device or torch.device("cpu")
        dp_rank = rank // cp_size if rank < dp_size * cp_size else -1
        cp_group = cp_groups[dp_rank] if dp_rank >= 0 else None
        subgroups: dict[int, dist.ProcessGroup] = {}
        for degree in subgroup_degrees(cp_size, degrees):
            for d in range(dp_size):  # the same order on every rank: new_group is collective
                for g in range(cp_size // degree):
                    first = d * cp_size + g * degree
                    group = dist.new_group(list(range(first, first + degree)), timeout=timeout)
                    if first <= rank < first + degree:
                        subgroups[degree] = group
        return cls(dp_rank=dp_rank, cp_rank=rank % cp_size if dp_rank >= 0 else 0, dp_size=dp_size,
                   cp_size=cp_size, spares=spares, cp_group=cp_group,
                   # Named explicitly rather than reached through a collective's default argument.
                   world_group=dist.group.WORLD,
                   attention=AttentionRuntime.create(cp_group, device, attention_backend, subgroups),
                   subgroups=subgroups)


def subgroup_degrees(cp_size: int, degrees: Iterable[int] | None = None) -> tuple[int, ...]:
    """The subgroup degrees to build, ascending: `degrees` (or every integer) restricted to 1 < d < cp_size
    dividing cp_size; degree 1 (local) and cp_size (the CP group itself) need no group of their own."""
    wanted = range(2, cp_size) if degrees is None else sorted({int(d) for d in degrees})
    return tuple(d for d in wanted if 1 < d < cp_size and cp_size % d == 0)
