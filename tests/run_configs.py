"""Overrides shared by the tests that train through Ray."""

from __future__ import annotations

import math

SMALL_VOCAB = "data.tokenizer=configs/bench/synth-bpe-773.json"
"""The benchmark's 773-word BPE vocabulary (configs/bench/) for the random-init tiny model, whose embedding
and LM head are sized by the tokenizer: with Qwen's 151,665 words they hold ~10M parameters, so every
checkpoint writes ~150 MB (weights and Adam's state) and a run directory grew to 600-900 MB; with 773 words a
step and a checkpoint take milliseconds (a 6-step DP 2 run with a checkpoint every step: 29.6 s -> 21.1 s,
2026-11-25). What these tests check (resume, faults, elasticity, object storage, eval, LoRA) does not depend
on the vocabulary; the tests of the tokenizer, the shared tiny run and export keep Qwen's."""


def scheduled_lrs(lr: float, warmup: int, total: int, min_ratio: float = 0.0,
                  kind: str = "cosine") -> list[float]:
    """Each step's learning rate as docs/design.md states the schedule, written out here independently of
    workers/lr_schedule.py (itself checked against transformers' schedules): linear warmup reaching `lr` on
    step `warmup`, then constant, or a half cosine to lr * min_ratio on the last step."""
    def rate(s: int) -> float:
        if s <= warmup:
            return lr * s / warmup
        if kind == "constant":
            return lr
        progress = (s - warmup) / (total - warmup)
        return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return [rate(s) for s in range(1, total + 1)]
