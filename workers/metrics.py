"""Per-step training metrics, kept on the device and reduced across ranks only on log steps.

Each step adds one record: host facts of the payload (tokens, plan time, cursor, ...) and this rank's
device tensors (CE sum, gradient norm) plus its timings. `flush` runs one all_reduce (CE sums) and one
all_gather (timings) over the world group for the whole window of `train.log_every` steps, so a step
between two log steps never waits on a collective or a device-to-host copy for metrics.

    per step of the window:
      loss              sum over ranks of CE sums / global label tokens
      step_s            max over ranks of (planner wait + compute)     (the step takes its slowest rank)
      predicted_step_s  the hardware profile's time of the step's plan (scheduling/simulate.py), which
                        app/profiling/stale_check.py compares with step_s to say when the profile is stale
      compute_imbalance max / mean over ranks of compute time
      planner_wait_s    max over ranks of planner wait
      tokens_per_s      global tokens / step_s
      mfu               model training FLOPs of the step / (step_s * trained ranks * peak_flops)
                        = payload.flops_at_peak_s / (step_s * trained ranks); the FLOPs are the cost
                        model's (scheduling.cost_formula) for the whole global batch, so mfu is the
                        hardware profile's view of useful work, not a hardware counter
      padding_fraction  1 - global tokens / tokens computed over all ranks (trained and spare), where a
                        rank computes, per micro-batch, its local sequences whole plus its 2 zigzag chunks
                        of each distributed sequence padded to a multiple of 2N (workers/batch.py), or one
                        idle token when that is nothing (workers/step.py)
      rank_compute_s    per world rank: compute seconds of the step (NaN for a spare rank): busy time
      micro_batch_s     per micro-batch: the mean over the trained ranks of its lap (workers/laps.py); the
                        ZeRO reduction ending every backward and the CP ring keep the ranks' laps equal
      optimizer_s       the optimizer step's lap, the same mean (both are what the planner's online
                        calibration fits the profile to: scheduling/refit.py)
      calibration_version  how many times the planner had refitted the profile when the step was fetched;
                        the step where it grows also carries `calibration`, the fit itself (its profile,
                        factors, steps and errors: scheduling/calibration.py), which the driver writes to
                        the run directory (app/profiling/calibration_log.py)
      update_skipped    DeepSpeed did not apply the step's update (its loss or gradient norm was inf/NaN,
                        workers/nonfinite.py); then also "nonfinite": which of the two
      skipped_steps     steps skipped so far by this start of the worker group
      lr                the learning rate the step trained with, read from the optimizer before it
                        (identical on every rank; workers/lr_schedule.py)
      source_tokens/ID  with data.sources: the global batch's tokens from source ID (a key per source in
                        the batch), so a run's curves show the mix it trained on

    on the window's last step only (the log step), on CUDA only (absent on CPU):
      gpu_peak_bytes    max over ranks of torch.cuda.max_memory_allocated: the peak of every step so far
                        (DeepSpeed last resets the counter while it builds the ZeRO optimizer); the caching
                        allocator's host-side counter, read at the flush, so no step waits for it
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scheduling.actor import Fetched
from scheduling.payload import RankPayload
from workers.batch import padded_length
from workers.laps import Laps


@dataclass(frozen=True, slots=True)
class StepRecord:
    fetched: Fetched
    loss_sum: torch.Tensor
    grad_norm: torch.Tensor
    laps: Laps
    applied: bool | torch.Tensor = True
    """DeepSpeed's host bool, or the device step's flag (deferred: judged at the flush)."""
    nonfinite: str | None = None
    skipped_steps: int = 0
    lr: float = float("nan")

    @property
    def deferred(self) -> bool:
        return isinstance(self.applied, torch.Tensor)


@dataclass
class MetricsWindow:
    """The steps since the last flush; `flush` reduces them and returns one metrics dict per step."""

    records: list[StepRecord] = field(default_factory=list)
    spare: bool = False
    """A spare rank (workers/distributed.py): its compute time is left out of step time and imbalance."""
    calibration_version: int = 0
    """The newest fit's version reported so far (its record goes out once)."""

    def add(self, fetched: Fetched, loss_sum: torch.Tensor, grad_norm: object, laps: Laps, *,
            applied: bool | torch.Tensor = True, nonfinite: str | None = None, skipped_steps: int = 0,
            lr: float = float("nan")) -> None:
        norm = torch.as_tensor(float("nan") if grad_norm is None else grad_norm, device=loss_sum.device)
        self.records.append(StepRecord(fetched, loss_sum, norm.detach().float(), laps, applied, nonfinite,
                                       skipped_steps, lr))

    def flush(self, world_group: dist.ProcessGroup) -> list[dict[str, float | list[float]]]:
        """Reduce the window over all ranks (collective: every rank calls it on the same steps)."""
        if not self.records:
            return []
        device = self.records[0].loss_sum.device
        if device.type == "cuda":  # the laps' events must have completed before they are read
            torch.cuda.synchronize(device)
        loss_sums = torch.stack([r.loss_sum for r in self.records])
        dist.all_reduce(loss_sums, group=world_group)
        nan = float("nan")
        peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else nan
        parts = max(len(r.fetched.payload.micro_batches) for r in self.records) + 1  # + the optimizer
        timings = torch.tensor([[r.fetched.wait_s, nan if self.spare else r.laps.total(),
                                 computed_tokens(r.fetched.payload, spare=self.spare), peak,
                                 *_laps(r, parts, spare=self.spare)]
                                for r in self.records], dtype=torch.float64, device=device)
        timings = torch.cat([timings[:, :4], _flags(self.records, device), timings[:, 4:]], dim=1)
        gathered = [torch.zeros_like(timings) for _ in range(dist.get_world_size(world_group))]
        dist.all_gather(gathered, timings, group=world_group)
        # [ranks, steps, (wait, compute, computed tokens, peak, loss non-finite, applied, micro-batch laps...,
        #  optimizer lap)]
        per_rank = torch.stack(gathered).cpu()
        norms = torch.stack([r.grad_norm for r in self.records]).cpu().tolist()
        losses = loss_sums.cpu().tolist()
        metrics = [_step_metrics(r, losses[i], per_rank[:, i], norms[i]) for i, r in enumerate(self.records)]
        if device.type == "cuda":
            metrics[-1]["gpu_peak_bytes"] = int(per_rank[:, -1, 3].max())
        for step, record in zip(metrics, self.records, strict=True):
            calibration = record.fetched.calibration
            if calibration is not None and calibration["version"] > self.calibration_version:
                step["calibration"] = calibration
                self.calibration_version = calibration["version"]
        self.records = []
        return metrics


def _flags(records: list[StepRecord], device: torch.device) -> torch.Tensor:
    """[steps, 2] float64 on `device`: this rank's loss was non-finite, the step was applied (device values
    under the device step: built without reading them)."""
    rows = [torch.stack([(~torch.isfinite(r.loss_sum)).to(torch.float64),
                         torch.as_tensor(r.applied, device=device).to(torch.float64)]) for r in records]
    return torch.stack(rows)


def _laps(record: StepRecord, parts: int, *, spare: bool) -> list[float]:
    """The step's micro-batch laps padded with NaN to `parts - 1`, then its optimizer lap (NaN: a spare
    rank, whose idle micro-batches are not the plan's, or no laps taken)."""
    laps = record.laps.seconds() if not spare else []
    if len(laps) < 2:
        return [float("nan")] * parts
    micro_batches = laps[:-1] + [float("nan")] * (parts - len(laps))
    return micro_batches + [laps[-1]]


def computed_tokens(payload: RankPayload, *, spare: bool = False) -> int:
    """Tokens this rank runs through the model for `payload` (its packed streams, pads and idle tokens).

    Counted from the plans alone, as workers/batch.py lays them out: per micro-batch the rank's local
    sequences whole plus 2 chunks of padded_length(S, N) / 2N tokens of each distributed sequence; an empty
    stream becomes workers/step.py's one-token idle micro-batch. A spare rank runs only idle micro-batches.
    """
    if spare:
        return len(payload.micro_batches)
    return sum(micro_batch_tokens(payload))


def micro_batch_tokens(payload: RankPayload) -> list[int]:
    """Per micro-batch of `payload`, the tokens this rank's stream holds (computed_tokens' count)."""
    counts = []
    for micro_batch in payload.micro_batches:
        plan, cp_rank = micro_batch.plan, payload.cp_rank
        cp_size = len(plan.local)
        span = plan.chunk_on(cp_rank)  # a dependent chunk runs only its own tokens
        local = span.num_tokens if span else sum(len(micro_batch.input_ids[i]) for i in plan.local[cp_rank])
        shards = sum(padded_length(len(micro_batch.input_ids[i]), cp_size) // cp_size
                     for i in plan.distributed)
        counts.append(max(local + shards, 1))
    return counts


def _step_metrics(record: StepRecord, loss_sum: float, per_rank: torch.Tensor,
                  grad_norm: float) -> dict[str, float | list[float]]:
    payload = record.fetched.payload
    trained = ~per_rank[:, 1].isnan()  # spare ranks report NaN compute
    wait, compute = per_rank[trained, 0], per_rank[trained, 1]
    step_s = float((wait + compute).max())
    computed = float(per_rank[:, 2].sum())
    laps = per_rank[trained, 6:].nanmean(dim=0) if bool(trained.any()) else per_rank[0, 6:]
    count = len(payload.micro_batches)
    applied, nonfinite = record.applied, record.nonfinite
    if record.deferred:  # the device step's flag, the same on every rank (the norm was all-reduced)
        applied = bool(per_rank[0, 5] > 0.5)
        ranks = int(per_rank[:, 4].sum())
        nonfinite = None if applied else (f"loss (on {ranks} rank{'s' if ranks > 1 else ''})" if ranks
                                          else "gradient norm")
    return {
        "step": payload.step,
        "epoch": payload.epoch,
        "loss": loss_sum / max(payload.global_label_tokens, 1),
        "tokens": payload.global_tokens,
        "label_tokens": payload.global_label_tokens,
        "tokens_per_s": payload.global_tokens / max(step_s, 1e-9),
        "step_s": step_s,
        "predicted_step_s": payload.predicted_step_s,
        "planner_wait_s": float(wait.max()),
        "plan_ms": payload.plan_ms,
        "planner_ahead_steps": record.fetched.ahead_steps,
        "compute_imbalance": float(compute.max() / compute.mean().clamp_min(1e-9)),
        "grad_norm": grad_norm,
        "lr": record.lr,
        "micro_batches": len(payload.micro_batches),
        "samples": sum(len(ids) for ids in payload.sample_ids_by_dp_rank),
        "cursor_epoch": payload.cursor.epoch,
        "cursor_rows": payload.cursor.rows,
        "mfu": payload.flops_at_peak_s / max(step_s * int(trained.sum()), 1e-9),
        "padding_fraction": 1.0 - payload.global_tokens / max(computed, 1.0),
        "subgroup_token_fraction": payload.subgroup_token_fraction,
        "calibration_version": (record.fetched.calibration or {}).get("version", 0),
        "rank_compute_s": per_rank[:, 1].tolist(),
        "micro_batch_s": laps[:count].tolist(),
        "optimizer_s": float(laps[-1]),
        "update_skipped": not applied,
        "skipped_steps": record.skipped_steps,
    } | ({"nonfinite": nonfinite} if nonfinite else {}) | ({"deferred": True} if record.deferred else {}) | {
        f"source_tokens/{source}": tokens for source, tokens in payload.source_tokens.items()}
