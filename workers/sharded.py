"""ZeRO-3 models built partitioned: no rank ever holds more than its partition plus the module being built.

    with zero3_construction(ds_config, group):      DeepSpeed's zero.Init: every module's parameters are
        model = from_config(config)                 partitioned over the ranks as soon as the module exists
                                                    (transformers' no_init_weights: no init work meanwhile)
    random weights: initialize_partitioned(model)   transformers' ZeRO-3 init: module by module, gathered,
                                                    initialized on rank 0 from the seeded generator,
                                                    re-partitioned; the same weights as the unpartitioned
                                                    build (workers/models.py `_random_model`)
    checkpoint:     load_partitions(model, files)   every rank reads, file by file, only the rows of each
                                                    weight that hold its own partition, and copies them in

Why not transformers' `from_pretrained` under HfDeepSpeedConfig (its ZeRO-3 integration): in transformers
5.24 it loads every shard file into one state dict on rank 0 before copying any (the whole checkpoint in one
process: 145 GB for a 72B model in bf16) and sends every weight through a gather and a broadcast. Here each
byte of the checkpoint is read once in the whole run, by the rank that keeps it, and nothing is sent. It
stays the fallback for checkpoints this loader does not map 1:1 (no safetensors, renamed or fused keys,
shapes that differ: `plan_load`).

The partition layout is DeepSpeed stage 3's (deepspeed/runtime/zero/partition_parameters.py
`_partition_param`): a parameter of n elements, flattened and padded to a multiple of the partition group's
size W, is cut into W equal runs; rank r holds elements [r * ceil(n / W), (r + 1) * ceil(n / W)) and zeros
past n. tests/test_sharded_load.py checks the loaded weights against `from_pretrained`'s bit for bit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


@contextmanager
def zero3_construction(ds_config: dict[str, Any], group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Modules built inside are partitioned over `group` (default: the world) as they are constructed, in
    ds_config's dtype, on this rank's accelerator device; torch's and transformers' weight init are
    skipped (the caller initializes or loads). transformers' `prevent_arange_dtype_change` keeps RoPE's
    integer positions integer (zero.Init casts every float constructor to the training dtype)."""
    from transformers import initialization
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    from workers.deepspeed_import import import_deepspeed

    deepspeed = import_deepspeed()
    with initialization.no_init_weights(), prevent_arange_dtype_change(), \
            deepspeed.zero.Init(config_dict_or_path=dict(ds_config), data_parallel_group=group):
        yield


def initialize_partitioned(model: torch.nn.Module) -> None:
    """Random weights for a model built by zero3_construction (transformers' initialize_weights_zero3: the
    same modules, order and generator as `PreTrainedModel.init_weights`, on rank 0), then tied."""
    from transformers.integrations.deepspeed import initialize_weights_zero3

    initialize_weights_zero3(model)
    model.tie_weights()


def checkpoint_files(directory: Path) -> list[Path] | None:
    """The safetensors files of a model directory (the index's shards in order, or the single file); None
    when it has none (a .bin checkpoint)."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"].values()
        return [directory / name for name in dict.fromkeys(sorted(names))]
    single = directory / SAFETENSORS_SINGLE
    return [single] if single.is_file() else None


def model_directory(name_or_path: str) -> Path:
    """A local model directory, or a hub id's snapshot in the local cache (downloaded when missing, as
    `from_pretrained` would: weights and configs only; HF_HUB_OFFLINE honoured)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"]))


def checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the files' headers (nothing else is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for key in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[key] = tuple(reader.get_slice(key).get_shape())
    return shapes


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Whether load_partitions can fill a model from these files, and why not."""

    files: list[Path] | None
    problem: str | None = None


def plan_load(config: Any, directory: Path) -> LoadPlan:
    """Check, on a meta-device build of `config` (no memory), that the checkpoint holds every parameter
    under its own name and shape; transformers' loader does more (renames, fused experts, .bin files)."""
    from transformers import AutoModelForCausalLM

    files = checkpoint_files(directory)
    if files is None:
        return LoadPlan(None, "no safetensors files")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    if getattr(meta, "_keep_in_fp32_modules", None):
        return LoadPlan(files, f"{type(meta).__name__} keeps modules in fp32 (_keep_in_fp32_modules)")
    stored = checkpoint_shapes(files)
    for name, param in meta.named_parameters():
        if name not in stored:
            return LoadPlan(files, f"parameter {name} is not in the checkpoint under that name")
        if stored[name] != tuple(param.shape):
            return LoadPlan(files, f"{name} has shape {stored[name]} in the checkpoint, {tuple(param.shape)} "
                                   "in the model")
    return LoadPlan(files)


def partition_range(param: torch.nn.Parameter) -> tuple[int, int]:
    """[start, end) of the flattened parameter that this rank's partition holds (module docstring)."""
    size = param.ds_tensor.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    return min(start, param.ds_numel), min(start + size, param.ds_numel)


def copy_partition(reader: Any, key: str, param: torch.nn.Parameter) -> int:
    """Read the rows of tensor `key` that cover this rank's partition of `param` and copy them in (cast to
    the parameter's dtype); returns the elements copied."""
    if getattr(param, "ds_secondary_tensor", None) is not None:
        # The product's DeepSpeed JSON (app/model/deepspeed_config.py) never asks for ZeRO++'s hierarchical
        # partitions; a hand-made JSON that does is refused rather than loaded into half its copies.
        raise ValueError("ZeRO++ secondary partitions (zero_hpz_partition_size) cannot be loaded shard by "
                         "shard: remove zero_hpz_partition_size from the DeepSpeed config")
    start, end = partition_range(param)
    partition = param.ds_tensor.data
    partition[end - start:].zero_()
    if end <= start:
        return 0
    view = reader.get_slice(key)
    shape = view.get_shape()
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    first, last = start // row, (end - 1) // row + 1
    rows = view[first:last] if shape else reader.get_tensor(key)
    partition[:end - start].copy_(rows.reshape(-1)[start - first * row:end - first * row])
    return end - start


def load_partitions(model: torch.nn.Module, files: list[Path]) -> int:
    """Fill every partitioned parameter of `model` from the checkpoint files, one file open at a time;
    returns the elements this rank copied. Names are the model's own (tied parameters under any of
    theirs); a parameter the files do not hold is a ValueError (plan_load checks that first)."""
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[int] = set()
    copied = 0
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for key in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                param = params.get(key)
                if param is None or id(param) in loaded:
                    continue
                copied += copy_partition(reader, key, param)
                loaded.add(id(param))
    missing = [name for name, p in params.items() if id(p) not in loaded]
    if missing:
        raise ValueError(f"the checkpoint has no weights for {missing[:3]} ({len(missing)} in all)")
    return copied


def pretrained_partitioned(name_or_path: str, *, attn: str, dtype: torch.dtype, ds_config: dict[str, Any],
                           group: dist.ProcessGroup | None = None) -> torch.nn.Module:
    """model.name_or_path's weights in a model built partitioned (zero3_construction + load_partitions), or
    through transformers' own ZeRO-3 loading where plan_load says this loader cannot map the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = model_directory(name_or_path)
    config = AutoConfig.from_pretrained(str(directory))
    plan = plan_load(config, directory)
    if plan.problem is not None:
        _say(f"model.name_or_path={name_or_path!r}: {plan.problem}: loaded by transformers' ZeRO-3 "
             "from_pretrained instead (rank 0 reads the whole checkpoint)")
        return _transformers_zero3(str(directory), attn=attn, dtype=dtype, ds_config=ds_config)
    with zero3_construction(ds_config, group):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    model.tie_weights()
    load_partitions(model, plan.files)
    return model


def _transformers_zero3(path: str, *, attn: str, dtype: torch.dtype, ds_config: dict[str, Any]) -> Any:
    """transformers' from_pretrained with its DeepSpeed integration on for the call (HfDeepSpeedConfig)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(dict(ds_config))  # transformers holds a weak reference: kept alive here
    try:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype)
    finally:
        del keep
        unset_hf_deepspeed_config()


def _say(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[skrull] {line}", flush=True)
