"""The eval loss on the workers: forward only over the eval set, with the same DACP plans as training.

    once per worker-group start:  EvalSet.fetch(planner, groups)   -> ObjectRef of this rank's payloads
    every train.eval_every steps and after the last:
        payloads = ray.get(ref)          (from the object store; no copy is kept between evals)
        with torch.no_grad(): for every eval batch, for every micro-batch:
            loss_sum += engine_loss_sum(engine, this rank's stream)   (DACP attention, CP ring)
        all_reduce(loss_sum) over the world group
        eval_loss = loss_sum / sum over eval batches of global_label_tokens

That is the training loss normalization (workers/step.py) over the whole eval set: the CE sum over every
eval label token divided by their count, independent of the DP x CP shape and the plan. The micro-batches
run in plan order on every CP rank of a group, so the ring's transfers pair up as in training; a rank
without a token in a micro-batch runs the one-token idle batch (no target), as a training step does, so
every rank of the CP group makes the same attention calls (and, at ZeRO-3, the same weight gathers). A
chunked sequence (the chunkflow policy) runs its chunks in order with its K/V store (workers/chunkflow.py).
A spare rank computes only idle batches and adds 0 to the all_reduce. The model is put in eval mode
(dropout off) for the pass and restored after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scheduling.payload import RankPayload
from workers.chunkflow import chunked_loss_sum, micro_batch_units
from workers.distributed import ParallelGroups
from workers.step import engine_loss_sum, rank_batch

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def is_eval_step(step: int, last_step: int, eval_every: int) -> bool:
    """Eval after every `eval_every`-th step and after the last one; never when eval_every is 0."""
    return bool(eval_every) and (step % eval_every == 0 or step == last_step)


@dataclass
class EvalSet:
    """This rank's eval payloads, as one object-store ref (planned once per worker-group shape)."""

    ref: Any

    @classmethod
    def fetch(cls, planner: Any, groups: ParallelGroups, *, timeout_s: float | None) -> EvalSet:
        """Ask the planner for this rank's eval payloads (it plans them on the group's first call)."""
        import ray

        dp_rank, cp_rank = (-1, 0) if groups.is_spare else (groups.dp_rank, groups.cp_rank)  # as a step
        (ref,) = ray.get(planner.eval_payloads.remote(groups.dp_size, groups.spares, dp_rank, cp_rank),
                         timeout=timeout_s)
        return cls(ref)

    def loss(self, engine: DeepSpeedEngine, groups: ParallelGroups, *, device: torch.device,
             loss_chunk_tokens: int) -> float:
        """The eval loss of the current weights (collective over the world group: every rank calls it)."""
        import ray

        payloads: tuple[RankPayload, ...] = ray.get(self.ref)
        loss_sum = eval_loss_sum(engine, payloads, groups, device=device, loss_chunk_tokens=loss_chunk_tokens)
        dist.all_reduce(loss_sum, group=groups.world_group)
        label_tokens = sum(payload.global_label_tokens for payload in payloads)
        return float(loss_sum.item()) / max(label_tokens, 1)


def eval_loss_sum(engine: Any, payloads: tuple[RankPayload, ...], groups: ParallelGroups, *,
                  device: torch.device, loss_chunk_tokens: int) -> torch.Tensor:
    """This rank's fp32 CE sum over its eval tokens, forward only (through the engine, as a training
    micro-batch: workers/step.py engine_loss_sum), in eval mode."""
    cp_rank, cp_size = (0, 1) if groups.is_spare else (groups.cp_rank, groups.cp_size)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    model = getattr(engine, "module", engine)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for payload in payloads:
                spans = [mb.plan.chunk_on(cp_rank) for mb in payload.micro_batches]
                for unit in micro_batch_units(spans):
                    batches = [rank_batch(payload.micro_batches[i], cp_rank, cp_size, device) for i in unit]
                    if batches[0].chunk is not None:
                        loss_sum += chunked_loss_sum(model, batches, runtime=groups.attention,
                                                     loss_chunk_tokens=loss_chunk_tokens)
                    else:
                        loss_sum += engine_loss_sum(engine, batches[0], runtime=groups.attention,
                                                    loss_chunk_tokens=loss_chunk_tokens).float()
    finally:
        model.train(was_training)
    return loss_sum
