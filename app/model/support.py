"""Which models the training path can run exactly, checked on the driver before Ray starts.

The DACP attention (workers/attention/, the transformers attention "dacp") computes full causal softmax
attention over packed variable-length sequences, each one whole on a rank or sharded over the CP ring, with
the model's `scaling`; the loss applies the LM head to the hidden states itself (workers/forward.py). A
model whose config asks for other math would fail inside a worker after Ray started, or train on logits the
model never computes. Refused (`attention_problems`, `logit_problems`), each naming the config key:

- a sliding window shorter than the run's max sequence length (`sliding_window` on the layers that use it:
  Mistral v0.1, Phi-3, Qwen2/Qwen3 with `use_sliding_window` and layers above `max_window_layers`,
  Gemma-2/3 `layer_types` with sliding layers, Starcoder2, Cohere2, ...): a window of W tokens attends to
  the last W tokens, which is full causal attention only for sequences of at most W tokens; a window at
  least as long as the run's max sequence length is therefore allowed;
- chunked attention shorter than the max sequence length (Llama 4 `attention_chunk_size`), same reasoning;
- attention logit soft-capping (Gemma-2 `attn_logit_softcapping`): tanh on the scores before the softmax;
- learned attention sinks (gpt-oss): an extra per-head logit in every softmax;
- bidirectional attention (`use_bidirectional_attention`, `is_causal: false`) and ALiBi position biases
  (`alibi`): scores the causal kernel does not add;
- layers that are not softmax attention at all (`layer_types` other than full / sliding attention:
  linear attention, Mamba, convolution layers of hybrid models);
- attention dropout (`attention_dropout` > 0): the kernel has none;
- longrope / dynamic RoPE scaling past `original_max_position_embeddings` (Phi-3-128k, Phi-3.5/4-mini):
  its frequencies follow the longest position of the whole packed call, not each sequence's;
- logits the model scales or caps after its LM head (`final_logit_softcapping`, Cohere `logit_scale`,
  Granite `logits_scaling`): the chunked loss applies the LM head alone and would train other logits.

Plus the vocabulary (`vocabulary_problem`): every id the tokenizer can emit (special and added tokens
included) must be a row of the model's embedding, or the first batch fails inside a worker.

Everything here reads the model's config.json as JSON (a local directory, or a hub id's file in the local
Hugging Face cache): `python -m app plan` never imports torch or transformers. Tiny presets are built from
transformers' Qwen2 / Llama configs with full causal attention and a vocabulary sized from the tokenizer:
nothing to check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import ConfigError, ModelConfig, SkrullConfig
from workers.presets import is_tiny_preset

HfConfig = dict[str, Any]
"""A model's config.json as a dict (the text model's part of a multimodal config)."""

_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
"""layer_types the softmax attention covers (the window / chunk rules decide the last two)."""


def model_config_dict(model: ModelConfig) -> HfConfig | None:
    """model.name_or_path's config.json, or None: a tiny preset, or a hub id not in the local cache.

    A multimodal config's `text_config` is merged over it (the language model is what trains). Read as
    JSON: transformers writes every model-specific key (sliding_window, layer_types, ...) into config.json.
    """
    name = model.name_or_path
    if is_tiny_preset(name):
        return None
    local = Path(name).expanduser()
    file = local / "config.json" if local.is_dir() else cached_hub_file(name, "config.json")
    if file is None or not file.is_file():
        return None
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict):
        return None
    text = found.get("text_config")
    return {**found, **text} if isinstance(text, dict) else found


def cached_hub_file(repo_id: str, filename: str) -> Path | None:
    """The hub file in the local Hugging Face cache (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename)
    except (ValueError, OSError):  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


# ------------------------------------------------------------------------------------------ attention rules


def _layer_types(hf: HfConfig) -> list[str] | None:
    layers = hf.get("layer_types")
    return [str(kind) for kind in layers] if isinstance(layers, list) else None


def sliding_window_problem(hf: HfConfig, max_len: int) -> str | None:
    """A sliding window shorter than `max_len` on at least one layer (None: no window, or a harmless one).

    Off when `use_sliding_window` is false (Qwen2/Qwen3), when `sliding_window` is null/0, when
    `layer_types` lists no sliding layer, or (configs without layer_types) when `max_window_layers` >=
    the layer count (Qwen2: layers from max_window_layers on use the window). A window W >= max_len is full
    causal attention on every sequence the run accepts: allowed.
    """
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        return None
    layers, total, first = _layer_types(hf), hf.get("num_hidden_layers"), hf.get("max_window_layers")
    sliding: int | None = None
    if layers is not None:
        sliding = layers.count("sliding_attention")
    elif hf.get("use_sliding_window") and isinstance(total, int) and isinstance(first, int):
        sliding = max(0, total - first)  # Qwen2: layers >= max_window_layers slide
    if sliding == 0 or window >= max_len:
        return None
    where = f" on {sliding} of {total} layers" if sliding is not None and isinstance(total, int) else ""
    return (f"a sliding window of {window} tokens{where} (sliding_window), shorter than the run's max "
            f"sequence length {max_len}")


def chunked_attention_problem(hf: HfConfig, max_len: int) -> str | None:
    """Chunked attention (Llama 4 `attention_chunk_size`) with chunks shorter than `max_len`."""
    chunk = hf.get("attention_chunk_size")
    if not isinstance(chunk, int) or chunk <= 0 or chunk >= max_len:
        return None
    layers = _layer_types(hf)
    if layers is not None and "chunked_attention" not in layers:
        return None
    return f"chunked attention of {chunk} tokens (attention_chunk_size), shorter than {max_len}"


def softcap_problem(hf: HfConfig, max_len: int) -> str | None:
    """Attention logit soft-capping (Gemma-2 `attn_logit_softcapping`): tanh-capped scores."""
    cap = hf.get("attn_logit_softcapping")
    return f"attention logit soft-capping (attn_logit_softcapping={cap})" if cap else None


def sinks_problem(hf: HfConfig, max_len: int) -> str | None:
    """Learned attention sinks (gpt-oss): one more learned logit in every softmax row."""
    if hf.get("model_type") == "gpt_oss":
        return "learned attention sinks (gpt-oss sinks)"
    return None


def non_causal_problem(hf: HfConfig, max_len: int) -> str | None:
    """Bidirectional attention (`use_bidirectional_attention`, `is_causal: false`) or ALiBi biases."""
    if hf.get("use_bidirectional_attention"):
        return "bidirectional attention (use_bidirectional_attention)"
    if hf.get("is_causal") is False:
        return "non-causal attention (is_causal: false)"
    attn_config = hf.get("attn_config")
    if hf.get("alibi") or (isinstance(attn_config, dict) and attn_config.get("alibi")):
        return "ALiBi attention biases (alibi)"
    return None


def layer_kind_problem(hf: HfConfig, max_len: int) -> str | None:
    """Layers that are not softmax attention (hybrid models: linear attention, Mamba, convolutions)."""
    layers = _layer_types(hf)
    other = sorted({kind for kind in layers or () if kind not in _ATTENTION_LAYERS})
    return f"layers that are not softmax attention (layer_types: {', '.join(other)})" if other else None


def dropout_problem(hf: HfConfig, max_len: int) -> str | None:
    """Attention dropout (`attention_dropout` / `attn_pdrop` > 0): the DACP kernel has none."""
    for key in ("attention_dropout", "attn_pdrop"):
        value = hf.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return f"attention dropout ({key}={value}; set it to 0 in the model's config.json)"
    return None


def length_dependent_rope_problem(hf: HfConfig, max_len: int) -> str | None:
    """RoPE whose frequencies depend on the batch's longest position (`rope_scaling` longrope / dynamic,
    Phi-3-128k, Phi-3.5/4-mini): transformers picks them from max(position_ids) of the whole call, which in
    a packed DACP stream is the longest sequence on the rank, not each sequence's own length (measured: a
    13-token sequence packed beside a 97-token one drifted 2.7e-3 from HF's own forward). Exact while no
    sequence passes `original_max_position_embeddings`, where the choice cannot flip."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rope.get("rope_type") or rope.get("type") if isinstance(rope, dict) else None
    if kind not in ("longrope", "dynamic"):
        return None
    original = rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if isinstance(original, int) and max_len <= original:
        return None
    return (f"{kind} RoPE scaling (rope_scaling) past original_max_position_embeddings={original}, shorter "
            f"than the run's max sequence length {max_len}")


ATTENTION_RULES: tuple[Callable[[HfConfig, int], str | None], ...] = (
    sliding_window_problem, chunked_attention_problem, softcap_problem, sinks_problem, non_causal_problem,
    layer_kind_problem, dropout_problem, length_dependent_rope_problem,
)
"""Each rule: (config.json, the run's max sequence length) -> the unsupported feature, or None."""


def attention_problems(hf: HfConfig, max_len: int) -> list[str]:
    """Every attention feature of the model the DACP attention cannot compute (ATTENTION_RULES)."""
    return [found for rule in ATTENTION_RULES if (found := rule(hf, max_len))]


def logit_problems(hf: HfConfig) -> list[str]:
    """Logits the model transforms after its LM head, which the chunked loss (workers/forward.py) skips."""
    found = []
    if hf.get("final_logit_softcapping"):
        found.append(f"final logit soft-capping (final_logit_softcapping={hf['final_logit_softcapping']})")
    for key in ("logit_scale", "logits_scaling"):
        value = hf.get(key)
        if isinstance(value, (int, float)) and value != 1:
            found.append(f"scaled output logits ({key}={value})")
    return found


def check_model_math(config: SkrullConfig, hf: HfConfig | None = None) -> None:
    """ConfigError naming model.name_or_path and every unsupported feature (attention and logits).

    `hf`: the model's config.json (default: model_config_dict); nothing is checked without one (a tiny
    preset, or a hub id not in the local cache: preflight resolves hub ids into the cache first).
    """
    hf = model_config_dict(config.model) if hf is None else hf
    if not hf:
        return
    max_len = config.max_sequence_length
    problems = attention_problems(hf, max_len) + logit_problems(hf)
    if not problems:
        return
    kind = f" ({hf['model_type']})" if hf.get("model_type") else ""
    windows = [rule(hf, max_len) for rule in (sliding_window_problem, chunked_attention_problem,
                                              length_dependent_rope_problem)]
    windows = [found for found in windows if found]
    fix = "choose another model.name_or_path"
    if len(windows) == len(problems):
        fix = ("lower data.max_length to at most the window (a window at least as long as every sequence is "
               "full causal attention; the max sequence length is data.max_length, capped by "
               f"scheduling.bucket_size x parallel.cp_size), or {fix}")
    raise ConfigError(
        f"model.name_or_path={config.model.name_or_path!r}{kind} needs math the DACP training path cannot "
        f"compute (full causal attention over packed sequences, the LM head applied by the loss): "
        f"{'; '.join(problems)}; {fix}"
    )


# ------------------------------------------------------------------------------------------ vocabulary


def model_vocab_size(model: ModelConfig, hf: HfConfig | None) -> tuple[int, str] | None:
    """The rows of the embedding the workers build and where that number comes from, or None when it is
    sized from the tokenizer.

    A tiny preset: model.vocab_size, else the tokenizer's size (None: nothing to check). A random-init
    directory or hub config: model.vocab_size resizes it, else config.json's. Loaded weights: config.json's
    (model.vocab_size then only steers the cost model), or model.vocab_size when config.json is not local.
    """
    hf_vocab = hf.get("vocab_size") if hf else None
    from_json = (hf_vocab, "its config.json") if isinstance(hf_vocab, int) and hf_vocab > 0 else None
    from_knob = (model.vocab_size, "model.vocab_size") if model.vocab_size else None
    if is_tiny_preset(model.name_or_path):
        return from_knob
    if model.random_init:
        return from_knob or from_json
    return from_json or from_knob


def largest_token_id(tokenizer: Any) -> int:
    """The largest id the tokenizer (app/data/tokenizer.py TextTokenizer) can emit, specials included."""
    largest = tokenizer.vocab_size - 1
    backend = tokenizer.backend
    if tokenizer.kind == "tiktoken":
        return max(largest, int(getattr(backend._tokenizer, "max_token_value", largest)))
    vocab = (backend.get_vocab(with_added_tokens=True) if tokenizer.kind == "tokenizers"
             else backend.get_vocab())
    return max(largest, max(vocab.values(), default=largest))


def check_vocabulary(config: SkrullConfig, tokenizer: Any | None = None, hf: HfConfig | None = None) -> None:
    """ConfigError when data.tokenizer emits an id >= the model's vocab_size (naming both and both numbers).

    `tokenizer` (a loaded TextTokenizer) and `hf` (config.json) default to loading them; the tokenizer is
    only loaded when the model's vocabulary is not sized from it.
    """
    hf = model_config_dict(config.model) if hf is None else hf
    found = model_vocab_size(config.model, hf)
    if found is None:
        return
    vocab, source = found
    if tokenizer is None:
        from app.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.data.tokenizer)
    largest = largest_token_id(tokenizer)
    if largest < vocab:
        return
    raise ConfigError(
        f"data.tokenizer={config.data.tokenizer!r} emits token ids up to {largest} ({largest + 1} ids, "
        f"special and added tokens included) but model.name_or_path={config.model.name_or_path!r} has "
        f"vocab_size {vocab} ({source}): ids >= {vocab} have no embedding. Use the model's own tokenizer as "
        "data.tokenizer, or a model whose vocabulary covers it"
        + (" (or raise model.vocab_size)" if source == "model.vocab_size" else "")
    )


def check_model_support(config: SkrullConfig, tokenizer: Any | None = None) -> None:
    """check_model_math then check_vocabulary, reading config.json once (preflight and `plan`), then
    check_checkpointing_options."""
    hf = model_config_dict(config.model)
    check_model_math(config, hf or {})
    check_vocabulary(config, tokenizer, hf or {})
    check_checkpointing_options(config)


def check_checkpointing_options(config: SkrullConfig) -> None:
    """train.activation_checkpointing_every / train.activation_offload need transformers' options of the
    same names (workers/models.py enable_checkpointing); transformers is imported only when one is set."""
    train = config.train
    if train.activation_checkpointing_every == 1 and not train.activation_offload:
        return
    from workers.models import checkpointing_problem

    problem = checkpointing_problem(every_n_layers=train.activation_checkpointing_every,
                                    offload=train.activation_offload)
    if problem:
        raise ConfigError(problem)
