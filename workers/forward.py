"""One micro-batch on one CP rank: the model on the packed stream, then the chunked loss sum.

    batch = batch.to(device)                      # once: pinned copies + the layout's DacpIndex
    hidden = decoder(input_ids[1,T], position_ids[1,T], dacp_index, dacp_runtime)     # DACP attention
    loss_sum = sum over label_rows t of CE(lm_head(hidden[t]), targets[t])             # chunked, fp32

The caller divides by the global batch's label-token count (docs/design.md section 7), never per
micro-batch. A dependent chunk (batch.chunk, the chunkflow policy) also passes its sequence's K/V store
(workers/attention/chunked.py) to every attention call.
"""

from __future__ import annotations

import torch

from workers.attention.chunked import ChunkCall, ChunkKV
from workers.attention.op import attention_call
from workers.attention.runtime import AttentionRuntime, default_runtime
from workers.batch import RankBatch
from workers.compile import is_compiled, sliding_window_problem
from workers.loss import LOSS_HEAD, linear_cross_entropy_sum


def micro_batch_loss_sum(
    model: torch.nn.Module, batch: RankBatch, *, runtime: AttentionRuntime | None = None,
    loss_chunk_tokens: int = 4096, store: ChunkKV | None = None,
) -> torch.Tensor:
    """fp32 sum of token cross-entropies over batch.targets on this rank (differentiable).

    `model` is the HF causal LM, or a wrapper exposing it as `.module` (a DeepSpeed engine). `runtime`
    is the worker's attention runtime (kernel + CP ring); None: single rank, "auto" kernel. `store`: the
    K/V store of the sequence a dependent chunk belongs to (required exactly when batch.chunk is set).
    """
    model = getattr(model, "module", model)
    device = model.get_input_embeddings().weight.device
    batch = batch.to(device)
    if batch.num_tokens == 0:
        # Keep the autograd graph connected to the parameters so a backward is still well defined. Training
        # and eval never come here (they run the one-token idle batch, workers/step.py): this runs no module,
        # which ZeRO-3's per-module weight gathers would need on every rank alike.
        return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
    hidden_TE = decoder_hidden(model, batch, runtime=runtime, store=store)
    head = getattr(model, LOSS_HEAD, None)
    if head is not None:  # a model of workers/models.py: the loss runs as its module (ZeRO-3 gathers for it)
        return head(hidden_TE, batch.targets, batch.label_rows, loss_chunk_tokens)
    return linear_cross_entropy_sum(hidden_TE, model.get_output_embeddings(), batch.targets,
                                    loss_chunk_tokens, label_rows=batch.label_rows)


def decoder_hidden(model: torch.nn.Module, batch: RankBatch, *, runtime: AttentionRuntime | None,
                   store: ChunkKV | None = None) -> torch.Tensor:
    """The decoder's last hidden states [T, E] of a device batch (the LM head not applied)."""
    if (batch.chunk is None) != (store is None):
        raise ValueError("a dependent chunk's batch needs its sequence's K/V store, and only it takes one")
    if is_compiled(model):
        return _compiled_decoder_hidden(model, batch, runtime)
    chunk = None if store is None else ChunkCall(store=store, start=batch.chunk.start, stop=batch.chunk.stop,
                                                 prior=batch.prior)
    outputs = model.get_decoder()(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                  use_cache=False, dacp_index=batch.index, dacp_runtime=runtime,
                                  dacp_chunk=chunk)
    return outputs.last_hidden_state[0]


def _compiled_decoder_hidden(model: torch.nn.Module, batch: RankBatch,
                             runtime: AttentionRuntime | None) -> torch.Tensor:
    """decoder_hidden of a model with compiled layers (workers/compile.py): the micro-batch's layout reaches
    the attention op through its call context, not as keyword arguments the graphs would guard on."""
    if batch.chunk is not None:
        raise ValueError("train.compile does not run dependent chunks (the chunkflow policy)")
    problem = sliding_window_problem(model, batch.index.layout.shortest_longest_sequence)
    if problem:
        raise ValueError(problem)
    with attention_call(batch.index, runtime or default_runtime(batch.input_ids.device)):
        outputs = model.get_decoder()(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                      use_cache=False)
    return outputs.last_hidden_state[0]
