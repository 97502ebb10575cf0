"""Build the causal LM a run trains, with the DACP attention and no KV cache.

    build_model("tiny-qwen2")                 transformers' Qwen2 architecture, tiny dims, random init
    build_model("tiny-llama")                 transformers' Llama architecture, tiny dims, random init
    build_model("Qwen/Qwen2.5-0.5B")          hub weights (or random_init=True: its config, random weights)
    build_model("/path/to/hf_model_dir")      a local HF model directory
    build_model(..., lora_r=8)                any of them with peft LoRA adapters; only the adapters train
    build_model(..., zero3=ds_config)         any of them partitioned over the ranks as it is built and
                                              loaded (ZeRO-3, workers/sharded.py): the same weights
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention import register_dacp_attention
from workers.loss import LOSS_HEAD, LossHead
from workers.presets import TINY_DEFAULTS, is_tiny_preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}



@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """What a worker builds: `build_model`'s arguments, made by the driver from the config's model section."""

    name_or_path: str = "tiny-qwen2"
    random_init: bool = False
    dtype: str = "fp32"
    vocab_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    hidden_size: int = 0
    num_layers: int = 0
    intermediate_size: int = 0
    seed: int = 0
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = 1
    """train.activation_checkpointing_every: recompute every n-th decoder layer (enable_checkpointing)."""
    activation_offload: bool = False
    """train.activation_offload: recomputed layers' inputs held in host memory (enable_checkpointing)."""
    attention_backend: str = "auto"
    """Varlen kernel of the DACP attention (resolved once per worker, see workers/attention/runtime.py)."""
    kernels: str = "auto"
    """model.kernels: the kernel set (workers/kernels), resolved for the device in `build_on`."""
    compile: bool = False
    """train.compile: compile each decoder layer (workers/compile.py) in `build_on`."""
    lora_r: int = 0
    """model.lora.r: > 0 adds peft LoRA adapters (apply_lora); 0 trains every weight."""
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: str | tuple[str, ...] = "all-linear"

    @property
    def frozen_base(self) -> bool:
        """Only adapters train: checkpoints save and load only the trainable (adapter) weights."""
        return self.lora_r > 0

    def build(self, attn_implementation: str | None = None, *, zero3: dict[str, Any] | None = None,
              group: Any = None) -> torch.nn.Module:
        """The model with the DACP attention, or `attn_implementation` (e.g. "sdpa" to export it);
        `zero3` (a stage-3 DeepSpeed config): built partitioned over `group` (build_model)."""
        kwargs = dataclasses.asdict(self)
        for runtime_choice in ("attention_backend", "kernels", "compile"):  # made on the device: build_on
            del kwargs[runtime_choice]
        return build_model(**kwargs, attn_implementation=attn_implementation, zero3=zero3, group=group)

    def hf_config(self) -> Any:
        """The transformers config the build uses: a tiny preset's, or model.name_or_path's config.json
        (a random-init build's vocabulary resized by vocab_size)."""
        from transformers import AutoConfig

        if is_tiny_preset(self.name_or_path):
            return _tiny_config(self.name_or_path, dict(
                vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
                num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                intermediate_size=self.intermediate_size))
        config = AutoConfig.from_pretrained(os.path.expanduser(self.name_or_path))
        if self.random_init and self.vocab_size:
            config.vocab_size = self.vocab_size
        return config

    def meta_model(self, attn_implementation: str = "sdpa") -> torch.nn.Module:
        """The architecture on the meta device (no memory): names, shapes, class and generation config of
        what an export writes."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config(), attn_implementation=attn_implementation,
                                                    dtype=DTYPES[self.dtype])

    def meta_peft_model(self) -> Any:
        """The run's PeftModel (peft's wrapper with the run's LoraConfig) on the meta device: what names a
        LoRA export's adapter files (workers/hf_export.py write_adapter)."""
        from peft import get_peft_model

        config = lora_config(self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_target_modules)
        base = self.meta_model()
        base.name_or_path = self.name_or_path  # what peft records as base_model_name_or_path
        with torch.device("meta"):
            return get_peft_model(base, config)

    def build_on(self, device: torch.device, *, zero3: dict[str, Any] | None = None,
                 group: Any = None, lap: Callable[[str], None] | None = None) -> torch.nn.Module:
        """The training model on `device` in train mode: built (partitioned over `group` with a stage-3
        `zero3` config, its partitions made on `device`; else whole and moved), its kernel set applied and
        activated (model.kernels resolved for the device), its layers compiled with train.compile.

        `lap(name)` (workers/phase_clock.py) is called at the end of each phase: "model" (built:
        random init or loaded; ZeRO-3: partitioned on `device`), "device" (moved to `device`; whole builds
        only), then prepare_on_device's."""
        lap = lap or _no_lap
        if zero3 is None:
            model = self.build()
            lap("model")
            model = model.to(device)
            lap("device")
        else:
            use_accelerator_device(device)  # where zero.Init puts the partitions
            model = self.build(zero3=zero3, group=group)
            lap("model")
        model.train()  # from_pretrained returns eval mode, which would also skip activation recompute
        prepare_on_device(model, device, kernels=self.kernels, compile=self.compile, lap=lap)
        return model


def _no_lap(name: str) -> None:
    """build_on's and prepare_on_device's `lap` when nobody times the phases."""


def use_accelerator_device(device: torch.device) -> None:
    """Make `device` DeepSpeed's current accelerator device (zero.Init allocates there)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def prepare_on_device(model: torch.nn.Module, device: torch.device, *, kernels: str = "auto",
                      compile: bool = False, lap: Callable[[str], None] | None = None) -> str:
    """Apply model.kernels (resolved for `device`; under train.compile `auto` leaves the layers to the
    compiler, which fuses their elementwise ops itself: liger_loss where liger runs, else torch) and
    train.compile to a built model; returns the kernel set's name.

    `lap(name)` ends the phases "kernels" (the set imported, applied and activated) and, with `compile`,
    "compile" (the layers wrapped in torch.compile: dynamo compiles on their first call, the warm-up)."""
    from workers.compile import compile_layers
    from workers.kernels import kernel_set, resolve_kernels

    lap = lap or _no_lap
    name = resolve_kernels(kernels, device, getattr(model.config, "model_type", ""), compile=compile)
    chosen = kernel_set(name)
    chosen.apply(model)
    chosen.activate(model)
    model.skrull_kernels = name
    lap("kernels")
    if compile:
        compile_layers(model)
        lap("compile")
    return name


def _tiny_config(name: str, dims: dict[str, int]):
    from transformers import LlamaConfig, Qwen2Config

    merged = {k: (dims.get(k) or v) for k, v in TINY_DEFAULTS.items()}
    common = dict(
        vocab_size=merged["vocab_size"], hidden_size=merged["hidden_size"],
        num_hidden_layers=merged["num_layers"], num_attention_heads=merged["num_attention_heads"],
        num_key_value_heads=merged["num_key_value_heads"], intermediate_size=merged["intermediate_size"],
        max_position_embeddings=1 << 17, use_cache=False, tie_word_embeddings=False,
    )
    if merged["num_attention_heads"] % merged["num_key_value_heads"]:
        raise ValueError("model.num_attention_heads must be a multiple of model.num_key_value_heads")
    return Qwen2Config(**common) if name == "tiny-qwen2" else LlamaConfig(**common)


def _is_local_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(name)


def build_model(
    name_or_path: str = "tiny-qwen2", *, random_init: bool = False, dtype: str = "fp32", vocab_size: int = 0,
    num_attention_heads: int = 0, num_key_value_heads: int = 0, hidden_size: int = 0, num_layers: int = 0,
    intermediate_size: int = 0, seed: int = 0, attn_implementation: str | None = None,
    activation_checkpointing: bool = False, activation_checkpointing_every: int = 1,
    activation_offload: bool = False, lora_r: int = 0, lora_alpha: float = 16.0,
    lora_dropout: float = 0.0, lora_target_modules: str | tuple[str, ...] = "all-linear",
    zero3: dict[str, Any] | None = None, group: Any = None,
):
    """A transformers PreTrainedModel using the "dacp" attention (or `attn_implementation`), use_cache off.

    Tiny presets always use random init (seeded by `seed`); the dimension arguments (0 = preset default)
    apply to them only, except vocab_size, which also resizes a random-init hub config.
    `activation_checkpointing` recomputes each decoder layer in backward (transformers' gradient
    checkpointing, non-reentrant so the DACP layout keyword arguments pass through): the recompute re-runs
    the ring, which is safe because every CP rank recomputes the same layers in the same order;
    `activation_checkpointing_every` and `activation_offload` are enable_checkpointing's.
    `lora_r` > 0 injects LoRA adapters after the weights are built (apply_lora), from the generator
    seeded again with `seed`, so that every rank and every way of building makes the same adapters.
    `zero3` (a stage-3 DeepSpeed config): every weight is partitioned over `group` (default: the world)
    as its module is built and filled partition by partition (workers/sharded.py); the weights equal the
    whole build's (random ones: both skip torch's construction-time init and run transformers' init in
    the same order from the same seed).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not one of: {', '.join(DTYPES)}")
    attn = attn_implementation or register_dacp_attention()
    torch_dtype = DTYPES[dtype]
    if is_tiny_preset(name_or_path):
        dims = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                    num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                    intermediate_size=intermediate_size)
        config = _tiny_config(name_or_path, dims)
        model = _random_model(copy.deepcopy(config), attn, torch_dtype, seed, zero3, group)
    else:
        path = os.path.expanduser(name_or_path)
        if _is_local_path(name_or_path) and not os.path.isdir(path):
            raise ValueError(f"model.name_or_path={name_or_path!r}: no such model directory")
        try:
            if random_init:
                config = AutoConfig.from_pretrained(path)
                if vocab_size:
                    config.vocab_size = vocab_size
                model = _random_model(config, attn, torch_dtype, seed, zero3, group)
            elif zero3 is not None:
                from workers.sharded import pretrained_partitioned

                model = pretrained_partitioned(path, attn=attn, dtype=torch_dtype, ds_config=zero3,
                                               group=group)
            else:
                model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn,
                                                             dtype=torch_dtype)
        except OSError as err:
            raise ValueError(f"model.name_or_path={name_or_path!r} could not be loaded: {err}") from err
    model.config.use_cache = False
    if lora_r:
        torch.manual_seed(seed)
        model = apply_lora(model, lora_config(lora_r, lora_alpha, lora_dropout, lora_target_modules))
    if activation_checkpointing:
        enable_checkpointing(model, every_n_layers=activation_checkpointing_every, offload=activation_offload)
    attach_loss_head(model)
    return model


def _random_model(config: Any, attn: str, dtype: torch.dtype, seed: int, zero3: dict[str, Any] | None,
                  group: Any) -> torch.nn.Module:
    """`config`'s architecture with transformers' random init from `seed`: built without torch's
    construction-time init (transformers' no_init_weights), then `init_weights` (initialize, tie). A ZeRO-3
    build (workers/sharded.py) initializes the same modules in the same order from the same generator, so
    the two give the same weights."""
    from transformers import AutoModelForCausalLM, initialization

    torch.manual_seed(seed)
    if zero3 is not None:
        from workers.sharded import initialize_partitioned, zero3_construction

        with zero3_construction(zero3, group):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
        initialize_partitioned(model)
        return model
    with initialization.no_init_weights():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    model.init_weights()
    return model


CHECKPOINTING_OPTIONS = {"every_n_layers": "train.activation_checkpointing_every",
                         "offload": "train.activation_offload"}
"""transformers' checkpointing options and the config knob that sets each."""

CHECKPOINTING_METHODS = (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                         ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"))
"""transformers' checkpointing entry points, newest first, with the name of each one's torch-checkpoint
kwargs: 5.17 added `every_n_layers` and `offload` to gradient_checkpointing_enable, later versions moved
them to activation_checkpointing_enable (the old name keeps only **kwargs)."""


def checkpointing_method(owner: Any) -> tuple[str, str, frozenset[str]]:
    """The first of CHECKPOINTING_METHODS that `owner` (a PreTrainedModel class or instance) has: its name,
    its kwargs parameter and the parameter names of its signature."""
    import inspect

    for name, kwargs_name in CHECKPOINTING_METHODS:
        method = getattr(owner, name, None)
        if method is not None:
            return name, kwargs_name, frozenset(inspect.signature(method).parameters)
    raise ValueError(f"{type(owner).__name__} has no gradient checkpointing (transformers' "
                     "gradient_checkpointing_enable)")


def checkpointing_problem(*, every_n_layers: int, offload: bool) -> str | None:
    """Why the installed transformers cannot checkpoint as asked (naming the knobs), or None.

    transformers >= 5.17 takes `every_n_layers` and `offload` (checkpointing_method: the entry point that
    has them); older versions have only the all-layers, on-device form."""
    from transformers import PreTrainedModel

    params = checkpointing_method(PreTrainedModel)[2]
    asked = {"every_n_layers": every_n_layers != 1, "offload": offload}
    lacking = [knob for option, knob in CHECKPOINTING_OPTIONS.items()
               if asked[option] and option not in params]
    if not lacking:
        return None
    return (f"{', '.join(lacking)} need transformers >= 5.17 (gradient checkpointing with every_n_layers "
            "and offload); upgrade it, or leave them at their defaults")


def enable_checkpointing(model, *, every_n_layers: int = 1, offload: bool = False) -> None:
    """transformers' activation checkpointing, non-reentrant (the DACP layout keyword arguments pass
    through), of every `every_n_layers`-th decoder layer, its saved inputs in host memory with `offload`
    (torch's save_on_cpu around each recomputed layer). Without those options in the installed
    transformers only the plain form exists: asking for more is a ValueError naming the knob."""
    problem = checkpointing_problem(every_n_layers=every_n_layers, offload=offload)
    if problem:
        raise ValueError(problem)
    name, kwargs_name, params = checkpointing_method(model)
    options = {option: value for option, value in (("every_n_layers", every_n_layers), ("offload", offload))
               if option in params}
    getattr(model, name)(**{kwargs_name: {"use_reentrant": False}}, **options)


def attach_loss_head(model: torch.nn.Module) -> LossHead:
    """Give `model` its chunked loss as a submodule (workers/loss.py LossHead: what ZeRO-3 needs to gather
    the LM head's weight for it); it holds no parameter, so state dicts and exports are unchanged."""
    head = LossHead(model.get_output_embeddings())
    setattr(model, LOSS_HEAD, head)
    return head


def lora_config(r: int, alpha: float, dropout: float, target_modules: str | tuple[str, ...]):
    """peft's LoraConfig for model.lora (a str target: peft's `all-linear` or a regex; a tuple: names)."""
    from peft import LoraConfig

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                      task_type="CAUSAL_LM")


def apply_lora(model, config):
    """Inject peft LoRA layers into `model` in place; every other weight is frozen (requires_grad False).

    Returns the transformers model itself (peft's `base_model.model`), not the PeftModel wrapper: the
    training path calls `get_decoder()` / `get_output_embeddings()` of the causal LM, and parameter names
    stay the model's own plus `.lora_A.default.weight` / `.lora_B.default.weight`, which is what the
    checkpoints and the export (app/model/export.py, which rebuilds the wrapper to save peft's format) rely
    on. The adapters are created after the seeded base weights, so every rank builds the same ones.
    """
    from peft import get_peft_model

    return get_peft_model(model, config).base_model.model
