"""What the DACP attention needs to know about one CP rank's packed token stream.

Stream on CP rank r (N = cp_size). A sequence sharded over d ranks (its CP degree) is padded to 2d * c_i
tokens and cut into 2d chunks of c_i; the rank with index j inside those d ranks holds chunks j and
2d-1-j, so causal work is equal on each of them:

    [ local a | local b | ... | d0: chunk r, chunk 2N-1-r | ... | p0: chunk j, chunk 2d-1-j | ... | ... ]
    |<- num_local_tokens ->|<-- distributed part: d = N -->|<- partial part of degree d ->| <- next degree
                           |<------------------------ ring parts, in plan order ---------------------->|

Local sequences (degree 1) are whole: plain causal varlen attention, no communication. The distributed
part (degree N, `dist_chunk_lens`) is sharded over the whole CP group. Each `partial` part (per-sequence
CP degrees, docs/design.md §13) holds this rank's shards of the sequences of one aligned subgroup of
1 < d < N ranks, at most one part per degree, degree descending as in DacpPlan.partial. Every ring part
has the same shape on every rank of its ring (same c_i), which is what lets the ring exchange K/V blocks
verbatim. Host ints only; DacpIndex (workers/attention/index.py) is its device side, built once per
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True, slots=True, kw_only=True)
class RingPart:
    """One ring's share of the stream: this rank's two zigzag chunks of each of its sequences."""

    degree: int
    """d, the ranks the ring spans (its sequences are padded to multiples of 2d)."""
    chunk_lens: tuple[int, ...]
    """c_i per sequence: its padded length / (2d); the rank holds 2 * c_i of its tokens."""

    @property
    def num_tokens(self) -> int:
        return 2 * sum(self.chunk_lens)

    @property
    def cu(self) -> tuple[int, ...]:
        """Segment bounds of the part (relative to its start): 2 * c_i per sequence."""
        return (0, *accumulate(2 * c for c in self.chunk_lens))

    @property
    def cu_chunk(self) -> tuple[int, ...]:
        """Segment bounds when only one chunk (c_i tokens) of each sequence is taken."""
        return (0, *accumulate(self.chunk_lens))

    @property
    def shortest_longest_sequence(self) -> int:
        """A lower bound on its longest true length: padded 2d * c_i minus at most 2d - 1 pads."""
        return max((2 * self.degree * (c - 1) + 1 for c in self.chunk_lens), default=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class DacpLayout:
    cp_size: int
    """N, the CP group size the stream was built for (1: no context parallelism)."""
    local_lens: tuple[int, ...] = ()
    """Lengths of this rank's whole (local) sequences, in stream order."""
    dist_chunk_lens: tuple[int, ...] = ()
    """c_i per distributed sequence: its padded length / (2N); the rank holds 2 * c_i of its tokens."""
    partial: tuple[RingPart, ...] = ()
    """The subgroup rings this rank is in, after the distributed part: 1 < degree < N, degree descending."""

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        chunks = [c for part in self.rings for c in part.chunk_lens]
        if any(n < 1 for n in self.local_lens) or any(c < 1 for c in chunks):
            raise ValueError("sequence lengths and chunk lengths in a DacpLayout must be >= 1")
        degrees = [part.degree for part in self.partial]
        if degrees != sorted(set(degrees), reverse=True):
            raise ValueError(f"DacpLayout.partial: one part per degree, degree descending, got {degrees}")
        for part in self.partial:
            if not 1 < part.degree < self.cp_size or self.cp_size % part.degree or not part.chunk_lens:
                raise ValueError(f"DacpLayout.partial: a degree-{part.degree} part with "
                                 f"{len(part.chunk_lens)} sequences is not a subgroup ring of a "
                                 f"{self.cp_size}-rank CP group")

    @property
    def dist(self) -> RingPart:
        """The distributed part (degree N), possibly empty."""
        return RingPart(degree=self.cp_size, chunk_lens=self.dist_chunk_lens)

    @property
    def rings(self) -> tuple[RingPart, ...]:
        """Every ring part in stream order: the distributed one (always, maybe empty), then the partial."""
        return (self.dist, *self.partial)

    @property
    def shortest_longest_sequence(self) -> int:
        """A lower bound on the longest sequence's true length: a local one's exact length, a sharded one's
        padded length 2d * c_i minus the at most 2d - 1 pad tokens it may hold."""
        return max((*self.local_lens, *(part.shortest_longest_sequence for part in self.rings)), default=0)

    @property
    def num_local_tokens(self) -> int:
        return sum(self.local_lens)

    @property
    def num_dist_tokens(self) -> int:
        """Tokens of the distributed part (degree N)."""
        return 2 * sum(self.dist_chunk_lens)

    @property
    def num_ring_tokens(self) -> int:
        """Tokens of every ring part: distributed and partial."""
        return sum(part.num_tokens for part in self.rings)

    @property
    def num_tokens(self) -> int:
        return self.num_local_tokens + self.num_ring_tokens

    @property
    def cu_local(self) -> tuple[int, ...]:
        return (0, *accumulate(self.local_lens))

    @property
    def cu_dist(self) -> tuple[int, ...]:
        """Segment bounds of the distributed part (relative to its start): 2 * c_i per sequence."""
        return self.dist.cu

    @property
    def cu_chunk(self) -> tuple[int, ...]:
        """Segment bounds when only one chunk (c_i tokens) of each distributed sequence is taken."""
        return self.dist.cu_chunk
