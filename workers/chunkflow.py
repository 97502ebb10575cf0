"""ChunkFlow's state-aware schedule of one sequence's dependent chunks on one rank (the chunkflow policy).

A payload's micro-batches are grouped into units (`micro_batch_units`): a dependent sequence's n chunks
(consecutive in the plan, chunk 0 first: scheduling/chunkflow.py) form one unit, every other micro-batch
is a unit of its own. A chunked unit runs (`run_chunked`), with K = the chunks that keep their activations
(ChunkSpan.recompute marks the others, the first n - K):

    forward   chunk 0, 1, ..., n-1 in order, each writing its K/V into the sequence's store
              (workers/attention/chunked.py); a recomputed chunk under no_grad, decoder only (nothing of
              its graph is kept), a kept chunk with its graph and loss
    backward  chunk n-1, n-2, ..., 0: a kept chunk's backward straight away, a recomputed chunk's after
              forwarding it again with its graph; each backward adds dK/dV into the store for the
              earlier chunks and takes the later chunks' dK/dV for its own K/V

So at most K chunks' activations live at once (the last K after the forward pass, then one recomputed
chunk at a time), plus the store: the sequence's K/V and their fp32 gradients, every layer. Each chunk's
backward is one `backward(loss)` call of the caller (one engine.backward: the plan's micro-batch count is
the rank's backward count, as ZeRO-2 needs). Reverse order makes the gradient exact: chunk i's K/V feed
only chunks >= i, all of whose backwards, and so all of whose dK/dV for chunk i, come before chunk i's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workers.attention.chunked import ChunkKV
from workers.attention.runtime import AttentionRuntime
from workers.batch import ChunkLike, RankBatch
from workers.forward import decoder_hidden, micro_batch_loss_sum


def micro_batch_units(spans: Sequence[ChunkLike | None]) -> list[list[int]]:
    """Positions of a rank's micro-batches (their chunk spans, None for whole sequences) grouped: a
    dependent sequence's chunks together, every other micro-batch alone.

    ValueError when a sequence's chunks are not consecutive from chunk 0 (the plan guarantees they are).
    """
    units: list[list[int]] = []
    previous: ChunkLike | None = None  # the open sequence's last chunk
    for position, span in enumerate(spans):
        if span is None or span.chunk == 0:
            if previous is not None:
                raise ValueError(f"micro-batch {position}: a chunked sequence's chunks end before its last")
            units.append([position])
        elif previous is None or span.chunk != previous.chunk + 1:
            raise ValueError(f"micro-batch {position}: chunk {span.chunk} does not follow its chunk "
                             f"{span.chunk - 1}")
        else:
            units[-1].append(position)
        previous = span if span is not None and span.chunk < span.num_chunks - 1 else None
    if previous is not None:
        raise ValueError("the payload ends inside a chunked sequence")
    return units


def run_chunked(model: torch.nn.Module, batches: Sequence[RankBatch], *, runtime: AttentionRuntime | None,
                loss_chunk_tokens: int, backward: Callable[[torch.Tensor], None]) -> None:
    """Forward and backward one sequence's chunks (device batches, chunk 0 first) in ChunkFlow's order
    (module docstring); `backward(loss_sum)` is called once per chunk, last chunk first."""
    model = getattr(model, "module", model)
    store = ChunkKV(batches[-1].chunk.stop)
    losses: list[torch.Tensor | None] = []
    for batch in batches:
        if batch.chunk.recompute:
            with torch.no_grad():
                decoder_hidden(model, batch, runtime=runtime, store=store)  # fills the store only
            losses.append(None)
        else:
            losses.append(micro_batch_loss_sum(model, batch, runtime=runtime,
                                               loss_chunk_tokens=loss_chunk_tokens, store=store))
    for i in reversed(range(len(batches))):
        loss = losses[i]
        losses[i] = None  # the graph goes with this backward
        if loss is None:
            loss = micro_batch_loss_sum(model, batches[i], runtime=runtime,
                                        loss_chunk_tokens=loss_chunk_tokens, store=store)
        backward(loss)


def chunked_loss_sum(model: torch.nn.Module, batches: Sequence[RankBatch], *,
                     runtime: AttentionRuntime | None, loss_chunk_tokens: int) -> torch.Tensor:
    """The CE sum of one sequence's chunks, forward only (the eval loss; the caller holds no_grad)."""
    store = ChunkKV(batches[-1].chunk.stop)
    return sum(micro_batch_loss_sum(model, batch, runtime=runtime, loss_chunk_tokens=loss_chunk_tokens,
                                    store=store).float() for batch in batches)
