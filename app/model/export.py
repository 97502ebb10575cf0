"""`export`: a run's checkpoint as a Hugging Face model directory, or a peft adapter for a LoRA run.

    <run_dir>/skrull_config.json ─▶ SkrullConfig ─▶ ModelSpec, built with the standard "sdpa" attention
    Ray Train's newest recorded checkpoint (or --checkpoint PATH) ─▶ skrull_state.json: the DeepSpeed tag
        ─▶ deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint: the fp32 master weights,
           consolidated from every rank's ZeRO-2 partition
    full run : model.load_state_dict(strict)           ─▶ save_pretrained (safetensors, generation config)
    LoRA run : peft wrapper around the rebuilt base, adapter weights loaded (the checkpoint holds only them)
               ─▶ save_pretrained: adapter_config.json + adapter_model.safetensors (peft format)
               --merge: merge_and_unload ─▶ the merged model, as a full run's
    + the tokenizer files (app/model/export_tokenizer.py)

Written into a staging directory next to --out and renamed to --out only when complete: an error leaves
nothing behind. Every user mistake is a ConfigError naming the argument to change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.config import ConfigError, SkrullConfig, load_config
from app.rundir.files import CONFIG_SNAPSHOT

STANDARD_ATTENTION = "sdpa"
"""What the exported model runs with: transformers' own attention, so no "dacp" registration is needed."""


@dataclass(frozen=True, slots=True)
class ExportResult:
    out: str
    kind: str
    """model (a full run) | adapter (LoRA, peft format) | merged (LoRA --merge)."""
    step: int
    checkpoint: str
    dtype: str


@contextmanager
def run_checkpoint(run_dir: str, checkpoint: str = "latest") -> Iterator[tuple[SkrullConfig, Path, Any]]:
    """(config, local checkpoint directory, CheckpointState): all the reading of a run directory.

    `latest` is the newest checkpoint Ray Train's own bookkeeping recorded as complete
    (`Result.from_path`, the checkpoint manager's snapshot: one cut off mid-write is never chosen); a PATH
    is a `checkpoint_*` directory. The directory is yielded through `Checkpoint.as_directory()`, so a run
    on remote storage is fetched to local disk for the duration.
    """
    from workers.checkpoints import STATE_FILE, CheckpointState

    snapshot = Path(run_dir) / CONFIG_SNAPSHOT
    if not snapshot.is_file():
        raise ConfigError(f"{run_dir!r} is not a run directory (no {CONFIG_SNAPSHOT}); pass the "
                          "<run.storage_path>/<run.name> directory that `train` wrote")
    config = load_config(snapshot)
    if checkpoint != "latest":
        if not Path(checkpoint, STATE_FILE).is_file():
            raise ConfigError(f"--checkpoint {checkpoint!r} is not a checkpoint directory (no {STATE_FILE}); "
                              "pass a checkpoint_* directory of the run, or latest")
        yield config, Path(checkpoint), CheckpointState.read(checkpoint)
        return
    from ray.train import Result  # Train V2's (the default in Ray 2.60)

    try:
        newest = Result.from_path(str(Path(run_dir).resolve())).checkpoint
    except RuntimeError:
        newest = None
    if newest is None:
        raise ConfigError(f"run {run_dir!r} has no complete checkpoint yet; train it (train.checkpoint_every "
                          "or the end of the run writes one) or pass --checkpoint PATH")
    with newest.as_directory() as directory:
        yield config, Path(directory), CheckpointState.read(directory)


def _check_out(out: str) -> Path:
    """--out must not exist, or be an empty directory; its parent is created."""
    path = Path(out).expanduser().resolve()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"--out {out!r} exists and is not an empty directory; choose another --out")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out!r}: cannot create its parent directory ({err.strerror})") from None
    return path


def consolidate(checkpoint_dir: Path, tag: str, *, frozen_base: bool) -> dict[str, Any]:
    """fp32 weights from every rank's ZeRO partition (DeepSpeed's zero_to_fp32); LoRA: the adapter only."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag,
                                                    exclude_frozen_parameters=frozen_base)


def trained_model(config: SkrullConfig, state: dict[str, Any], *, attn: str = STANDARD_ATTENTION) -> Any:
    """The run's model rebuilt with `attn` and the checkpoint's weights; a LoRA run's as a peft PeftModel.

    A full run loads every weight strictly. A LoRA run rebuilds its base from model.name_or_path (a tiny
    preset's seeded random init, or the hub/local weights), wraps it with peft's `get_peft_model` and the
    run's LoraConfig, and loads the trained adapter weights (the checkpoint holds only them, under the
    transformers model's own parameter names); every adapter weight must come from the checkpoint.
    """
    from peft import get_peft_model

    from app.model.spec import model_spec
    from workers.models import lora_config

    spec = model_spec(config.model, config.train, tokenizer=config.data.tokenizer)
    if not spec.frozen_base:
        model = spec.build(attn)
        model.load_state_dict(state, strict=True)
        return model
    peft_config = lora_config(spec.lora_r, spec.lora_alpha, spec.lora_dropout, spec.lora_target_modules)
    peft_config.base_model_name_or_path = config.model.name_or_path
    wrapper = get_peft_model(replace(spec, lora_r=0).build(attn), peft_config)
    model = wrapper.base_model.model
    result = model.load_state_dict(state, strict=False)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = adapters & set(result.missing_keys)
    if result.unexpected_keys or missing:
        raise ConfigError(f"the checkpoint does not match model.lora (missing {sorted(missing)[:3]}, "
                          f"unexpected {result.unexpected_keys[:3]}); was {CONFIG_SNAPSHOT} edited?")
    return wrapper


def _prepare_for_inference(model: Any, dtype: str, tokenizer: Any) -> Any:
    """dtype, KV cache on, eval mode, and the tokenizer's eos/pad ids in the config and generation config."""
    from workers.models import DTYPES

    model = model.to(DTYPES[dtype]).eval()
    model.config.use_cache = True
    for target in (model.config, model.generation_config):
        if tokenizer.eos_token_id is not None:
            target.eos_token_id = tokenizer.eos_token_id
        if tokenizer.pad_token_id is not None:
            target.pad_token_id = tokenizer.pad_token_id
    return model


def _trained_template(run_dir: str, config: Any) -> str | None:
    """The template text the run recorded at its start (app/rundir/snapshot.py TEMPLATE_SNAPSHOT); a run from
    before that record resolves data.chat_template again."""
    from app.model.export_tokenizer import run_chat_template
    from app.rundir.files import TEMPLATE_SNAPSHOT
    from workers.storage import Location

    recorded = Location.of(run_dir) / TEMPLATE_SNAPSHOT
    if recorded.exists():
        return recorded.read_text()
    return run_chat_template(config.data)


def export(run_dir: str, out: str, *, checkpoint: str = "latest", dtype: str | None = None,
           merge: bool = False) -> ExportResult:
    """Write the export into `out` (see the module docstring); returns what was written."""
    from app.model.export_tokenizer import save_tokenizer
    from workers.models import DTYPES

    if dtype not in (None, "fp32", "bf16"):
        raise ConfigError(f"--dtype {dtype!r} is not one of: bf16, fp32")
    target = _check_out(out)
    with run_checkpoint(run_dir, checkpoint) as (config, directory, state):
        lora = config.model.lora.r > 0
        if merge and not lora:
            raise ConfigError("--merge applies to LoRA runs (model.lora.r > 0) only; this run trained every "
                              "weight, so drop --merge")
        weights = consolidate(directory, state.tag, frozen_base=lora)
        checkpoint_name = directory.name
    dtype = dtype or config.model.dtype
    model = trained_model(config, weights)
    kind = "merged" if merge else "adapter" if lora else "model"
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
    try:
        tokenizer = save_tokenizer(config.data.tokenizer, _trained_template(run_dir, config), staging)
        if kind == "adapter":
            model.to(DTYPES[dtype]).save_pretrained(str(staging))  # adapter_config.json + safetensors
        else:
            if kind == "merged":
                model = model.merge_and_unload()  # W + (alpha / r) * B @ A in fp32, cast afterwards
            _prepare_for_inference(model, dtype, tokenizer).save_pretrained(str(staging),
                                                                             safe_serialization=True)
        if target.exists():
            target.rmdir()  # empty (checked above)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(out=str(target), kind=kind, step=state.step, checkpoint=checkpoint_name, dtype=dtype)
