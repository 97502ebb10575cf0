"""The DACP attention as a Hugging Face transformers attention implementation named "dacp".

The model is called on one rank's packed stream (batch of 1) with two extra keyword arguments, which
transformers forwards to every attention call (docs/design.md section 9):

    model.model(input_ids=ids_1T, position_ids=pos_1T, use_cache=False,
                dacp_index=batch.index, dacp_runtime=runtime)     # DacpIndex, AttentionRuntime

`dacp_index` is the micro-batch's DacpIndex (workers/attention/index.py), built once when the batch moved
to the device: every layer reads the same device tensors. Without it, every batch row is treated as one
whole causal sequence (no padding mask) and attended on this rank alone (the runtime's kernel, no ring),
so a plain `model(input_ids)` call of one unpadded sequence per row still computes standard attention;
the index of such a row is built once per (length, device) and then reused by every layer and call.

A dependent chunk (the chunkflow policy, workers/chunkflow.py) also passes `dacp_chunk`, a ChunkCall: its
queries then attend to its sequence's earlier keys as well (workers/attention/chunked.py), per layer by the
attention module's `layer_idx`.
"""

from __future__ import annotations

import functools

import torch

from workers.attention.chunked import ChunkCall, chunk_attention
from workers.attention.dacp import dacp_attention
from workers.attention.index import DacpIndex
from workers.attention.layout import DacpLayout
from workers.attention.runtime import AttentionRuntime, default_runtime

ATTENTION_NAME = "dacp"
OP_ATTENTION_NAME = "dacp_op"
"""The same attention through the custom op (workers/attention/op.py), for compiled decoder layers."""


@functools.lru_cache(maxsize=64)
def whole_row_index(length: int, device: torch.device) -> DacpIndex:
    """The index of one whole causal sequence of `length` tokens (a plain model call's row)."""
    return DacpIndex.build(DacpLayout(cp_size=1, local_lens=(length,) if length else ()), device)


def dacp_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    dacp_index: DacpIndex | None = None, dacp_runtime: AttentionRuntime | None = None,
    dacp_chunk: ChunkCall | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, H, S, D], key/value [B, G, S, D] -> (out [B, S, H, D], None)."""
    if dropout:
        raise ValueError("the dacp attention has no dropout: set the model config's attention_dropout to 0")
    if "dacp_layout" in kwargs:
        # The keyword before DacpIndex: a layout would be re-indexed by every layer (host work per layer).
        raise TypeError("pass dacp_index=DacpIndex.build(layout, device) per micro-batch, not dacp_layout")
    batch = query.shape[0]
    if dacp_index is not None and batch != 1:
        raise ValueError(f"a DACP stream is one packed row; got a batch of {batch} rows")
    runtime = dacp_runtime
    if dacp_index is None and runtime is not None:
        runtime = runtime.single_rank()  # whole rows, not shards: the ring has nothing to exchange
    index = dacp_index or whole_row_index(query.shape[2], query.device)
    window = kwargs.get("sliding_window")
    longest = dacp_chunk.stop if dacp_chunk is not None else index.layout.shortest_longest_sequence
    if window and window < longest:
        # A window at least as long as every sequence is full causal attention: such models pass preflight
        # (app/model/support.py refuses shorter windows before Ray starts); this is the safety net.
        raise ValueError(f"the dacp attention has no sliding window: a {window}-token window is shorter "
                         f"than a {longest}-token sequence of this micro-batch")
    if dacp_chunk is not None:
        if dacp_index is None:
            raise ValueError("a dependent chunk (dacp_chunk) needs its micro-batch's dacp_index")
        kernel = (runtime or default_runtime(query.device)).kernel
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = chunk_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                              dacp_chunk, layer=module.layer_idx, kernel=kernel, diag=index.local,
                              scale=scale)
        return out[None], None
    outs = []
    for b in range(batch):
        out, _ = dacp_attention(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1),
                                index, runtime, scale=scaling)
        outs.append(out)
    # One row (every training call) as a view: o_proj then saves the attention's own saved output, not a
    # stacked copy of it (one [T, H, D] activation less per layer).
    return (outs[0][None] if batch == 1 else torch.stack(outs)), None


def register_dacp_attention() -> str:
    """Register "dacp" with transformers' AttentionInterface (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, dacp_attention_forward)
    return ATTENTION_NAME


def dacp_op_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, G, T, D] -> (out [1, T, H, D], None), through
    torch.ops.skrull.dacp_attention with the micro-batch's index from its call context (workers/attention/
    op.py: a compiled layer's graph takes tensors only; the sliding-window check runs per micro-batch in
    workers/forward.py)."""
    from workers.attention.op import dacp_attention_op

    if dropout:
        raise ValueError("the dacp attention has no dropout: set the model config's attention_dropout to 0")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out, _ = dacp_attention_op(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                               scale)
    return out[None], None


def register_dacp_op_attention() -> str:
    """Register "dacp_op" with transformers' AttentionInterface (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(OP_ATTENTION_NAME, dacp_op_attention_forward)
    return OP_ATTENTION_NAME
