"""`train.activation_checkpointing: auto`: the checkpointing setting whose modeled step is fastest with the
BucketSize C it allows (docs/memory.md).

    candidates  off, every n-th layer for n in EVERY (n < L), every layer; offloaded when
                train.activation_offload is set
    C_k         scheduling.bucket_size when set (the candidate fits if its peak there leaves the safety
                margin free), else the C its memory terms leave (app/profiling/memory.py)
    holds       C_k x N holds the run's longest sequence (data.max_length when set, else the longest of
                the sampled batches) as far as the widest candidate's C does: a smaller C would cut or drop
                sequences the others train on. Always with a set bucket_size (one C for all), and for
                policies that cut sequences themselves (chunkflow)
    step_k      the mean modeled step of scheduling.policy over the `plan` command's sampled global batches
                at C_k, with the recompute charged as compute: train_flops_factor + r x d, r = c / L the
                recomputed share of the layers, d the decoder's share of the batches' forward FLOPs (the
                LM head never recomputes); the offload's host copies are not charged
    chosen      the fastest step among the candidates that fit and hold; a tie goes to less recompute

The batches are drawn once, at the largest C that fits (sample_batches: the synthetic draw or the data
source's first rows, as `plan`), so every candidate is timed on the same sequences.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from app.config import ConfigError, SkrullConfig
from app.profiling.activation import Checkpointing
from app.profiling.memory import SAFETY_FRACTION, MemoryTerms, memory_terms
from scheduling import CostModel, SchedulingError

EVERY = (8, 6, 4, 3, 2, 1)
"""Recompute every n-th layer: the candidates besides off (n = 1: every layer)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    setting: Checkpointing
    tokens: int
    """C with this setting: scheduling.bucket_size when set, else from memory (0: nothing fits)."""
    peak_bytes: float
    """The modeled peak per rank at `tokens`."""
    fits: bool
    holds: bool = True
    """C x N holds the run's longest sequence (module docstring)."""
    modeled_step_s: float | None = None
    """Mean modeled step over the sampled batches (None: not timed, it does not fit or hold)."""

    @property
    def usable(self) -> bool:
        return self.fits and self.holds and self.modeled_step_s is not None

    def as_json(self) -> dict[str, object]:
        return {"setting": self.setting.name, "every": self.setting.every, "offload": self.setting.offload,
                "tokens": self.tokens, "peak_bytes": self.peak_bytes, "fits": self.fits, "holds": self.holds,
                "modeled_step_s": self.modeled_step_s}


@dataclass(frozen=True, slots=True)
class CheckpointingChoice:
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    source: str
    """auto (chosen here) | config (train.activation_checkpointing set: the configured setting)."""

    def as_json(self) -> dict[str, object]:
        return {"setting": self.chosen.setting.name, "source": self.source, "tokens": self.chosen.tokens,
                "modeled_step_s": self.chosen.modeled_step_s,
                "candidates": [c.as_json() for c in self.candidates]}

    def line(self) -> str:
        """The choice and its alternatives in one line (what `train` says once)."""
        def step(c: Candidate) -> str:
            if not c.fits:
                return "does not fit"
            if not c.holds:
                return f"C = {c.tokens:,} cannot hold the longest sequence"
            return f"C = {c.tokens:,}, {c.modeled_step_s:.4f} s"
        others = "; ".join(f"{c.setting.name}: {step(c)}" for c in self.candidates if c is not self.chosen)
        return (f"activation checkpointing = {self.chosen.setting.name} (train.activation_checkpointing="
                f"{self.source}, modeled): {step(self.chosen)} per step" + (f" (other settings: {others})"
                                                                             if others else ""))


def candidate_settings(config: SkrullConfig, layers: int) -> tuple[Checkpointing, ...]:
    """Off and every n-th layer (EVERY, n < L, and every layer), offloaded with train.activation_offload."""
    offload = config.train.activation_offload
    every = [n for n in EVERY if n < layers or n == 1]
    return (Checkpointing(0), *(Checkpointing(n, offload) for n in every))


def with_setting(config: SkrullConfig, setting: Checkpointing, bucket: int | None = None) -> SkrullConfig:
    """`config` with the setting's train keys (and scheduling.bucket_size = `bucket` when given)."""
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, **setting.train_values()))
    if bucket is None:
        return config
    return dataclasses.replace(config, scheduling=dataclasses.replace(config.scheduling, bucket_size=bucket))


def _memory(config: SkrullConfig, setting: Checkpointing,
            kernels: str | None) -> tuple[MemoryTerms, int, bool]:
    terms = memory_terms(with_setting(config, setting), kernels=kernels, checkpointing=setting)
    size = config.scheduling.bucket_size
    if size == "auto":
        return terms, terms.tokens, terms.tokens >= 1
    return terms, int(size), terms.fits


def recompute_cost(cost: CostModel, setting: Checkpointing, batches: list[np.ndarray]) -> CostModel:
    """`cost` with the recomputed layers' forward charged as compute (module docstring: r x d)."""
    recomputed = setting.recomputed_layers(cost.num_layers) / cost.num_layers
    if not recomputed:
        return cost
    lengths = np.concatenate(batches).astype(np.float64)
    terms = cost.flop_terms(lengths)
    decoder = float(np.sum(terms["linear"] + terms["attention"]))
    share = decoder / max(decoder + float(np.sum(terms["lm_head"])), 1.0)
    factor = cost.profile.train_flops_factor + recomputed * share
    return dataclasses.replace(cost, profile=dataclasses.replace(cost.profile, train_flops_factor=factor))


def _longest_needed(config: SkrullConfig, batches: list[np.ndarray]) -> int:
    """Tokens per rank the run's longest sequence needs on its CP group (0: the policy cuts sequences)."""
    from scheduling.policies import ANY_LENGTH

    if config.scheduling.policy in ANY_LENGTH:
        return 0
    longest = config.data.max_length or max(int(b.max()) for b in batches)
    return math.ceil(longest / config.parallel.cp_size)


def _modeled_step(config: SkrullConfig, setting: Checkpointing, batches: list[np.ndarray]) -> float | None:
    """Mean modeled step of scheduling.policy over `batches` (None: the policy cannot plan them)."""
    from app.profiling.hardware import cost_model
    from app.profiling.plan_report import run_policies

    policy = config.scheduling.policy
    cost = recompute_cost(cost_model(config), setting, batches)
    try:
        run = run_policies(config, cost, batches, (policy,))[policy]
    except SchedulingError:
        return None
    return run.total_s / len(run.estimates)


def evaluate_candidates(config: SkrullConfig, *, kernels: str | None = None) -> list[Candidate]:
    """Every candidate's C, peak and fit, then the modeled step of those that fit and hold."""
    from app.profiling.activation import model_shape
    from app.profiling.plan_report import sample_batches

    settings = candidate_settings(config, model_shape(config).layers)
    sized = [(s, *_memory(config, s, kernels)) for s in settings]
    fitting = [(s, tokens) for s, _, tokens, fits in sized if fits]
    if not fitting:
        return [Candidate(s, tokens, terms.peak_bytes, fits) for s, terms, tokens, fits in sized]
    widest = max(tokens for _, tokens in fitting)
    batches, _ = sample_batches(with_setting(config, fitting[0][0], widest))
    needed = min(_longest_needed(config, batches), widest)  # no candidate may cut more than the widest
    out = []
    for s, terms, tokens, fits in sized:
        holds = tokens >= needed
        step = _modeled_step(with_setting(config, s, tokens), s, batches) if fits and holds else None
        out.append(Candidate(s, tokens, terms.peak_bytes, fits, holds, step))
    return out


def choose_checkpointing(config: SkrullConfig, *, kernels: str | None = None) -> CheckpointingChoice:
    """The module docstring's choice; none usable is a ConfigError naming the knobs."""
    candidates = evaluate_candidates(config, kernels=kernels)
    usable = [c for c in candidates if c.usable]
    if not usable:
        reasons = "; ".join(f"{c.setting.name}: " + (f"C = {c.tokens:,}" if c.fits else "does not fit")
                            for c in candidates)
        raise ConfigError(
            f"train.activation_checkpointing=auto: no checkpointing setting fits the device with its "
            f"{SAFETY_FRACTION:.0%} headroom and holds the longest sequence ({reasons}): set "
            "train.zero_stage=3, model.lora.r, more parallel.num_workers, a smaller scheduling.bucket_size "
            "or data.max_length, or train.activation_offload=true")
    # a tie (equal to the nanosecond) goes to less recompute: off, then the largest n
    chosen = min(usable, key=lambda c: (round(c.modeled_step_s, 9),
                                        1 / c.setting.every if c.setting.every else 0))
    return CheckpointingChoice(chosen=chosen, candidates=tuple(candidates), source="auto")


def format_candidates(choice: CheckpointingChoice) -> str:
    """The candidates as a table (`plan`): C, peak per rank and modeled step of each, the choice marked."""
    rows = [("setting", "C tokens", "peak GB", "fits", "modeled step s", "")]
    for c in choice.candidates:
        step = "-" if c.modeled_step_s is None else f"{c.modeled_step_s:.4f}"
        fits = "yes" if c.fits and c.holds else ("no" if not c.fits else "cuts sequences")
        rows.append((c.setting.name, f"{c.tokens:,}", f"{c.peak_bytes / 1e9:.1f}", fits, step,
                     "<- chosen" if c is choice.chosen else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                             strict=True)))
             .rstrip() for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
