"""`export`: a run's checkpoint as a Hugging Face model directory, or a peft adapter for a LoRA run; and
the end of a run's own export (train.export_on_finish: <run_dir>/hf/, `publish_export`).

    <run_dir>/skrull_config.json ─▶ SkrullConfig ─▶ ModelSpec (the architecture on the meta device: no memory)
    Ray Train's newest recorded checkpoint (or --checkpoint PATH) ─▶ skrull_state.json: the DeepSpeed tag
    full run : the weights streamed file by file (workers/hf_export.py write_weights over
               workers/checkpoint_weights.py: DeepSpeed's zero_to_fp32 in lazy mode, or its universal
               converter for a one-worker bf16 run's BF16_Optimizer checkpoint) ─▶ model-*.safetensors
               (+ index), cast to the dtype
               + config.json and generation_config.json of the architecture (`save_model_config`)
    LoRA run : the adapter weights (the checkpoint holds only them) ─▶ peft's adapter_config.json +
               adapter_model.safetensors (write_adapter, named by peft's own conversion)
               --merge: the base rebuilt whole with the adapter loaded, peft's merge_and_unload,
               save_pretrained (this one holds the whole model in one process)
    + the tokenizer files (app/model/export_tokenizer.py)

Streaming: each weight file is gathered, written and published before the next, so the exporting process
holds one file's weights (<= 4 GB) at a time; a ZeRO-3 checkpoint is read weight by weight from its
memory-mapped rank files. DeepSpeed's zero_to_fp32 concatenates a ZeRO-2 checkpoint's rank partitions into
one fp32 vector first (its own "memory usage doubles here" note), so exporting a ZeRO-2 checkpoint holds its
fp32 weights once; the end-of-run export (the workers' live ZeRO state, any stage) never does.

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
    """(config, local checkpoint directory, CheckpointState): all the reading of a run directory, local or
    on an object store (workers/storage.py Location).

    `latest` is the newest checkpoint Ray Train's own bookkeeping recorded as complete
    (`Result.from_path`, the checkpoint manager's snapshot: one cut off mid-write is never chosen); a PATH
    is a `checkpoint_*` directory. A checkpoint on an object store is copied to a temporary local directory
    for the duration (`Checkpoint.as_directory()` for `latest`).
    """
    from workers.checkpoints import STATE_FILE, CheckpointState
    from workers.storage import Location

    run = Location.of(run_dir)
    if not (run / CONFIG_SNAPSHOT).is_file():
        raise ConfigError(f"{run_dir!r} is not a run directory (no {CONFIG_SNAPSHOT}); pass the "
                          "<run.storage_path>/<run.name> directory that `train` wrote")
    config = _snapshot_config(run / CONFIG_SNAPSHOT)
    if checkpoint != "latest":
        chosen = Location.of(checkpoint)
        if not (chosen / STATE_FILE).is_file():
            raise ConfigError(f"--checkpoint {checkpoint!r} is not a checkpoint directory (no {STATE_FILE}); "
                              "pass a checkpoint_* directory of the run, or latest")
        with _local_copy(chosen) as directory:
            yield config, directory, CheckpointState.read(directory)
        return
    from ray.train import Result  # Train V2's (the default in Ray 2.60)

    local = run.local
    try:
        newest = (Result.from_path(str(local.resolve())) if local is not None
                  else Result.from_path(run.path, storage_filesystem=run.filesystem)).checkpoint
    except RuntimeError:
        newest = None
    if newest is None:
        raise ConfigError(f"run {run_dir!r} has no complete checkpoint yet; train it (train.checkpoint_every "
                          "or the end of the run writes one) or pass --checkpoint PATH")
    with newest.as_directory() as directory:
        yield config, Path(directory), CheckpointState.read(directory)


def _snapshot_config(snapshot: Any) -> SkrullConfig:
    """The run's recorded config (a Location): loaded where it is, or from a local copy of its text."""
    if snapshot.local is not None:
        return load_config(snapshot.local)
    with tempfile.TemporaryDirectory(prefix="skrull-export-") as scratch:
        local = Path(scratch, CONFIG_SNAPSHOT)
        local.write_text(snapshot.read_text())
        return load_config(local)


@contextmanager
def _local_copy(directory: Any) -> Iterator[Path]:
    """A Location's directory on local disk: itself, or a temporary copy of an object-store one."""
    if directory.local is not None:
        yield directory.local
        return
    with tempfile.TemporaryDirectory(prefix="skrull-export-checkpoint-") as scratch:
        directory.copy_to_local(Path(scratch))
        yield Path(scratch)


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
    """fp32 weights from every rank's ZeRO partition (DeepSpeed's zero_to_fp32, or its universal converter
    for a BF16_Optimizer checkpoint: workers/checkpoint_weights.py); LoRA: the adapter only."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from workers.checkpoint_weights import checkpoint_weights, zero_to_fp32_reads

    if zero_to_fp32_reads(checkpoint_dir, tag):
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag,
                                                        exclude_frozen_parameters=frozen_base)
    with checkpoint_weights(checkpoint_dir, tag, frozen_base=frozen_base) as source:
        return source.fetch(source.names())


def merged_model(config: SkrullConfig, state: dict[str, Any], *, attn: str = STANDARD_ATTENTION) -> Any:
    """A LoRA run's base rebuilt with `attn` (model.name_or_path's weights, or a tiny preset's seeded random
    init), wrapped with peft's get_peft_model and the run's LoraConfig, the trained adapter weights loaded
    (every one must come from the checkpoint), merged by peft's merge_and_unload."""
    from peft import get_peft_model

    from app.model.spec import model_spec
    from workers.models import lora_config

    spec = model_spec(config.model, config.train, tokenizer=config.data.tokenizer)
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
    return wrapper.merge_and_unload()  # W + (alpha / r) * B @ A in fp32, cast afterwards


def save_model_config(config: SkrullConfig, out: Path, *, dtype: str, tokenizer: Any,
                      run_tokenizer: Any = None) -> None:
    """config.json and generation_config.json of the run's architecture as save_pretrained writes them for
    inference: its class in `architectures`, `dtype`, the KV cache on, the eos/pad ids of `tokenizer` (the
    saved transformers one). `run_tokenizer`: the run's loaded TextTokenizer (a tiny preset's vocabulary)."""
    from app.model.spec import model_spec
    from workers.models import DTYPES

    spec = model_spec(config.model, config.train, tokenizer=run_tokenizer or config.data.tokenizer)
    meta = spec.meta_model()
    meta.config.architectures = [type(meta).__name__]
    meta.config.dtype = DTYPES[dtype]
    _for_inference(meta, tokenizer)
    meta.config.save_pretrained(str(out))
    meta.generation_config.save_pretrained(str(out))


def _for_inference(model: Any, tokenizer: Any) -> None:
    """KV cache on, and the tokenizer's eos/pad ids in the config and generation config."""
    model.config.use_cache = True
    for target in (model.config, model.generation_config):
        if tokenizer.eos_token_id is not None:
            target.eos_token_id = tokenizer.eos_token_id
        if tokenizer.pad_token_id is not None:
            target.pad_token_id = tokenizer.pad_token_id


def _prepare_for_inference(model: Any, dtype: str, tokenizer: Any) -> Any:
    """dtype, KV cache on, eval mode, and the tokenizer's eos/pad ids in the config and generation config."""
    from workers.models import DTYPES

    model = model.to(DTYPES[dtype]).eval()
    _for_inference(model, tokenizer)
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
    if dtype not in (None, "fp32", "bf16"):
        raise ConfigError(f"--dtype {dtype!r} is not one of: bf16, fp32")
    target = _check_out(out)
    staging = None
    try:
        with run_checkpoint(run_dir, checkpoint) as (config, directory, state):
            lora = config.model.lora.r > 0
            if merge and not lora:
                raise ConfigError("--merge applies to LoRA runs (model.lora.r > 0) only; this run trained "
                                  "every weight, so drop --merge")
            dtype = dtype or config.model.dtype
            kind = "merged" if merge else "adapter" if lora else "model"
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
            write_export(config, directory, state.tag, staging, kind=kind, dtype=dtype,
                         template=_trained_template(run_dir, config))
            checkpoint_name = directory.name
        if target.exists():
            target.rmdir()  # empty (checked above)
        os.replace(staging, target)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(out=str(target), kind=kind, step=state.step, checkpoint=checkpoint_name, dtype=dtype)


def write_export(config: SkrullConfig, directory: Path, tag: str, out: Path, *, kind: str, dtype: str,
                 template: str | None) -> None:
    """The module docstring's files of `kind` (model | adapter | merged) into the local directory `out`."""
    from app.model.export_tokenizer import save_tokenizer
    from app.model.spec import model_spec
    from workers.checkpoint_weights import checkpoint_weights
    from workers.hf_export import export_names, move_into, write_adapter, write_weights
    from workers.models import DTYPES

    tokenizer = save_tokenizer(config.data.tokenizer, template, out)
    spec = model_spec(config.model, config.train, tokenizer=config.data.tokenizer)
    if kind == "merged":
        model = merged_model(config, consolidate(directory, tag, frozen_base=True))
        _prepare_for_inference(model, dtype, tokenizer).save_pretrained(str(out), safe_serialization=True)
        return
    with checkpoint_weights(directory, tag, frozen_base=kind == "adapter") as source:
        if kind == "adapter":
            peft_model = spec.meta_peft_model()
            shapes = export_names(peft_model.base_model.model, trainable_only=True)
            write_adapter(source, shapes, peft_model, move_into(out), dtype=DTYPES[dtype], writer=True)
            return
        write_weights(source, export_names(spec.meta_model()), move_into(out), dtype=DTYPES[dtype],
                      writer=True)
    save_model_config(config, out, dtype=dtype, tokenizer=tokenizer)


def publish_export(config: SkrullConfig, run_dir: str, *, step: int, template: str | None,
                   tokenizer: Any = None) -> str:
    """The end of a run with train.export_on_finish: the workers' weights of `step` in
    <run_dir>/.hf-export/ (workers/hf_export.py export_engine) completed with the tokenizer and config
    files, then moved to <run_dir>/hf/ (an earlier one replaced; local: one rename; an object store: file by
    file, config.json / adapter_config.json last). Returns where it is. RuntimeError when the workers'
    export is missing or of another step. `tokenizer`: the run's loaded TextTokenizer (else loaded)."""
    from app.model.export_tokenizer import save_tokenizer
    from workers.hf_export import EXPORT_MARKER, HF_DIR, HF_STAGING, export_complete
    from workers.storage import Location

    run = Location.of(run_dir)
    staging = run / HF_STAGING
    if not export_complete(run_dir, step):
        raise RuntimeError(f"the workers' export of step {step} is not in {staging} (see the workers' log); "
                           "`python -m app export` writes one from the final checkpoint")
    kind = "adapter" if config.model.lora.r > 0 else "model"
    with tempfile.TemporaryDirectory(prefix="skrull-export-") as local:
        saved = save_tokenizer(config.data.tokenizer, template, Path(local), loaded=tokenizer)
        if kind == "model":
            save_model_config(config, Path(local), dtype=config.model.dtype, tokenizer=saved,
                              run_tokenizer=tokenizer)
        staging.copy_from_local(Path(local))
    (staging / EXPORT_MARKER).delete()
    final = run / HF_DIR
    final.delete()
    staging.move_to(final, last=("config.json", "adapter_config.json"))
    return str(final)
