"""Models the DACP training path cannot compute, and tokenizers the model cannot embed: exit 2 before Ray.

Tiny configs are written by transformers' own config classes (save_pretrained), as a user's model
directory would be; `plan` runs in process (app.__main__.main) and preflight() is called directly.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.__main__ import main
from app.config import ConfigError, load_config
from app.model.support import attention_problems, check_model_support, model_config_dict
from app.train.preflight import preflight

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
"""Dimensions of every tiny config here (only config.json is written, no weights)."""


def _model_dir(tmp_path: Path, config) -> str:
    out = tmp_path / type(config).__name__
    config.save_pretrained(out)
    return str(out)


def _mistral(tmp_path: Path, window: int) -> str:
    from transformers import MistralConfig

    return _model_dir(tmp_path, MistralConfig(sliding_window=window, vocab_size=152000, **SMALL))


def _gemma2(tmp_path: Path) -> str:
    from transformers import Gemma2Config

    # Gemma-2's own defaults: attn_logit_softcapping=50, a 4096 sliding window on every other layer.
    return _model_dir(tmp_path, Gemma2Config(attn_logit_softcapping=50.0, vocab_size=152000, head_dim=16,
                                             **SMALL))


def _qwen2_sliding(tmp_path: Path, max_window_layers: int) -> str:
    from transformers import Qwen2Config

    return _model_dir(tmp_path, Qwen2Config(use_sliding_window=True, sliding_window=64,
                                            max_window_layers=max_window_layers, **SMALL))


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    argv = ["plan", "--config", "configs/tiny-cpu.yaml", "--json", "--set", "plan.num_batches=1",
            "--set", f"run.storage_path={tmp_path / 'runs'}"]
    for item in overrides:
        argv += ["--set", item]
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def _config(tmp_path: Path, *overrides: str):
    return load_config(REPO / "configs/tiny-cpu.yaml", [f"run.storage_path={tmp_path / 'runs'}", *overrides])


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # configs name repo-relative files (configs/bench/synth-bpe-773.json)


@pytest.mark.parametrize("build, feature", [
    (lambda tmp: _mistral(tmp, 64), "a sliding window of 64 tokens (sliding_window)"),
    (_gemma2, "attention logit soft-capping (attn_logit_softcapping=50.0)"),
    (lambda tmp: _qwen2_sliding(tmp, 1), "a sliding window of 64 tokens on 1 of 2 layers"),
])
def test_plan_and_preflight_refuse_attention_dacp_cannot_compute(tmp_path, capsys, build, feature) -> None:
    model = build(tmp_path)
    overrides = (f"model.name_or_path={model}", "model.random_init=true")
    start = time.perf_counter()
    code, err = _plan(tmp_path, capsys, *overrides)
    seconds = time.perf_counter() - start
    assert code == 2, err
    assert err.count("\n") == 1 and f"model.name_or_path={model!r}" in err and feature in err, err
    assert seconds < 10, f"plan took {seconds:.1f} s to refuse"
    with pytest.raises(ConfigError, match="needs math the DACP training path cannot compute") as refused:
        preflight(_config(tmp_path, *overrides))
    assert feature in str(refused.value) and model in str(refused.value)


def test_gemma2_names_every_feature_and_the_logit_cap(tmp_path: Path) -> None:
    from transformers import Gemma2Config

    hf = Gemma2Config(**SMALL).to_dict()
    found = attention_problems(hf, max_len=8192)
    assert [f.split(" (")[0] for f in found] == ["a sliding window of 4096 tokens on 1 of 2 layers",
                                                 "attention logit soft-capping"]
    with pytest.raises(ConfigError, match=r"final logit soft-capping \(final_logit_softcapping=30.0\)"):
        check_model_support(_config(tmp_path, f"model.name_or_path={_gemma2(tmp_path)}",
                                    "model.random_init=true"))


def test_a_window_at_least_the_max_sequence_length_is_full_causal_attention(tmp_path, capsys) -> None:
    # tiny-cpu: data.max_length 1024; a 1024-token window covers every sequence the run accepts.
    for model in (_mistral(tmp_path, 1024), _qwen2_sliding(tmp_path, 2)):
        overrides = (f"model.name_or_path={model}", "model.random_init=true", "model.vocab_size=152000")
        code, err = _plan(tmp_path, capsys, *overrides)
        assert code == 0, err
        check_model_support(_config(tmp_path, *overrides))
    code, err = _plan(tmp_path, capsys, f"model.name_or_path={_mistral(tmp_path, 1024)}",
                      "model.random_init=true", "data.max_length=2048", "scheduling.bucket_size=2048")
    assert code == 2 and "shorter than the run's max sequence length 2048" in err, err


def test_other_attention_features_are_refused() -> None:
    full = {"model_type": "llama", "num_hidden_layers": 2}
    assert attention_problems(full, 4096) == []
    cases = {
        "chunked attention of 512 tokens": {"attention_chunk_size": 512},
        "learned attention sinks": {"model_type": "gpt_oss"},
        "bidirectional attention": {"use_bidirectional_attention": True},
        "ALiBi attention biases": {"alibi": True},
        "not softmax attention (layer_types: linear_attention)": {
            "layer_types": ["linear_attention", "full_attention"]},
        "attention dropout (attention_dropout=0.1": {"attention_dropout": 0.1},
    }
    for feature, keys in cases.items():
        found = attention_problems({**full, **keys}, 4096)
        assert len(found) == 1 and feature in found[0], (keys, found)
    off = {"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0}  # Qwen2.5 as shipped
    assert attention_problems({**full, **off}, 4096) == []


def test_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path, capsys) -> None:
    from transformers import LlamaConfig

    from app.data.tokenizer import load_tokenizer
    from app.model.support import largest_token_id

    largest = largest_token_id(load_tokenizer("qwen"))  # the Qwen2.5 specials end at 151850
    assert 151643 < largest < 151936
    model = _model_dir(tmp_path, LlamaConfig(vocab_size=32000, **SMALL))
    overrides = (f"model.name_or_path={model}", "model.random_init=true")
    start = time.perf_counter()
    code, err = _plan(tmp_path, capsys, *overrides)
    seconds = time.perf_counter() - start
    assert code == 2, err
    for part in ("data.tokenizer='qwen'", f"model.name_or_path={model!r}", "vocab_size 32000",
                 f"emits token ids up to {largest} ({largest + 1} ids, special and added tokens included)"):
        assert part in err, err
    assert seconds < 10, f"plan took {seconds:.1f} s to refuse"
    with pytest.raises(ConfigError, match="ids >= 32000 have no embedding"):
        preflight(_config(tmp_path, *overrides))
    # model.vocab_size resizes a random-init config: then the Qwen ids fit
    check_model_support(_config(tmp_path, *overrides, "model.vocab_size=151936"))
    with pytest.raises(ConfigError, match=r"vocab_size 1000 \(model.vocab_size\)"):
        check_model_support(_config(tmp_path, "model.vocab_size=1000"))  # a tiny preset, too small


def _repo_configs() -> list[Path]:
    return sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "hardware")


@pytest.mark.parametrize("path", _repo_configs(), ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_the_repos_own_configs_pass(tmp_path: Path, path: Path) -> None:
    from app.profiling.budget import resolve_bucket_size

    overrides = [f"run.storage_path={tmp_path / 'runs'}"]
    if load_config(path).data.source == "path":  # a cluster's dataset: train.activation_checkpointing=auto
        overrides.append("data.source=synthetic")  # times its candidates on sampled lengths (plan's)
    config, _ = resolve_bucket_size(load_config(path, overrides))
    # a tiny preset, a hub id, or one of the repo's own model directories (configs/models/: config.json only)
    assert model_config_dict(config.model) is None or config.model.name_or_path.startswith(
        ("Qwen/", "configs/models/"))
    check_model_support(config)


@pytest.mark.parametrize("tokenizer", ["qwen", "configs/bench/synth-bpe-773.json"])
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])
def test_tiny_presets_take_their_vocabulary_from_the_tokenizer(tmp_path, preset, tokenizer) -> None:
    check_model_support(_config(tmp_path, f"model.name_or_path={preset}", f"data.tokenizer={tokenizer}"))


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_length_dependent_rope_is_exact_only_up_to_its_original_context(kind) -> None:
    from app.model.support import attention_problems

    hf = {"model_type": "phi3", "original_max_position_embeddings": 4096,
          "rope_scaling": {"rope_type": kind, "short_factor": [1.0], "long_factor": [2.0]}}
    assert attention_problems(hf, 4096) == []
    (problem,) = attention_problems(hf, 4097)
    assert f"{kind} RoPE scaling (rope_scaling)" in problem and "4096" in problem
    assert attention_problems({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 10**6) == []
