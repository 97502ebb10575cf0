"""The learning-rate schedule (workers/lr_schedule.py) against transformers' own schedules, and its torch
LambdaLR driven the way the train loop drives it (position after a resume, skip of an unapplied update).

transformers' lambdas take the 0-based count k of finished steps and start at lr 0 (k = 0); ours gives
the 1-based step s the rate transformers gives k = s, so no step trains at lr 0 and the last step s = T
gets transformers' end value. The comparison is therefore factor(s) == transformers_lambda(s), s = 1..T.
"""

from __future__ import annotations

import pytest
import torch
from transformers import optimization

from workers.lr_schedule import LrSchedule, position, resolve_warmup, scheduler_factory, skip

LR, TOTAL = 3e-3, 20


def _hf_lambda(kind: str, warmup: int, min_ratio: float):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    if kind == "constant":
        scheduler = optimization.get_constant_schedule_with_warmup(optimizer, warmup)
    elif kind == "linear":  # polynomial decay of power 1 to lr_end: linear decay to LR * min_ratio
        scheduler = optimization.get_polynomial_decay_schedule_with_warmup(
            optimizer, warmup, TOTAL, lr_end=LR * min_ratio, power=1.0)
    else:
        scheduler = optimization.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, warmup, TOTAL, min_lr_rate=min_ratio)
    return scheduler.lr_lambdas[0]


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 5])
@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_each_step_gets_transformers_rate_for_it(kind: str, warmup: int, min_ratio: float) -> None:
    schedule = LrSchedule(kind, warmup, TOTAL, min_ratio)
    reference = _hf_lambda(kind, warmup, min_ratio)
    ours = [schedule.factor(s) for s in range(1, TOTAL + 1)]
    assert ours == pytest.approx([reference(s) for s in range(1, TOTAL + 1)], rel=1e-12, abs=1e-15)
    assert min(ours[:-1]) > 0  # not even the first step trains at lr 0 (the last does with min_ratio 0)
    if kind != "constant":
        assert ours[-1] == pytest.approx(min_ratio, abs=1e-12)  # the decay ends on the run's last step


def test_warmup_ratio_rounds_up_and_warmup_steps_wins() -> None:
    assert resolve_warmup(0, 0.1, 95) == 10 and resolve_warmup(0, 0.1, 100) == 10
    assert resolve_warmup(7, 0.0, 100) == 7 and resolve_warmup(0, 0.0, 100) == 0


def test_an_unknown_kind_names_the_knob() -> None:
    with pytest.raises(ValueError, match="train.lr_scheduler"):
        LrSchedule("step", 0, 10, 0.0)


def test_the_torch_scheduler_follows_the_global_step_through_resumes_and_skipped_updates() -> None:
    schedule = LrSchedule("cosine", 2, 6, 0.1)
    expected = [LR * schedule.factor(s) for s in range(1, 7)]

    def optimizer_and_scheduler():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
        return optimizer, scheduler_factory(schedule)(optimizer)

    optimizer, scheduler = optimizer_and_scheduler()
    seen = []
    for step in range(1, 7):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if step == 3:
            skip(scheduler)  # DeepSpeed did not apply step 3 and did not step the scheduler: we do
        else:
            scheduler.step()  # what DeepSpeed does after an applied update
    assert seen == pytest.approx(expected, rel=1e-12)
    # A new start of the run after step 4 (a fresh scheduler, or one loaded from the checkpoint's state).
    state = scheduler.state_dict()
    for load in (False, True):
        optimizer, resumed = optimizer_and_scheduler()
        if load:
            resumed.load_state_dict(state)
        position(resumed, 4)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected[4], rel=1e-12)
        resumed.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected[5], rel=1e-12)


def test_train_prints_the_step_count_it_derived_and_the_curve() -> None:
    from app.config import load_config
    from app.train.components import steps_line

    by_epochs = load_config("configs/qwen2.5-7b-gpu.yaml")  # steps 0, 2 epochs, 3% warmup, cosine to 7e-7
    assert steps_line(by_epochs, 312, 20000) == (
        "train: 312 steps (2 epoch(s) x 156 global batches of 128 rows); lr 7e-06 after 10 warmup steps, "
        "cosine decay to 7e-07 at step 312")
    fixed = load_config("configs/tiny-cpu.yaml")
    assert steps_line(fixed, 10, 320) == "train: 10 steps (train.steps=10); lr 0.003"
