"""The trained weights as Hugging Face files, streamed file by file from the ZeRO state: no process ever holds
the whole model.

    export_names(model)                    the state dict's names, tied duplicates dropped (save_pretrained's)
      ─▶ huggingface_hub.split_torch_state_dict_into_shards over meta tensors of the export dtype
         (HF's file names and index; each file <= MAX_SHARD_BYTES)
    per file: source.fetch(its names)      EngineWeights: every rank gathers each weight's fp32 master
                                           (DeepSpeed's safe_get_full_fp32_param, a collective), the writer
                                           rank keeps it; CheckpointWeights: DeepSpeed's lazy zero_to_fp32
                                           assembles each from the rank files (memory-mapped)
              ─▶ cast to the export dtype ─▶ safetensors save_file ─▶ `publish` (into the target: a local
                 directory, or a run directory on an object store), deleted locally
    + model.safetensors.index.json (several files)

A LoRA run writes peft's adapter files instead (`write_adapter`: the adapters only, gathered whole, named by
peft's own get_peft_model_state_dict on a meta-device PeftModel of the run's architecture).

Every rank calls the writers alike (EngineWeights' fetch is collective); `writer` is the one rank that keeps
what it gathers and writes files. The weights are the fp32 master weights cast to the export dtype: what
DeepSpeed's zero_to_fp32 consolidation of the same step's checkpoint gives (tests/test_export.py).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

MAX_SHARD_BYTES = 4 * 10**9
"""Largest weight file: under S3's 5 GiB limit of a single-request server-side copy (publishing moves each
file on an object store) and the hub's 5 GB convention."""
EXPORT_MARKER = "skrull_export.json"
"""Written last by the weights' writer: {"files", "step"}; the driver publishes only a complete export."""

Publish = Callable[[Path], None]
"""Moves every file of a local scratch directory into the export's target (and empties it)."""


class WeightSource(Protocol):
    def fetch(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """fp32 weights of `names` (on the writer rank; None elsewhere)."""


def export_names(model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> shape of what an export holds, in state-dict order: every parameter once (a tied one under
    its first name, as transformers' save_pretrained keeps it) and the persistent buffers; with
    `trainable_only`, the parameters that train (LoRA's adapters)."""
    params = dict(model.named_parameters())
    seen: set[int] = {id(p) for p in params.values()}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in params:
            if not trainable_only or params[name].requires_grad:
                shapes[name] = tuple(getattr(params[name], "ds_shape", params[name].shape))
        elif id(tensor) not in seen and not trainable_only:  # a persistent buffer (a tied alias is skipped)
            shapes[name] = tuple(tensor.shape)
    return shapes


class EngineWeights:
    """A live DeepSpeed engine's fp32 master weights (any ZeRO stage); `fetch` is collective."""

    def __init__(self, engine: Any, writer: bool) -> None:
        self.module = engine.module
        self.writer = writer

    def fetch(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        from deepspeed.utils import safe_get_full_fp32_param

        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        out: dict[str, torch.Tensor] = {}
        for name in names:
            if name in params:
                full = safe_get_full_fp32_param(params[name])  # every rank: the gather is a collective
                if full is None:
                    raise ValueError(f"{name} has no fp32 master weight (a frozen parameter)")
            else:
                full = buffers[name]
            if self.writer:
                out[name] = full.detach().to("cpu", copy=True)
            del full
        return out if self.writer else None


class CheckpointWeights:
    """A DeepSpeed checkpoint's fp32 weights, each assembled from the rank files when asked for (DeepSpeed's
    zero_to_fp32 in lazy mode: the files memory-mapped, one weight in memory at a time)."""

    def __init__(self, checkpoint_dir: Path, tag: str, *, frozen_base: bool) -> None:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        self.lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag, lazy_mode=True,
                                                             exclude_frozen_parameters=frozen_base)

    def fetch(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [name for name in names if name not in self.lazy]
        if missing:
            raise ValueError(f"the checkpoint holds no {missing[:3]} ({len(missing)} missing)")
        return {name: self.lazy[name].contiguous() for name in names}


def write_weights(source: WeightSource, shapes: dict[str, tuple[int, ...]], publish: Publish, *,
                  dtype: torch.dtype, writer: bool) -> list[str]:
    """The weight files of `shapes` (export_names) from `source`, one at a time, each published as soon as
    it is written; returns the file names (the index included)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes.items()}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=MAX_SHARD_BYTES)
    files = list(split.filename_to_tensors)
    with tempfile.TemporaryDirectory(prefix="skrull-export-") as scratch:
        for file, names in split.filename_to_tensors.items():
            tensors = source.fetch(names)
            if not writer:
                continue
            save_file({n: t.to(dtype).contiguous() for n, t in tensors.items()}, str(Path(scratch, file)),
                      metadata={"format": "pt"})
            del tensors
            publish(Path(scratch))
        if writer and split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            Path(scratch, "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            publish(Path(scratch))
            files.append("model.safetensors.index.json")
    return files


def write_adapter(source: WeightSource, shapes: dict[str, tuple[int, ...]], peft_model: Any,
                  publish: Publish, *, dtype: torch.dtype, writer: bool) -> list[str]:
    """peft's adapter_model.safetensors + adapter_config.json of the adapters in `shapes`, named by peft's
    own conversion (`PeftModel.save_pretrained` with the gathered weights as its state dict) on
    `peft_model`, a PeftModel of the run's architecture and LoraConfig (its weights may be meta tensors)."""
    tensors = source.fetch(list(shapes))
    if not writer:
        return []
    prefix = "base_model.model."  # the PeftModel's names of the transformers model's parameters
    state = {prefix + name: tensor.to(dtype) for name, tensor in tensors.items()}
    with tempfile.TemporaryDirectory(prefix="skrull-export-") as scratch:
        peft_model.save_pretrained(scratch, state_dict=state)
        files = sorted(p.name for p in Path(scratch).iterdir())
        publish(Path(scratch))
    return files


def move_into(target: Path) -> Publish:
    """Publish into a local directory: each file renamed into `target`."""
    def publish(scratch: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        for file in _files(scratch):
            file.replace(target / file.name)
    return publish


def _files(directory: Path) -> Iterable[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())


HF_DIR = "hf"
"""<run_dir>/hf/: the run's model as a Hugging Face directory, written when the run finishes."""
HF_STAGING = ".hf-export"
"""Where the workers write the weights and the driver adds the rest, before it becomes <run_dir>/hf/."""


def location_publisher(target: Any) -> Publish:
    """Publish into a workers/storage.py Location (a local path or an object store): each file copied in
    (pyarrow, as checkpoints are), then deleted locally."""
    if target.local is not None:
        return move_into(target.local)

    def publish(scratch: Path) -> None:
        target.copy_from_local(scratch)
        for file in _files(scratch):
            file.unlink()
    return publish


def export_engine(engine: Any, spec: Any, run_dir: str, *, step: int, group: Any = None) -> None:
    """Every rank: the engine's trained weights (a LoRA run's adapter) into <run_dir>/HF_STAGING, streamed
    (write_weights / write_adapter), with EXPORT_MARKER last; world rank 0 writes. The driver adds the
    tokenizer and config files and publishes it as <run_dir>/hf/ (app/model/export.py publish_export)."""
    import torch.distributed as dist

    from workers.models import DTYPES
    from workers.storage import Location

    writer = dist.get_rank() == 0
    staging = Location.of(run_dir) / HF_STAGING
    if writer:
        staging.delete()  # an earlier, unfinished export of this run
    dist.barrier(group=group)
    publish = location_publisher(staging) if writer else _nothing
    source, dtype = EngineWeights(engine, writer), DTYPES[spec.dtype]
    if spec.frozen_base:
        shapes = export_names(engine.module, trainable_only=True)
        peft_model = spec.meta_peft_model() if writer else None
        files = write_adapter(source, shapes, peft_model, publish, dtype=dtype, writer=writer)
    else:
        files = write_weights(source, export_names(engine.module), publish, dtype=dtype, writer=writer)
    if writer:
        (staging / EXPORT_MARKER).write_text(json.dumps({"files": files, "step": step}))
    dist.barrier(group=group)


def export_complete(run_dir: str, step: int) -> bool:
    """The workers' export of `step` is in <run_dir>/HF_STAGING, whole (its marker names that step)."""
    from workers.storage import Location

    marker = Location.of(run_dir) / HF_STAGING / EXPORT_MARKER
    return marker.exists() and json.loads(marker.read_text()).get("step") == step


def _nothing(scratch: Path) -> None:
    return None
