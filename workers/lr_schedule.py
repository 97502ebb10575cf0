"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay, by optimizer step.

For step s = 1 .. T of a run of T steps, with W warmup steps and m = min_lr_ratio:

    s <= W:   lr(s) = lr * s / W                               (no warmup step trains at lr 0)
    s >  W:   p = (s - W) / (T - W)                            (in (0, 1]; 1 on the last step)
              constant   lr(s) = lr
              linear     lr(s) = lr * (m + (1 - m) * (1 - p))
              cosine     lr(s) = lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)

so linear and cosine reach lr * m exactly on the run's last step. torch's `LambdaLR` applies it (handed to
`deepspeed.initialize` as the client scheduler, so DeepSpeed steps it after each applied update and keeps
its state in every checkpoint). The schedule is a function of the global step, not of the scheduler's own
count: `position` puts it at the step a worker group starts from (a resume, on any worker count, or an
elastic restart continues the same curve) and `skip` advances it past a step whose update DeepSpeed did not
apply (it steps the scheduler only after applied updates).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

KINDS = ("constant", "linear", "cosine")


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """train.lr_scheduler, the warmup steps it resolved to, train.min_lr_ratio and the run's step count."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"train.lr_scheduler={self.kind!r} is not one of: {', '.join(KINDS)}")
        if self.total_steps < 1 or not self.warmup_steps >= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"invalid schedule {self}")

    def factor(self, step: int) -> float:
        """lr(step) / lr for the 1-based optimizer step `step` (the module docstring's formula)."""
        warmup, total = self.warmup_steps, self.total_steps
        if step <= warmup:
            return max(step, 0) / warmup
        if self.kind == "constant":
            return 1.0
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        decay = 1.0 - progress if self.kind == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def resolve_warmup(warmup_steps: int, warmup_ratio: float, total_steps: int) -> int:
    """train.warmup_steps, or train.warmup_ratio of the run's steps rounded up (as transformers does)."""
    return warmup_steps or math.ceil(warmup_ratio * total_steps)


def _lambda(schedule: LrSchedule, count: int) -> float:
    # LambdaLR's count is the number of scheduler steps taken: the next optimizer step is count + 1.
    return schedule.factor(count + 1)


def scheduler_factory(schedule: LrSchedule) -> Any:
    """For deepspeed.initialize(lr_scheduler=...): optimizer -> torch LambdaLR over `schedule`.

    The lambda is a functools.partial, whose (empty) __dict__ is all LambdaLR saves of it: a checkpoint's
    schedule never overrides the one this start of the run was configured with.
    """
    from torch.optim.lr_scheduler import LambdaLR

    return lambda optimizer: LambdaLR(optimizer, functools.partial(_lambda, schedule))


def position(scheduler: Any, steps_done: int) -> None:
    """Set the scheduler (and its optimizer's learning rates) for step steps_done + 1."""
    scheduler.last_epoch = steps_done - 1
    with warnings.catch_warnings():  # "step() before optimizer.step()": intended, no update is skipped here
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()


def skip(scheduler: Any) -> None:
    """A step whose update was not applied still counts: the next step gets the next step's rate."""
    scheduler.step()
