"""The non-finite guard: a step whose loss or gradient norm is inf/NaN on any rank never updates the model.

How a bad step is kept out of the weights, without a host sync on a good step:

1. `nan_if_nonfinite(micro_loss)`: each micro-batch back-propagates `loss * scale * f`, where f is 1 when the
   micro-batch's loss is finite and NaN when it is not (a device-side `where`, one scalar op per micro-batch).
   A non-finite loss therefore always makes this rank's gradient NaN, even where autograd alone would have
   produced a finite one (an infinite CE of a finite logit row).
2. `engine.step()`: DeepSpeed's ZeRO 1/2 optimizer computes the global gradient norm (all-reduced over all
   ranks) and, when it is not finite, takes its overflow path (the one fp16 loss scaling uses): no optimizer
   step, no LR-schedule step, gradients dropped, `engine.was_step_applied()` False. For fp32 that check is
   unconditional; for bf16 it is `bf16.check_grad_overflow` (default true in DeepSpeed 0.19). ZeRO stage 0
   has no such check, which is why app/config.py refuses train.zero_stage=0.
3. `NonFiniteGuard.after_step`: reads `engine.was_step_applied()`, a host bool DeepSpeed already synced to
   decide the overflow; every rank sees the same value (the norm was all-reduced), so the rare bad path can
   run one more collective (which ranks' losses were non-finite, for the message) and every rank takes it.
   A good step costs nothing beyond DeepSpeed's own norm check: no collective and no host read of ours.
   With train.optimizer_impl=fused the step runs on the device (workers/zero_step.py): step 2 is a
   device-side skip (torch's fused AdamW with found_inf) and the flag stays on the device; the metrics
   window brings every step's flag and each rank's loss finiteness to the host on the next log step, and
   `NonFiniteGuard.review` judges those steps there, in order. The steps after a bad one have trained by
   then (their updates are sound: only the bad step was skipped); a stop reports them and writes no
   checkpoint, so the newest checkpoint is still the last one before the divergence.

Policies (train.nonfinite): `error` stops the run at the bad step (world rank 0 reports the step's metrics
with a "stopped" message and every rank returns; app/train/failures.py turns it into exit 1 with that message,
and Ray Train's FailureConfig never sees an error, so it never restarts into the same divergence); `skip`
counts the step, warns, and stops the same way once train.max_skipped_steps steps in a row were skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

KNOBS = ("train.lr", "train.grad_clip", "model.dtype")


@dataclass(frozen=True, slots=True)
class NonFinitePolicy:
    """train.nonfinite and train.max_skipped_steps, as the driver hands them to the workers."""

    action: str = "error"
    """"error": stop at a non-finite step; "skip": drop its update and go on."""
    max_skipped_steps: int = 3


def nan_if_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """1 where `loss` is finite, NaN where it is not, in loss's dtype (a factor for the backward's loss: an
    exact 1 changes nothing; no host sync)."""
    loss = loss.detach()
    one = torch.ones_like(loss)
    return torch.where(torch.isfinite(loss), one, torch.full_like(loss, math.nan))


def knob_values(deepspeed: dict[str, Any]) -> str:
    """The values of the knobs a divergence is fixed with, read back from the generated DeepSpeed JSON."""
    lr = deepspeed.get("optimizer", {}).get("params", {}).get("lr")
    dtype = "bf16" if deepspeed.get("bf16", {}).get("enabled") else "fp32"
    clip = deepspeed.get("gradient_clipping", 0.0)
    return f"train.lr={lr:g}, train.grad_clip={clip:g}, model.dtype={dtype}"


@dataclass
class NonFiniteGuard:
    """Decides, after each step, whether the run goes on; counts skipped steps."""

    policy: NonFinitePolicy
    knobs: str
    """knob_values(...) of this run, quoted in the stop message."""
    skipped_in_a_row: int = 0
    skipped: int = 0
    last_checkpoint_step: int = 0
    """The newest checkpoint written (or resumed from): the message says it stays the newest."""

    stop: str | None = None
    """Set by after_step when the run must stop at the step that just ran: the one-line reason."""

    def after_step(self, step: int, applied: bool, loss_sum: torch.Tensor,
                   world_group: dist.ProcessGroup) -> str | None:
        """What was non-finite in the step that just ran (None: it was applied); sets `stop` when the run
        must stop there. Collective only when the step was not applied, which every rank sees alike."""
        if applied:
            self.skipped_in_a_row = 0
            return None
        what = _what_was_nonfinite(loss_sum, world_group)
        self.judge(step, what)
        return what

    def judge(self, step: int, what: str) -> None:
        """Count a step that was not applied (`what` was non-finite); sets `stop` when the run must stop."""
        self.skipped += 1
        self.skipped_in_a_row += 1
        if self.stop is None and (self.policy.action != "skip"
                                  or self.skipped_in_a_row > self.policy.max_skipped_steps):
            self.stop = self.stop_message(step, what)

    def review(self, metrics: list[dict[str, Any]]) -> list[str]:
        """Judge a flushed window's deferred steps (the device step, workers/zero_step.py: whether a step was
        applied is known on log steps only) in order; fills their `nonfinite` and `skipped_steps` and returns
        the warnings to print. Steps judged when they ran (DeepSpeed's host-known flag) are left as they are.
        """
        warnings = []
        for entry in metrics:
            if not entry.pop("deferred", False):
                continue
            if not entry["update_skipped"]:
                self.skipped_in_a_row = 0
            else:
                what = entry["nonfinite"]
                self.judge(entry["step"], what)
                if self.stop is None:
                    warnings.append(self.warning(entry["step"], what))
            entry["skipped_steps"] = self.skipped
        return warnings

    def stop_message(self, step: int, what: str) -> str:
        newest = (f"the newest checkpoint (step {self.last_checkpoint_step}) stays the newest"
                  if self.last_checkpoint_step else "no checkpoint was written")
        if self.policy.action == "skip":
            cause = (f"step {step}: {self.skipped_in_a_row} steps in a row had a non-finite {what} "
                     f"(train.max_skipped_steps={self.policy.max_skipped_steps})")
        else:
            cause = f"step {step}: the {what} was non-finite (inf/NaN)"
        return (f"{cause}; its update was not applied and {newest}. The run diverged: lower train.lr, "
                f"set or lower train.grad_clip, or train in model.dtype=fp32 (now {self.knobs}); "
                "train.nonfinite=skip drops such steps instead")

    def warning(self, step: int, what: str) -> str:
        return (f"[skrull] warning: step {step}: non-finite {what}, update skipped ({self.skipped_in_a_row} "
                f"in a row, train.max_skipped_steps={self.policy.max_skipped_steps}; {self.skipped} in all)")


def _what_was_nonfinite(loss_sum: torch.Tensor, world_group: dist.ProcessGroup) -> str:
    """"loss" when any rank's loss was inf/NaN (its gradient then was too), else "gradient norm"."""
    bad = (~torch.isfinite(loss_sum.detach().float())).to(torch.float32).reshape(1)
    dist.all_reduce(bad, group=world_group)
    ranks = int(bad.item())
    return f"loss (on {ranks} rank{'s' if ranks > 1 else ''})" if ranks else "gradient norm"
