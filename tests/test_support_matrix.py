"""The architecture support matrix of docs/model-and-data.md: every supported architecture through verify's
parity at CP=2, every refused one refused by `python -m app verify` with exit 2 naming the feature.

Each model is transformers' own config class at tiny dimensions (hidden 64, 2 layers, 4 heads over 2 KV
heads, vocabulary 256) with random weights, written with save_pretrained and loaded back as a user's model
directory is (model.random_init false). The check is workers/tools/parity.py, what `verify` runs: the DACP
path's summed loss and every parameter gradient over 2 gloo ranks against the model's own forward
(transformers' "sdpa", one sequence at a time), fp32, verify's tolerance 1e-5. The lengths give a mixed
DACP plan: a 97-token sequence sharded over both ranks, the short ones (1 and 2 tokens included) whole on
one rank. All architectures share one spawn of the 2 ranks (run_parities): a spawn, not a model, is most
of a tiny check's time.

Windowed models (Gemma-3, Phi-3) get a window exactly as long as the longest sequence: the longest window
app/model/support.py accepts, where a window off by one token from transformers' own would show.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.__main__ import main
from app.model.support import attention_problems, logit_problems
from workers.tools.parity import TOLERANCE, ParitySpec, run_parities

LENGTHS = (1, 2, 13, 5, 97, 40)
LONGEST = max(LENGTHS)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Every model's dimensions; the special ids inside the tiny vocabulary (Phi-3's defaults are 32000)."""


def _llama3():
    from transformers import LlamaConfig

    # Llama 3.1's rope scaling, its original context shrunk so the scaled frequencies matter at 97 tokens.
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    return LlamaConfig(**TINY, rope_scaling=rope)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**TINY, tie_word_embeddings=True)  # Qwen2.5-0.5B's tied head, q/k/v biases


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**TINY, head_dim=32)  # q/k RMSNorm; head_dim != hidden / heads


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**TINY, sliding_window=None)  # v0.2 and later


def _gemma():
    from transformers import GemmaConfig

    return GemmaConfig(**TINY, head_dim=16)  # sqrt(hidden) embedding scale, (1 + w) RMSNorm, tied head


def _gemma3():
    from transformers import Gemma3TextConfig

    # scaling = query_pre_attn_scalar ** -0.5 (256: not head_dim's), q/k norm, local/global rope bases.
    return Gemma3TextConfig(**TINY, head_dim=16, sliding_window=LONGEST,
                            layer_types=["sliding_attention", "full_attention"])


def _phi3():
    from transformers import Phi3Config

    return Phi3Config(**TINY, sliding_window=LONGEST)  # fused qkv_proj and gate_up_proj


SUPPORTED: dict[str, Callable[[], Any]] = {
    "llama-3": _llama3, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "gemma": _gemma,
    "gemma-3": _gemma3, "phi-3": _phi3,
}


def _gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(**TINY, head_dim=16)  # its defaults: attention and final logit soft-capping


def _phi3_mini_4k():
    from transformers import Phi3Config

    return Phi3Config(**TINY, sliding_window=2047)  # Phi-3-mini-4k-instruct's config.json


REFUSED: dict[str, tuple[Callable[[], Any], int, tuple[str, ...]]] = {
    "gemma-2": (_gemma2, LONGEST, ("attention logit soft-capping (attn_logit_softcapping=50.0)",
                                   "final logit soft-capping (final_logit_softcapping=30.0)")),
    "phi-3-mini-4k": (_phi3_mini_4k, 4096, ("a sliding window of 2047 tokens (sliding_window)",)),
    "gemma-3-past-its-window": (_gemma3, LONGEST + 1, (f"a sliding window of {LONGEST} tokens on 1 of 2 "
                                                       "layers (sliding_window)",)),
}
"""name: (config, the longest --lengths, what the refusal names)."""


def _save(config, out: Path) -> str:
    """A random-init model of `config` saved as a model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """name: run_parity's result, every architecture over one spawn of 2 gloo ranks."""
    root = tmp_path_factory.mktemp("models")
    dirs = {name: _save(make(), root / name) for name, make in SUPPORTED.items()}
    specs = [ParitySpec(model=path, lengths=LENGTHS, cp_size=2, distribute="auto") for path in dirs.values()]
    results = run_parities(specs, backend="gloo")
    return dict(zip(dirs, results, strict=True))


@pytest.mark.parametrize("name", SUPPORTED)
def test_model_support_accepts_the_architecture_at_these_lengths(tmp_path: Path, name: str) -> None:
    """What preflight and `plan` decide from config.json: nothing refused up to LONGEST tokens, and a
    window refused one token further (the parity below then checks the longest window accepted)."""
    SUPPORTED[name]().save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert attention_problems(hf, LONGEST) + logit_problems(hf) == []
    if hf.get("sliding_window"):
        assert "sliding window" in " ".join(attention_problems(hf, LONGEST + 1))
    if name == "llama-3":  # the rope scaling the row claims is in the model checked
        assert (hf.get("rope_parameters") or hf.get("rope_scaling"))["rope_type"] == "llama3", hf


@pytest.mark.slow  # starts 2 processes (gloo ranks), as every parity test does
@pytest.mark.parametrize("name", SUPPORTED)
def test_architecture_matches_its_own_forward_at_cp2(parity, name: str) -> None:
    result = parity[name]
    plan = result["plan"]
    assert plan["distributed"] and any(plan["local"]), plan  # sharded and whole sequences both
    summary = {k: result[k] for k in ("loss_abs_diff", "grad_max_rel_diff", "tolerance")}
    assert result["ok"] and result["tolerance"] == TOLERANCE["fp32"], summary
    assert result["grad_max_rel_diff"] <= TOLERANCE["fp32"], summary


@pytest.mark.parametrize("name", REFUSED)
def test_verify_refuses_what_dacp_cannot_compute(tmp_path: Path, capsys, name: str) -> None:
    make, longest, features = REFUSED[name]
    path = str(tmp_path / "model")
    make().save_pretrained(path)  # config.json is all verify reads before refusing
    lengths = f"3,{longest}"
    assert main(["verify", "--model", path, "--cp", "2", "--lengths", lengths, "--backend", "gloo"]) == 2
    err = capsys.readouterr().err
    assert f"--model {path!r}" in err and f"--lengths up to {longest}" in err, err
    for feature in features:
        assert feature in err, err
