"""What a run's memory settles before it starts: train.activation_checkpointing=auto (the planner's choice,
app/profiling/checkpointing.py), then scheduling.bucket_size=auto (the C the memory model leaves,
app/profiling/memory.py). `plan`, `train` and every command that takes a config resolve both here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app.config import ConfigError, SkrullConfig
from app.profiling.checkpointing import CheckpointingChoice, choose_checkpointing
from app.profiling.memory import MemoryTerms, memory_terms


@dataclass(frozen=True, slots=True)
class BucketBudget:
    """The BucketSize a run uses and where it came from."""

    tokens: int
    source: str
    """config (scheduling.bucket_size set) | memory (auto: derived here)."""
    terms: MemoryTerms | None = None
    """The terms C was derived from (source memory)."""
    checkpointing: CheckpointingChoice | None = None
    """How train.activation_checkpointing=auto was resolved (None: it was set)."""

    def line(self) -> str:
        if self.terms is None:
            return f"BucketSize C = {self.tokens:,} tokens per rank (scheduling.bucket_size)"
        return f"BucketSize C = {self.tokens:,} tokens per rank (scheduling.bucket_size=auto, modeled): " \
               f"{self.terms.line()}"


def bucket_budget(config: SkrullConfig, *, kernels: str | None = None) -> BucketBudget:
    """scheduling.bucket_size as set, or (auto) the C of memory_terms; auto with nothing left for
    activations is a ConfigError naming the knobs."""
    size = config.scheduling.bucket_size
    if size != "auto":
        return BucketBudget(tokens=int(size), source="config")
    terms = memory_terms(config, kernels=kernels)
    if terms.tokens < 1:
        raise ConfigError(
            f"scheduling.bucket_size=auto: nothing is left for activations on a rank "
            f"{terms.line()}: set train.zero_stage=3, model.lora.r, train.activation_checkpointing, more "
            "parallel.num_workers, or scheduling.bucket_size by hand")
    return BucketBudget(tokens=terms.tokens, source="memory", terms=terms)


def resolve_bucket_size(config: SkrullConfig, *,
                        kernels: str | None = None) -> tuple[SkrullConfig, BucketBudget]:
    """The config with train.activation_checkpointing a bool (auto resolved by the planner,
    app/profiling/checkpointing.py) and scheduling.bucket_size an int (auto replaced by the derived C),
    and its budget."""
    choice = None
    if config.train.activation_checkpointing == "auto":
        choice = choose_checkpointing(config, kernels=kernels)
        config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                       **choice.chosen.setting.train_values()))
    budget = dataclasses.replace(bucket_budget(config, kernels=kernels), checkpointing=choice)
    if config.scheduling.bucket_size == budget.tokens:
        return config, budget
    scheduling = dataclasses.replace(config.scheduling, bucket_size=budget.tokens)
    return dataclasses.replace(config, scheduling=scheduling), budget
