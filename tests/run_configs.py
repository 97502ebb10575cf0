"""Overrides shared by the tests that train through Ray."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

SMALL_VOCAB = "data.tokenizer=configs/bench/synth-bpe-773.json"
"""The benchmark's 773-word BPE vocabulary (configs/bench/) for the random-init tiny model, whose embedding
and LM head are sized by the tokenizer: with Qwen's 151,665 words they hold ~10M parameters, so every
checkpoint writes ~150 MB (weights and Adam's state) and a run directory grew to 600-900 MB; with 773 words a
step and a checkpoint take milliseconds (a 6-step DP 2 run with a checkpoint every step: 29.6 s -> 21.1 s,
2026-11-25). What these tests check (resume, faults, elasticity, object storage, eval, LoRA) does not depend
on the vocabulary; the tests of the tokenizer, the shared tiny run and export keep Qwen's."""

NO_EXPORT = "train.export_on_finish=false"
"""For runs that test something else: no end-of-run export (the driver's tokenizer conversion and config
files, ~1.5-4 s a run on 2 cores). tests/test_export.py (the shared tiny run), tests/test_lora.py,
tests/test_s3_storage.py, tests/test_elastic_cluster.py and the ZeRO-3 run of tests/test_resilience.py
keep it on."""


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


def shuffled_chats(directory: Path, n: int) -> list[str]:
    """Overrides that train on a parquet file of `n` short LMSYS-like chats, shuffled (data.shuffle=true).

    The file is `data synth`'s own output (length scale 0.1: tens to a few hundred tokens a chat, every
    row usable), so
    every epoch of a resume or elastic test visits the file's rows in a new seeded permutation
    (scheduling/order.py) while sample ids stay row positions: "each id once per epoch" and the
    uninterrupted run's losses must hold across every restart exactly as without shuffling.
    """
    from app.commands.data import synthesize

    synthesize(argparse.Namespace(dist="lmsys", n=n, out=str(directory), seed=0, length_scale=0.1,
                                  tokenizer="qwen", rows_per_file=50_000, overwrite=False))
    return ["data.source=path", f"data.path={directory / 'part-00000.parquet'}", "data.shuffle=true"]


def shuffled_step_ids(step: int, num_rows: int, batch: int, seed: int = 0) -> set[int]:
    """The sample ids a shuffled run trains in `step` (1-based) when every row is usable and `batch` divides
    `num_rows`: the next `batch` rows of its epoch's permutation, numpy's Generator seeded by [data.seed,
    epoch] (docs/design.md §10), written out here from that contract."""
    import numpy as np

    assert num_rows % batch == 0, "a batch straddling two epochs has no single epoch order"
    epoch, start = divmod((step - 1) * batch, num_rows)
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return set(order[start:start + batch].tolist())
