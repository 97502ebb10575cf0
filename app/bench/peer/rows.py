"""The global batches of a `bench peer` run: which rows step n trains, as both sides see them.

The planner actor (scheduling/actor.py) fills step n with the next `scheduling.global_batch_size` usable
rows (status ok or truncated) of the tokenized stream, in stream order when nothing is shuffled, and
names each by its stream position. `step_batches` rebuilds exactly that from the run's own tokenization
(app/data/preview.py: the same readers, template, labels and data.max_length as training), so the TRL
side trains the same token ids and labels in the same steps; the peer command also compares the sample
ids each side reports per step. Configurations whose order this cannot rebuild (a shuffled file source,
a held-out eval split) are refused, naming the knob.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.bench.driver import WARMUP_STEPS, uncounted_steps
from app.config import ConfigError, SkrullConfig, load_config
from app.data.preview import PreviewRow, preview_rows
from scheduling.payload import USABLE_STATUSES

POLICIES = ("skrull", "balanced_packed")
"""This project's side of `bench peer`: the product's policy and the strongest conventional baseline."""


@dataclass(frozen=True)
class StepBatch:
    """The rows of one global batch, in stream order; `sample_ids` are their stream positions."""

    step: int
    rows: tuple[PreviewRow, ...]
    warmup: bool = False
    """Left out of the timings, as `bench train` leaves out its uncounted steps."""

    @property
    def sample_ids(self) -> list[int]:
        return [row.index for row in self.rows]

    @property
    def tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)


def side_config(path: str, overrides: list[str]) -> SkrullConfig:
    """A side's config from the command's --config and --set, `auto` resolved as the command resolved it
    (app/profiling/budget.py: BucketSize C and checkpointing from memory; deterministic, so both sides and
    the command get the same C): the GPU configs leave both to `auto`."""
    from app.profiling.budget import resolve_bucket_size

    config, _ = resolve_bucket_size(load_config(path, overrides))
    return config


def check_peer_config(config: SkrullConfig) -> None:
    """What `bench peer` needs beyond a valid run config (ConfigError naming the knob)."""
    data = config.data
    if data.shuffle and not data.synthetic:
        raise ConfigError("data.shuffle=true: bench peer feeds TRL the rows in stream order, as the planner "
                          "visits them unshuffled; set data.shuffle=false")
    if data.eval_fraction or data.eval_path:
        raise ConfigError("data.eval_fraction / data.eval_path: bench peer trains every row of a step on "
                          "both sides; hold nothing out (data.eval_fraction=0, data.eval_path='')")
    if config.parallel.elastic:
        raise ConfigError(f"parallel.num_workers={list(config.parallel.worker_range)}: bench peer needs a "
                          "fixed worker count")


def step_batches(config: SkrullConfig, steps: int) -> list[StepBatch]:
    """The global batches `bench train` trains for `steps` counted steps: its uncounted ones first (the
    warm-up step and, with online calibration, the calibration window: app/bench/driver.py
    uncounted_steps), then the counted ones; usable rows, each used once (no second epoch)."""
    check_peer_config(config)
    size, uncounted = config.scheduling.global_batch_size, uncounted_steps(config)
    needed = (uncounted + steps) * size
    usable = usable_rows(config, needed)
    if len(usable) < needed:
        window = uncounted - WARMUP_STEPS
        uncounted_text = f"{WARMUP_STEPS} warm-up" + (f" + {window} calibration window" if window else "")
        raise ConfigError(f"--steps={steps}: {uncounted_text} + {steps} counted steps of "
                          f"scheduling.global_batch_size={size} need {needed} usable rows, the data has "
                          f"{len(usable)} (data.num_samples for the synthetic source); fewer steps or more "
                          "rows")
    return [StepBatch(step=n + 1, rows=tuple(usable[n * size:(n + 1) * size]), warmup=n < uncounted)
            for n in range(uncounted + steps)]


def usable_rows(config: SkrullConfig, needed: int) -> list[PreviewRow]:
    """The first `needed` usable rows; reads twice as many rows each time until the source runs out."""
    count = needed
    while True:
        rows, _ = preview_rows(config, count)
        usable = [row for row in rows if row.status in USABLE_STATUSES]
        if len(usable) >= needed or len(rows) < count:
            return usable[:needed]
        count *= 2
