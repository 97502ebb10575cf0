"""One untimed warm-up micro-batch before a worker group's first step.

The first micro-batch of a run pays for what later ones reuse: the CUDA caching allocator's segments
(a first micro-batch of C tokens grows them to the size every later one needs), cuBLAS / Triton autotuning,
torch.compile's graphs for a dynamic token count, lazy initializations in the libraries. Run once, before
step 1, as a real micro-batch of `tokens` random tokens on every rank (local sequences of at most
SEQUENCE_TOKENS each, no ring: the CP ranks need not agree on a layout; short sequences because attention
is quadratic in a sequence's length: a C of 600k tokens as one sequence would take minutes), its loss
multiplied by 0: its backward goes through
DeepSpeed's gradient reduction like any micro-batch (every rank runs it, so ZeRO's collectives match) and
adds exact zeros to the gradient the first step then accumulates. No optimizer step, no metrics, no laps:
the online calibration never sees it. The optimizer's state is allocated first (workers/optimizer_state.py),
so the warm-up holds what every later micro-batch holds: a C that does not fit fails here, before step 1.
"""

from __future__ import annotations

import numpy as np
import torch

from scheduling import DacpPlan
from workers.batch import build_rank_batch
from workers.distributed import ParallelGroups
from workers.optimizer_state import allocate_optimizer_state
from workers.step import engine_loss_sum

SEQUENCE_TOKENS = 4096
"""The warm-up's longest sequence: long enough for the attention kernel's large-block paths."""


def warm_up(engine: object, groups: ParallelGroups, device: torch.device, *, tokens: int,
            loss_chunk_tokens: int) -> None:
    """Forward + backward of one `tokens`-token micro-batch with a zero loss (module docstring); 0: none."""
    if tokens <= 0:
        return
    allocate_optimizer_state(engine.optimizer)
    cp_rank, cp_size = (0, 1) if groups.is_spare else (groups.cp_rank, groups.cp_size)
    vocab = engine.module.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(0)
    lengths = [SEQUENCE_TOKENS] * (tokens // SEQUENCE_TOKENS) + ([tokens % SEQUENCE_TOKENS] if tokens %
                                                                 SEQUENCE_TOKENS else [])
    ids = [rng.integers(0, vocab, size=n, dtype=np.int64) for n in lengths]
    mine = tuple(range(len(ids)))
    plan = DacpPlan(local=tuple(mine if r == cp_rank else () for r in range(cp_size)), distributed=())
    batch = build_rank_batch(plan, ids, ids, cp_rank=cp_rank, cp_size=cp_size).to(device)
    engine.set_gradient_accumulation_boundary(False)
    loss = engine_loss_sum(engine, batch, runtime=groups.attention, loss_chunk_tokens=loss_chunk_tokens)
    engine.backward(loss * 0.0, scale_wrt_gas=False)
