"""One optimizer step of a Skrull worker: run every micro-batch of its payload, then `engine.step()`.

Loss normalization (docs/design.md §7). The loss of a global batch is

    L = sum over every label token of the global batch of CE / G,   G = payload.global_label_tokens.

Rank k contributes the CE sum over its own tokens, l_k, so L = sum_k l_k / G and dL/dθ = sum_k dl_k/dθ / G.
DeepSpeed *averages* gradients over its data-parallel group, which is all W = DP x CP ranks (CP ranks are
replicas holding different tokens; spare ranks count too), so each rank back-propagates l_k * W / G: the
mean over W ranks then equals the sum, never divided per micro-batch, per rank or by accumulation steps.

Equal module sequences. ZeRO-2 reduces gradients inside every backward, so every rank must run the same
number of backwards in the same parameter order; ZeRO-3 also gathers each module's partitioned weights
in that module's forward and backward (collectives over all ranks), so every rank must run the same
module forwards and backwards in the same order. The plan gives every DP rank the same micro-batch count
(StepPlan refuses unequal counts) and every CP rank of a DP rank the same micro-batches; each micro-batch
is one forward of the whole decoder and the loss head (workers/loss.py LossHead) and one backward, with
activation recomputation, if on, inside it on every rank alike. A CP rank with no token in a micro-batch
(all sequences local to its peers) runs an *idle* micro-batch: one pad token with no target, whose loss
is 0 but which runs every module forward and backward like a real one. A spare rank
(workers/distributed.py) runs only idle micro-batches, as many as the trained ranks run.

Each micro-batch's forward goes through DeepSpeed's `engine(...)` (`engine_loss_sum`): ZeRO-3 counts its
micro-steps there (the first backward of a step stores the reduced gradient partition, the later ones add
to it; skipped, every micro-batch's gradient replaced the one before) and resets its gradient-hook counts.

Dependent chunks (the chunkflow policy): a sequence's chunks, consecutive micro-batches of the payload,
run as one unit in ChunkFlow's order (workers/chunkflow.py: forwards in order, backwards in reverse, the
non-kept chunks recomputed), still one backward per micro-batch; the accumulation boundary is set on the
step's last backward, whichever micro-batch it belongs to. Their losses run through the module directly
(workers/chunkflow.py), so chunkflow is refused at ZeRO-3 (app/config.py), whose micro-step bookkeeping
lives in engine.forward.

Non-finite guard (workers/nonfinite.py): each micro-batch's backward loss is multiplied by 1, or by NaN when
that loss is inf/NaN, so a bad loss always yields a non-finite gradient norm, which DeepSpeed's ZeRO step
refuses to apply (`StepStats.applied`, from `engine.was_step_applied()`).

Nothing here waits for the device. Every micro-batch's stream is built and sent (pinned, non-blocking)
before the first forward, so no host work sits between two micro-batches; the laps (workers/laps.py) are
CUDA events, read on log steps; with the fused optimizer the step's `applied` flag is a device tensor
(workers/zero_step.py) and the loss stays one until the metrics are reduced. A caller that times single
steps (bench train, profile, bench step) passes `sync=True`: the step then ends when the device is done.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from scheduling import DacpPlan
from scheduling.payload import IGNORE_INDEX, MicroBatchPayload, RankPayload
from workers.attention.runtime import AttentionRuntime
from workers.batch import RankBatch, build_rank_batch
from workers.chunkflow import micro_batch_units, run_chunked
from workers.device_step import applied_flag
from workers.distributed import ParallelGroups
from workers.forward import micro_batch_loss_sum
from workers.laps import Laps
from workers.nonfinite import nan_if_nonfinite


@dataclass(frozen=True, slots=True)
class StepStats:
    loss_sum: torch.Tensor
    """This rank's CE sum over its label tokens (detached, fp32, on the model's device)."""
    laps: Laps
    """Each micro-batch's time, then the optimizer step's (workers/laps.py; read on log steps)."""
    applied: bool | torch.Tensor = True
    """The update was applied (False: the global gradient norm, or a loss, was inf/NaN): DeepSpeed's host
    bool, or a device bool tensor under the device step (workers/zero_step.py), read on log steps."""

    @property
    def compute_s(self) -> float:
        """Seconds of forward + backward + optimizer step on this rank (the device's, on CUDA: valid once
        the device finished the step, as after a log step's reduction or `run_step(sync=True)`)."""
        return self.laps.total()


def idle_batch(cp_rank: int, cp_size: int, pad_id: int = 0) -> RankBatch:
    """A one-token micro-batch with no target: keeps this rank's backward count and hook order."""
    local = tuple((0,) if r == cp_rank else () for r in range(cp_size))
    plan = DacpPlan(local=local, distributed=())
    ids = [np.array([pad_id], dtype=np.int64)]
    labels = [np.array([IGNORE_INDEX], dtype=np.int64)]
    return build_rank_batch(plan, ids, labels, cp_rank=cp_rank, cp_size=cp_size)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a wall-clock reading covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_loss_sum(engine: object, batch: RankBatch, *, runtime: AttentionRuntime | None,
                    loss_chunk_tokens: int) -> torch.Tensor:
    """`micro_batch_loss_sum` of engine.module, run by DeepSpeed's `engine.forward`.

    engine.forward does ZeRO's per-forward bookkeeping (the module docstring) and then calls
    `engine.module(...)`, the HF model, whose own forward would build logits for every token; for this one
    call the module's forward is the packed-stream loss (chunked, workers/loss.py) instead.
    """
    module = getattr(engine, "module", None)
    if module is None:  # a bare model (the eval tests): no engine bookkeeping to do
        return micro_batch_loss_sum(engine, batch, runtime=runtime, loss_chunk_tokens=loss_chunk_tokens)
    module.forward = functools.partial(micro_batch_loss_sum, module)
    try:
        return engine(batch, runtime=runtime, loss_chunk_tokens=loss_chunk_tokens)
    finally:
        del module.forward  # the class's forward again


def rank_batch(micro_batch: MicroBatchPayload, cp_rank: int, cp_size: int,
               device: torch.device) -> RankBatch:
    """This rank's stream of one micro-batch on `device` (an empty one: the idle batch)."""
    batch = build_rank_batch(micro_batch.plan, micro_batch.input_ids, micro_batch.labels,
                             cp_rank=cp_rank, cp_size=cp_size)
    return (idle_batch(cp_rank, cp_size) if batch.num_tokens == 0 else batch).to(device)


def run_step(
    engine: object,
    payload: RankPayload,
    groups: ParallelGroups,
    *,
    device: torch.device,
    loss_chunk_tokens: int,
    sync: bool = False,
) -> StepStats:
    """Forward/backward every micro-batch with the accumulation boundary on the last, then step; with
    `sync`, wait for the device at the end (module docstring)."""
    scale = groups.world_size / max(payload.global_label_tokens, 1)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    count = len(payload.micro_batches)
    cp_rank, cp_size = (0, 1) if groups.is_spare else (groups.cp_rank, groups.cp_size)
    done = 0

    def backward(micro_loss: torch.Tensor) -> None:
        nonlocal done, loss_sum
        done += 1
        engine.set_gradient_accumulation_boundary(done == count)
        engine.backward(micro_loss * scale * nan_if_nonfinite(micro_loss), scale_wrt_gas=False)
        loss_sum += micro_loss.detach().float()
        laps.mark()

    ready = [rank_batch(mb, cp_rank, cp_size, device) for mb in payload.micro_batches]  # all sent up front
    laps = Laps(device)
    for unit in micro_batch_units([mb.plan.chunk_on(cp_rank) for mb in payload.micro_batches]):
        batches = [ready[i] for i in unit]
        laps.begin()
        if batches[0].chunk is not None:
            run_chunked(engine.module, batches, runtime=groups.attention, loss_chunk_tokens=loss_chunk_tokens,
                        backward=backward)
        else:
            backward(engine_loss_sum(engine, batches[0], runtime=groups.attention,
                                     loss_chunk_tokens=loss_chunk_tokens))
    engine.step()
    laps.mark()
    if sync:
        synchronize(device)
    return StepStats(loss_sum=loss_sum, laps=laps, applied=applied_flag(engine))
