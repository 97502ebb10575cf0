"""A saved checkpoint's fp32 weights, whichever DeepSpeed optimizer wrote it (what `export` reads).

    checkpoint_weights(checkpoint_dir, tag)
      optimizer files that record a ZeRO stage (ZeRO-1/2/3 optimizers)
          -> workers/hf_export.py CheckpointWeights: DeepSpeed's zero_to_fp32, lazy (memory-mapped files)
      DeepSpeed's BF16_Optimizer's files (ZeRO-1 with bf16 weights: what one worker writes, workers/engine.py
      for_world_size), which zero_to_fp32 refuses ("is not a zero checkpoint")
          -> DeepSpeed's universal converter (workers/checkpoints.py converting_to_universal) into a
             temporary directory -> UniversalWeights: one file per parameter, <dir>/zero/<name>/fp32.pt,
             read when asked for; buffers from the checkpoint's module state

The conversion writes the fp32 weights and both Adam moments (12 bytes per trained parameter) to the
temporary directory and removes it when the body ends.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

MODEL_STATES = "mp_rank_00_model_states.pt"
"""The module's state (bf16 weights and buffers) and its names, in a ZeRO-1/2 checkpoint's tag directory."""


def zero_to_fp32_reads(checkpoint_dir: Path, tag: str) -> bool:
    """Whether DeepSpeed's zero_to_fp32 reads this checkpoint: its optimizer files record a ZeRO stage
    (BF16_Optimizer's do not). A checkpoint without optimizer files is left to zero_to_fp32's own error."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE

    files = sorted(Path(checkpoint_dir, tag).glob("*_optim_states.pt"))
    if not files:
        return True
    state = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
    return ZERO_STAGE in state[OPTIMIZER_STATE_DICT]


class UniversalWeights:
    """A universal checkpoint's fp32 weights (`universal` = <out>/<tag>_universal) and the buffers of the
    checkpoint it came from (`tag_dir`)."""

    def __init__(self, universal: Path, tag_dir: Path) -> None:
        self.params = universal / "zero"
        states = torch.load(tag_dir / MODEL_STATES, map_location="cpu", mmap=True, weights_only=False)
        self.buffers = {name: states["module"][name] for name in states.get("buffer_names") or []}

    def names(self) -> list[str]:
        """The trained parameters' names (the converter writes the optimizer's parameters only)."""
        return sorted(p.name for p in self.params.iterdir() if (p / "fp32.pt").is_file())

    def fetch(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.buffers and not (self.params / n / "fp32.pt").is_file()]
        if missing:
            raise ValueError(f"the checkpoint holds no {missing[:3]} ({len(missing)} missing)")
        return {name: self._read(name) for name in names}

    def _read(self, name: str) -> torch.Tensor:
        if name in self.buffers:
            return self.buffers[name].float()
        return torch.load(self.params / name / "fp32.pt", map_location="cpu", weights_only=False)["param"]


@contextmanager
def checkpoint_weights(checkpoint_dir: Path, tag: str, *, frozen_base: bool) -> Iterator[Any]:
    """The weight source of `checkpoint_dir/<tag>` (module docstring); `frozen_base`: a LoRA run's, whose
    checkpoint's frozen base is left out."""
    from workers.checkpoints import CheckpointState, converting_to_universal
    from workers.hf_export import CheckpointWeights

    if zero_to_fp32_reads(checkpoint_dir, tag):
        yield CheckpointWeights(checkpoint_dir, tag, frozen_base=frozen_base)
        return
    with tempfile.TemporaryDirectory(prefix="skrull-export-universal-") as scratch:
        with converting_to_universal(checkpoint_dir, CheckpointState.read(checkpoint_dir), Path(scratch)):
            pass
        yield UniversalWeights(Path(scratch, f"{tag}_universal"), Path(checkpoint_dir, tag))
