"""Helpers of tests/test_export.py and tests/test_lora.py: load an export in a fresh Python process.

The fresh process imports only transformers / peft (the base of a LoRA adapter is the run's tiny preset,
which exists on no hub, so `workers.models.build_model` rebuilds it there with "sdpa" attention): nothing
of the training process (the registered "dacp" attention, loaded modules) can leak into what it loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

FRESH_PROCESS = r"""
import json, sys
import torch
args = json.loads(sys.argv[1])
sequences = args["sequences"]
result = {}
with torch.no_grad():
    for key, directory in args["models"].items():
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        result[key] = {"attn": model.config._attn_implementation, "dtype": str(model.dtype),
                       "logits": [model(input_ids=torch.tensor([s])).logits[0].float() for s in sequences]}
    for key, (directory, base_kwargs) in args["adapters"].items():
        from peft import PeftModel
        from workers.models import build_model
        base = build_model(**base_kwargs, attn_implementation="sdpa")
        model = PeftModel.from_pretrained(base, directory).eval()
        result[key] = {"attn": base.config._attn_implementation, "dtype": str(base.dtype),
                       "logits": [model(input_ids=torch.tensor([s])).logits[0].float() for s in sequences]}
    if args.get("tokenizer"):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args["tokenizer"])
        chat = tok.apply_chat_template(args["messages"], tokenize=True)
        result["text_ids"] = [tok.encode(t, add_special_tokens=False) for t in args["texts"]]
        result["chat_ids"] = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
        result["eos_token"] = tok.eos_token
torch.save(result, args["out"])
"""


def load_in_fresh_process(tmp: Path, sequences: list[list[int]], *, models: dict[str, str] | None = None,
                          adapters: dict[str, tuple[str, dict]] | None = None, tokenizer: str | None = None,
                          texts: list[str] = (), messages: list[dict] = ()) -> dict[str, Any]:
    """Run FRESH_PROCESS; returns {key: {attn, dtype, logits}, text_ids, chat_ids, eos_token}."""
    out = tmp / "fresh.pt"
    args = {"models": models or {}, "adapters": adapters or {}, "sequences": sequences, "out": str(out),
            "tokenizer": tokenizer, "texts": list(texts), "messages": list(messages)}
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, json.dumps(args)], capture_output=True,
                          text=True, check=False, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def random_sequences(vocab_size: int, lengths: tuple[int, ...] = (3, 17, 64), seed: int = 0) -> list[list]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def reference_logits(model: torch.nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).logits[0].float() for s in sequences]


def max_relative_diff(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """max over sequences of max|a - b| / max|b| (relative to the largest reference logit)."""
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, reference, strict=True))
