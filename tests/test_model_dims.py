"""The model's dimensions come from its own config.json (app/model/dims.py): `plan` and `train` size by them,
a model.* value that contradicts them is exit 2 naming the key and both values, and where no config.json can
be read the config's own values are used and `plan` says so in one line.

References nobody here wrote: transformers' models (their parameters, counted by torch) for the parameter
count, built on the meta device, and the safetensors files transformers' save_pretrained writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.__main__ import main
from app.config import ConfigError, load_config
from app.model.dims import architecture_params, checkpoint_params, config_json_dims

GPU_7B = "configs/qwen2.5-7b-gpu.yaml"
PLANNABLE = ["data.source=synthetic", "data.tokenizer=configs/bench/synth-bpe-773.json", "plan.num_batches=1"]
"""A tokenizer whose ids a Llama-3 vocabulary covers, synthetic lengths: nothing else to read."""
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rope_theta": 500000.0, "tie_word_embeddings": False, "rms_norm_eps": 1e-05,
             "hidden_act": "silu"}
"""Llama-3.1-8B's config.json (its architecture keys)."""


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return tmp_path


def _argv(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _plan_json(capsys, *overrides: str) -> dict:
    assert main(["plan", "--config", GPU_7B, "--json", *_argv(list(overrides))]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_set_dimension_the_checkpoint_contradicts_is_exit_2_naming_both(capsys, llama_dir: Path) -> None:
    argv = ["plan", "--config", GPU_7B, "--set", f"model.name_or_path={llama_dir}", "--set",
            "model.hidden_size=3584"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size=3584" in err and "hidden_size 4096" in err and err.count("\n") == 1
    from app.train.driver import train

    config = load_config(GPU_7B, [f"model.name_or_path={llama_dir}", "model.num_layers=28", *PLANNABLE])
    with pytest.raises(ConfigError, match="model.num_layers=28.*num_hidden_layers|model.num_layers=28"):
        train(config, progress=False)  # before anything starts


def test_plan_and_train_size_by_the_checkpoint(capsys, llama_dir: Path) -> None:
    from app.profiling.budget import resolve_bucket_size
    from app.profiling.hardware import model_dims

    out = _plan_json(capsys, f"model.name_or_path={llama_dir}", *PLANNABLE)
    dims = out["model_dims"]
    assert dims["source"] == "config.json" and dims["note"] is None
    assert (dims["hidden_size"], dims["kv_hidden_size"], dims["num_layers"], dims["vocab_size"]) == (
        4096, 1024, 32, 128256)
    assert dims["num_params"] == 8_030_261_248  # Llama-3.1-8B's published count
    assert out["memory"]["zero2"]["weights"] == 8_030_261_248 * 2
    config = load_config(GPU_7B, [f"model.name_or_path={llama_dir}", *PLANNABLE])
    assert model_dims(config.model).hidden_size == 4096  # what `train` sizes the engine's buckets by
    _, budget = resolve_bucket_size(config)  # what `train` derives C from
    assert budget.tokens == out["bucket_size"]


def test_without_a_readable_config_json_the_configs_values_are_used_and_said(capsys, monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", "/nonexistent/hub-cache")
    overrides = ["data.source=synthetic", "plan.num_batches=1"]
    out = _plan_json(capsys, *overrides)
    offline = load_config(GPU_7B).model.offline_dims
    assert out["model_dims"]["source"] == "config"
    assert {k: out["model_dims"][k] for k in offline} == offline
    assert main(["plan", "--config", GPU_7B, *_argv(overrides)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "config.json cannot be read" in line]
    assert len(lines) == 1 and "Qwen/Qwen2.5-7B" in lines[0]


def _meta_model(**config: object) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


@pytest.mark.parametrize("family", [
    dict(model_type="qwen2", tie_word_embeddings=False),
    dict(model_type="qwen2", tie_word_embeddings=True),
    dict(model_type="llama", attention_bias=True, mlp_bias=True, head_dim=24),
    dict(model_type="mistral"),
    dict(model_type="qwen3", head_dim=32),
])
def test_the_parameter_count_of_config_json_is_the_models(family: dict) -> None:
    config = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=3, vocab_size=300, **family)
    model = _meta_model(**config)
    assert architecture_params(config) == sum(p.numel() for p in model.parameters())


def test_the_parameter_count_of_a_checkpoint_is_its_tensors(tmp_path: Path) -> None:
    from workers.models import build_model

    model = build_model("tiny-llama", num_layers=3, attn_implementation="sdpa")
    model.save_pretrained(str(tmp_path), max_shard_size=200_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    count = sum(p.numel() for p in model.parameters())
    assert checkpoint_params(tmp_path) == count
    hf = json.loads((tmp_path / "config.json").read_text())
    assert config_json_dims(hf, tmp_path)["num_params"] == count
