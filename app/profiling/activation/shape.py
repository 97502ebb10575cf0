"""The shapes the activation-memory model reads, from the config tree and the model's config.json.

    ModelShape(family, hidden h, kv_hidden h_kv, heads, head_dim, intermediate I, layers L, vocab V,
               element e = bytes of model.dtype, fused_qkv)

Families the training path runs (app/model/support.py) and how their decoder layers differ in what a forward
keeps (app/profiling/activation/torch_kernels.py):

    qwen2, llama, mistral   separate q/k/v and gate/up projections (Qwen2's q/k/v biases keep nothing more)
    phi3                    one fused qkv projection, whose output stays alive as long as v (a view of it)
                            is saved by the attention; the fused gate_up output is kept whole by the SiLU,
                            which the separate gate and up of the others cost alike
    other                   modeled as llama (every family above is a pre-norm RMSNorm decoder with a
                            gated MLP); named `generic` in the plan so the guess is visible

The family comes from config.json's `model_type` (a local directory, or a hub id in the local cache), else
from the tiny preset's name, else from model.name_or_path's text; heads and head_dim likewise, else
h / 64 heads (they only size the attention's log-sum-exp and the rotary tables: under 0.1% of a layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config import SkrullConfig
from app.profiling.hardware import model_dims
from scheduling.cost import QWEN_VOCAB_SIZE
from workers.presets import TINY_DEFAULTS, is_tiny_preset

FAMILIES = ("qwen2", "llama", "mistral", "phi3")
"""model_type values modeled by name; any other is `generic` (llama's layer)."""
ELEMENT_BYTES = {"bf16": 2, "fp32": 4}
DEFAULT_HEAD_DIM = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    family: str
    hidden: int
    kv_hidden: int
    heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    element: int
    """Bytes per element of the model's dtype (bf16 2, fp32 4)."""

    @property
    def fused_qkv(self) -> bool:
        """One qkv projection (Phi-3): its output is what the attention's saved v keeps alive."""
        return self.family == "phi3"


def family_of(model_type: str | None, name: str) -> str:
    """config.json's model_type when it is a modeled family, else a family named in `name`, else generic."""
    if model_type in FAMILIES:
        return str(model_type)
    text = name.lower().replace("-", "").replace("_", "")
    for family, marks in (("qwen2", ("qwen2",)), ("phi3", ("phi3",)), ("mistral", ("mistral",)),
                          ("llama", ("llama",))):
        if any(mark in text for mark in marks):
            return family
    return "generic"


def shape_from_hf(hf: dict, *, element: int, name: str = "") -> ModelShape:
    """The shape of a transformers config (its config.json as a dict, or `PretrainedConfig.to_dict()`)."""
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    return ModelShape(family=family_of(hf.get("model_type"), name), hidden=hidden,
                      kv_hidden=kv_heads * head_dim, heads=heads, head_dim=head_dim,
                      intermediate=int(hf["intermediate_size"]), layers=int(hf["num_hidden_layers"]),
                      vocab=int(hf["vocab_size"]), element=element)


def model_shape(config: SkrullConfig) -> ModelShape:
    """The run's model shape: the cost model's dimensions (config, else the model's), family and heads from
    config.json, the tiny preset or the name (module docstring)."""
    from app.model.support import model_config_dict

    model = config.model
    dims = model_dims(model, config.data.tokenizer)
    hf = model_config_dict(model) or {}
    name = model.name_or_path
    if is_tiny_preset(name):
        heads = model.num_attention_heads or TINY_DEFAULTS["num_attention_heads"]
        family = "qwen2" if name == "tiny-qwen2" else "llama"
    else:
        heads = int(hf.get("num_attention_heads") or max(1, dims.hidden_size // DEFAULT_HEAD_DIM))
        family = family_of(hf.get("model_type"), name)
    head_dim = int(hf.get("head_dim") or dims.hidden_size // heads)
    return ModelShape(family=family, hidden=dims.hidden_size, kv_hidden=dims.kv_hidden_size, heads=heads,
                      head_dim=head_dim, intermediate=dims.intermediate_size or 4 * dims.hidden_size,
                      layers=dims.num_layers,
                      vocab=dims.vocab_size or int(hf.get("vocab_size") or QWEN_VOCAB_SIZE),
                      element=ELEMENT_BYTES[model.dtype])
