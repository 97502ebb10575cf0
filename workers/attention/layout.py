"""What the DACP attention needs to know about one CP rank's packed token stream.

Stream on CP rank r (N = cp_size, distributed sequence i padded to 2N * c_i tokens, cut into 2N
chunks of c_i; rank r holds chunks r and 2N-1-r, so causal work is equal on every rank):

    [ local seq a | local seq b | ... | d0: chunk r, chunk 2N-1-r | d1: chunk r, chunk 2N-1-r | ... ]
    |<------- num_local_tokens ------>|<---------------- num_dist_tokens = 2 * sum(c_i) ------------->|

Local sequences are whole (plain causal varlen attention, no communication). The distributed part has
the same shape on every rank (same c_i), which is what lets the ring exchange K/V blocks verbatim.
Host ints only; DacpIndex (workers/attention/index.py) is its device side, built once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True, slots=True, kw_only=True)
class DacpLayout:
    cp_size: int
    """N, the CP group size the stream was built for (1: no context parallelism)."""
    local_lens: tuple[int, ...] = ()
    """Lengths of this rank's whole (local) sequences, in stream order."""
    dist_chunk_lens: tuple[int, ...] = ()
    """c_i per distributed sequence: its padded length / (2N); the rank holds 2 * c_i of its tokens."""

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if any(n < 1 for n in self.local_lens) or any(c < 1 for c in self.dist_chunk_lens):
            raise ValueError("sequence lengths and chunk lengths in a DacpLayout must be >= 1")

    @property
    def shortest_longest_sequence(self) -> int:
        """A lower bound on the longest sequence's true length: a local one's exact length, a distributed
        one's padded length 2N * c_i minus the at most 2N - 1 pad tokens it may hold."""
        padded = max((2 * self.cp_size * c for c in self.dist_chunk_lens), default=0)
        return max((*self.local_lens, padded - 2 * self.cp_size + 1), default=0)

    @property
    def num_local_tokens(self) -> int:
        return sum(self.local_lens)

    @property
    def num_dist_tokens(self) -> int:
        return 2 * sum(self.dist_chunk_lens)

    @property
    def num_tokens(self) -> int:
        return self.num_local_tokens + self.num_dist_tokens

    @property
    def cu_local(self) -> tuple[int, ...]:
        return (0, *accumulate(self.local_lens))

    @property
    def cu_dist(self) -> tuple[int, ...]:
        """Segment bounds of the distributed part (relative to its start): 2 * c_i per sequence."""
        return (0, *accumulate(2 * c for c in self.dist_chunk_lens))

    @property
    def cu_chunk(self) -> tuple[int, ...]:
        """Segment bounds when only one chunk (c_i tokens) of each distributed sequence is taken."""
        return (0, *accumulate(self.dist_chunk_lens))
