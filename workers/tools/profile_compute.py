"""Measure forward+backward time of the model on packed single-device streams (`skrull bench compute`).

Each case is a list of sequence lengths packed into one stream and run exactly as a worker runs a
micro-batch with every sequence local (DACP attention, chunked loss, backward), with no process group
(a single-rank attention runtime of the configured backend, built once for all cases): what is timed is
compute plus kernel launches, not communication. Cases differ both in tokens and in how long their
sequences are, so the fit sees the attention's S^2 term and the linear terms apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from scheduling import DacpPlan
from scheduling.payload import IGNORE_INDEX
from workers.attention.runtime import AttentionRuntime
from workers.batch import build_rank_batch
from workers.forward import micro_batch_loss_sum
from workers.step import engine_loss_sum


def compute_cases(max_tokens: int, short_len: int = 512) -> list[tuple[int, ...]]:
    """For T in max_tokens/8, /4, /2, /1: one sequence of T, 8 of T/8, and T/short_len short ones."""
    cases = []
    for divisor in (8, 4, 2, 1):
        tokens = max(16, max_tokens // divisor)
        short = min(short_len, tokens)
        for lengths in ((tokens,), (tokens // 8,) * 8, (short,) * max(1, tokens // short)):
            if lengths not in cases and min(lengths) >= 1:
                cases.append(lengths)
    return cases


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def label_tokens(lengths: Sequence[int], label_fraction: float) -> list[int]:
    """Label tokens per sequence as the loss counts them (targets shifted by one) for `label_fraction`."""
    return [max(1, round(n * label_fraction)) - 1 if n > 1 else 0 for n in lengths]


def _labels(ids: list[int], label_fraction: float) -> list[int]:
    """The last `label_fraction` of the sequence is the answer (a chat's prompt comes first)."""
    keep = max(1, round(len(ids) * label_fraction))
    return [IGNORE_INDEX] * (len(ids) - keep) + ids[len(ids) - keep:]


def time_micro_batch(model: torch.nn.Module, lengths: Sequence[int], *, repeats: int, warmup: int = 1,
                     loss_chunk_tokens: int = 4096, seed: int = 0,
                     runtime: AttentionRuntime | None = None, label_fraction: float = 1.0,
                     engine: Any = None) -> list[float]:
    """Wall seconds of `repeats` forward+backward passes over one packed stream of `lengths`.

    `runtime`: the single-rank attention runtime (None: the "auto" kernel of the model's device).
    `label_fraction`: the share of each sequence that carries labels (`label_tokens` counts them).
    `engine`: a DeepSpeed engine wrapping `model`: the backward then runs as a training micro-batch does
    (`engine.backward`, so ZeRO-2's gradient hooks and per-micro-batch reduction are timed too), inside
    one long gradient accumulation (no optimizer step).
    """
    device = model.get_input_embeddings().weight.device
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, size=n).tolist() for n in lengths]
    labels = [_labels(seq, label_fraction) for seq in ids]
    plan = DacpPlan(local=(tuple(range(len(lengths))),), distributed=())
    batch = build_rank_batch(plan, ids, labels, cp_rank=0, cp_size=1).to(device)
    times = []
    if engine is not None:
        engine.set_gradient_accumulation_boundary(False)
    for i in range(warmup + repeats):
        if engine is None:
            model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        if engine is None:
            loss = micro_batch_loss_sum(model, batch, runtime=runtime, loss_chunk_tokens=loss_chunk_tokens)
        else:  # as a training step runs it: through DeepSpeed's forward (workers/step.py)
            loss = engine_loss_sum(engine, batch, runtime=runtime, loss_chunk_tokens=loss_chunk_tokens)
        if engine is None:
            loss.backward()
        else:
            engine.backward(loss, scale_wrt_gas=False)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def measure_compute(model: torch.nn.Module, cases: Sequence[Sequence[int]], *, repeats: int,
                    loss_chunk_tokens: int = 4096, attention_backend: str = "auto") -> list[dict]:
    """Per case: lengths, tokens, median and min seconds over `repeats` (after one warm-up pass).

    `attention_backend` is `model.attention_backend`, so the profile times the kernel training runs.
    """
    device = model.get_input_embeddings().weight.device
    runtime = AttentionRuntime.create(None, device, attention_backend)
    rows = []
    for lengths in cases:
        times = time_micro_batch(model, lengths, repeats=repeats, loss_chunk_tokens=loss_chunk_tokens,
                                 runtime=runtime)
        rows.append({"lengths": list(lengths), "tokens": int(sum(lengths)),
                     "seconds_median": statistics.median(times), "seconds_min": min(times)})
    return rows
