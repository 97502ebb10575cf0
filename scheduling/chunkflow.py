"""chunkflow: ChunkFlow (Yuan et al., "Efficient Long Context Fine-tuning with Chunk Flow", ICML 2025) as a
baseline beside Skrull: long sequences trained as dependent chunks on one rank instead of sharded over CP.

    1. chunks      ChunkSize C = scheduling.bucket_size (one chunk fills a rank's token budget). A sequence
                   longer than C becomes n = ceil(S / C) dependent chunks [0, C), [C, 2C), ..., the last
                   holding the rest; the other sequences are packed best-fit decreasing into standalone
                   chunks of at most C tokens (fewest bins). Each chunk is one micro-batch.
    2. ranks       every worker is a ChunkFlow data-parallel rank: with parallel.cp_size = N > 1 the N ranks
                   of a CP group train different chunks (ChunkFlow replaces context parallelism: nothing is
                   sharded, no ring runs), so D x N ranks share the batch.
    3. assignment  by token count, as the paper balances its uniform chunks: the items (a standalone chunk,
                   or a long sequence with all its chunks, which stay on one rank) largest first, each to
                   the rank with the fewest tokens so far (LPT, balanced_packed.lpt_partition). It ignores
                   that a later chunk attends to more keys: that is ChunkFlow's own cost model, and what
                   the cost model here charges for it (CostModel.chunk_flop_terms) shows the difference.
    4. order       per rank its items in that order, a long sequence's chunks consecutive, chunk 0 first
                   (the workers forward them in order, their backwards in reverse: workers/chunkflow.py)
    5. keep        with scheduling.chunkflow_keep = K, the first n - K chunks of an n-chunk sequence are
                   `recompute` (ChunkSpan): their activations are dropped after the forward and recomputed
                   just before their backward; the last K chunks keep theirs
    6. counts      ranks padded with empty (idle) micro-batches to the largest count (ZeRO-2 needs equal
                   backward counts on every rank)

Sequences are still capped at scheduling.bucket_size x parallel.cp_size by the data pipeline, as for every
policy (all policies train the same batches); a chunked sequence then has at most N chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduling.balanced_packed import best_fit_decreasing, lpt_partition
from scheduling.plans import ChunkSpan, DacpPlan, SchedulingError, StepPlan

Slot = tuple[tuple[int, ...], ChunkSpan | None]
"""One micro-batch of one rank: its local sequences, and the span when it is a dependent chunk."""


@dataclass(frozen=True, slots=True)
class _Item:
    """What LPT places: a standalone chunk (several whole sequences) or every chunk of one long sequence."""

    tokens: int
    slots: tuple[Slot, ...]


def chunk_spans(length: int, chunk_size: int, keep: int) -> tuple[ChunkSpan, ...]:
    """The dependent chunks of one sequence: [i*C, min((i+1)*C, S)), the first n - keep recomputed."""
    count = -(-length // chunk_size)
    return tuple(ChunkSpan(chunk=i, num_chunks=count, start=i * chunk_size,
                           stop=min((i + 1) * chunk_size, length), recompute=i < count - keep)
                 for i in range(count))


def _items(lengths: Sequence[int], chunk_size: int, keep: int) -> list[_Item]:
    sizes = [int(s) for s in lengths]
    short = [i for i, s in enumerate(sizes) if s <= chunk_size]
    items = [_Item(sizes[i], tuple(((i,), span) for span in chunk_spans(sizes[i], chunk_size, keep)))
             for i, s in enumerate(sizes) if s > chunk_size]
    items += [_Item(sum(sizes[i] for i in pack), ((tuple(sorted(pack)), None),))
              for pack in best_fit_decreasing(short, sizes, chunk_size)]
    return items


def chunkflow(lengths: Sequence[int], *, dp_size: int, cp_size: int, bucket_size: int,
              keep: int = 1) -> StepPlan:
    """ChunkFlow's plan of one global batch (module docstring); `keep` is scheduling.chunkflow_keep."""
    if keep < 1:
        raise SchedulingError(f"scheduling.chunkflow_keep must be >= 1, got {keep}")
    items = _items(lengths, bucket_size, keep)
    ranks = dp_size * cp_size
    per_rank: list[list[Slot]] = [
        [slot for k in mine for slot in items[k].slots]
        for mine in lpt_partition([item.tokens for item in items], ranks)
    ]
    count = max(1, max(len(slots) for slots in per_rank))
    for slots in per_rank:
        slots += [((), None)] * (count - len(slots))
    micro_batches = []
    for dp in range(dp_size):
        group = per_rank[dp * cp_size:(dp + 1) * cp_size]  # CP rank r of DP rank d is chunkflow rank d*N + r
        plans = []
        for m in range(count):
            spans = tuple(slots[m][1] for slots in group)
            plans.append(DacpPlan(local=tuple(slots[m][0] for slots in group),
                                  chunks=spans if any(s is not None for s in spans) else ()))
        micro_batches.append(tuple(plans))
    return StepPlan(micro_batches=tuple(micro_batches))
