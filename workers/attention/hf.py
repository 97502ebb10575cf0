"""The DACP attention as a Hugging Face transformers attention implementation named "dacp".

The model is called on one rank's packed stream (batch of 1) with two extra keyword arguments, which
transformers forwards to every attention call (docs/design.md section 9):

    model.model(input_ids=ids_1T, position_ids=pos_1T, use_cache=False,
                dacp_layout=batch.layout, dacp_runtime=runtime)     # runtime: AttentionRuntime

Without `dacp_layout`, every batch row is treated as one whole causal sequence (no padding mask) and
attended on this rank alone (the runtime's kernel, no ring), so a plain `model(input_ids)` call of one
unpadded sequence per row still computes standard attention.
"""

from __future__ import annotations

import torch

from workers.attention.dacp import dacp_attention
from workers.attention.layout import DacpLayout
from workers.attention.runtime import AttentionRuntime

ATTENTION_NAME = "dacp"


def dacp_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    dacp_layout: DacpLayout | None = None, dacp_runtime: AttentionRuntime | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, H, S, D], key/value [B, G, S, D] -> (out [B, S, H, D], None)."""
    if dropout:
        raise ValueError("the dacp attention has no dropout: set the model config's attention_dropout to 0")
    if kwargs.get("sliding_window"):
        raise ValueError("the dacp attention does not implement sliding-window layers (use_sliding_window)")
    batch = query.shape[0]
    if dacp_layout is not None and batch != 1:
        raise ValueError(f"a DACP stream is one packed row; got a batch of {batch} rows")
    runtime = dacp_runtime
    if dacp_layout is None and runtime is not None:
        runtime = runtime.single_rank()  # whole rows, not shards: the ring has nothing to exchange
    outs = []
    for b in range(batch):
        layout = dacp_layout or DacpLayout(cp_size=1, local_lens=(query.shape[2],) if query.shape[2] else ())
        out, _ = dacp_attention(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1),
                                layout, runtime, scale=scaling)
        outs.append(out)
    return torch.stack(outs), None


def register_dacp_attention() -> str:
    """Register "dacp" with transformers' AttentionInterface (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, dacp_attention_forward)
    return ATTENTION_NAME
