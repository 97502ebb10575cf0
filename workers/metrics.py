"""Per-step training metrics, kept on the device and reduced across ranks only on log steps.

Each step adds one record: host facts of the payload (tokens, plan time, cursor, ...) and this rank's
device tensors (CE sum, gradient norm) plus its timings. `flush` runs one all_reduce (CE sums) and one
all_gather (timings) over the world group for the whole window of `train.log_every` steps, so a step
between two log steps never waits on a collective or a device-to-host copy for metrics.

    per step of the window:
      loss              sum over ranks of CE sums / global label tokens
      step_s            max over ranks of (planner wait + compute)     (the step takes its slowest rank)
      compute_imbalance max / mean over ranks of compute time
      planner_wait_s    max over ranks of planner wait
      tokens_per_s      global tokens / step_s
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from scheduling.actor import Fetched


@dataclass(frozen=True, slots=True)
class StepRecord:
    fetched: Fetched
    loss_sum: torch.Tensor
    grad_norm: torch.Tensor
    compute_s: float


@dataclass
class MetricsWindow:
    """The steps since the last flush; `flush` reduces them and returns one metrics dict per step."""

    records: list[StepRecord] = field(default_factory=list)
    spare: bool = False
    """A spare rank (workers/distributed.py): its compute time is left out of step time and imbalance."""

    def add(self, fetched: Fetched, loss_sum: torch.Tensor, grad_norm: object, compute_s: float) -> None:
        norm = torch.as_tensor(float("nan") if grad_norm is None else grad_norm, device=loss_sum.device)
        self.records.append(StepRecord(fetched, loss_sum, norm.detach().float(), compute_s))

    def flush(self, world_group: dist.ProcessGroup) -> list[dict[str, float]]:
        """Reduce the window over all ranks (collective: every rank calls it on the same steps)."""
        if not self.records:
            return []
        device = self.records[0].loss_sum.device
        loss_sums = torch.stack([r.loss_sum for r in self.records])
        dist.all_reduce(loss_sums, group=world_group)
        nan = float("nan")
        timings = torch.tensor([[r.fetched.wait_s, nan if self.spare else r.compute_s] for r in self.records],
                               dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(timings) for _ in range(dist.get_world_size(world_group))]
        dist.all_gather(gathered, timings, group=world_group)
        per_rank = torch.stack(gathered).cpu()  # [ranks, steps, (wait, compute)]
        norms = torch.stack([r.grad_norm for r in self.records]).cpu().tolist()
        losses = loss_sums.cpu().tolist()
        metrics = [_step_metrics(r, losses[i], per_rank[:, i], norms[i]) for i, r in enumerate(self.records)]
        self.records = []
        return metrics


def _step_metrics(record: StepRecord, loss_sum: float, wait_compute: torch.Tensor,
                  grad_norm: float) -> dict[str, float]:
    payload = record.fetched.payload
    trained = ~wait_compute[:, 1].isnan()  # spare ranks report NaN compute
    wait, compute = wait_compute[trained, 0], wait_compute[trained, 1]
    step_s = float((wait + compute).max())
    return {
        "step": payload.step,
        "epoch": payload.epoch,
        "loss": loss_sum / max(payload.global_label_tokens, 1),
        "tokens": payload.global_tokens,
        "label_tokens": payload.global_label_tokens,
        "tokens_per_s": payload.global_tokens / max(step_s, 1e-9),
        "step_s": step_s,
        "planner_wait_s": float(wait.max()),
        "plan_ms": payload.plan_ms,
        "planner_ahead_steps": record.fetched.ahead_steps,
        "compute_imbalance": float(compute.max() / compute.mean().clamp_min(1e-9)),
        "grad_norm": grad_norm,
        "micro_batches": len(payload.micro_batches),
        "samples": sum(len(ids) for ids in payload.sample_ids_by_dp_rank),
        "cursor_epoch": payload.cursor.epoch,
        "cursor_rows": payload.cursor.rows,
    }
