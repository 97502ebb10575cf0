"""liger-kernel's own kernels on CPU, under Triton's interpreter: run by tests/test_liger_interpreted.py as
`python tests/liger_interpreted.py` with TRITON_INTERPRET=1 and the side directory scripts/setup.sh installs
(triton 3.6.0, liger-kernel 0.8.5) on PYTHONPATH, in a process of its own (the interpreter is chosen when
liger's kernels are defined, at its import; the suite's own process keeps liger uninstalled). Prints one
JSON line:

    sets       {"liger" | "liger_loss": {"loss", "reference_loss", "worst_grad", "calls"}}: one fp32
               micro-batch of a tiny Qwen2 through each kernel set against the torch set (transformers'
               RMSNorm, SwiGLU MLP and RoPE, workers/loss.py's chunked loss), a gradient of 0.37 x loss;
               worst_grad: the largest over parameters of max |g - g_torch| / max |g_torch|; calls: how
               often each liger function ran
    kept       {"torch" | "liger" | "liger, recompute every 2": {"kept", "modeled"}}: bytes per token a bf16
               forward and loss of the same model keep for the backward (tests/saved_tensors.py: autograd's
               saved-tensor hooks, which see liger's Functions' saves) against the memory model's count
               (app/profiling/activation/); the interpreter's bf16 values are wrong
               (tests/test_liger_interpreted.py), its saves are liger's Python's own. Not every layer
               recomputed: the hooks miss part of what the checkpoints hold then (the torch set here: 780
               bytes per token by the hooks, 860 by the tensor ledger, 868 modeled)
    linear_ce  workers/kernels/liger_linear_ce.py against liger's own LigerFusedLinearCrossEntropyFunction
               (same chunking), a gradient of 0.37: "equal" (loss and both gradients bit for bit), and the
               loss's relative difference from torch's cross_entropy of the full logits
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import triton_interpreter  # noqa: E402

triton_interpreter.enable()

import numpy as np  # noqa: E402
import torch  # noqa: E402

SPEC = {"name_or_path": "tiny-qwen2", "vocab_size": 512, "hidden_size": 64, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "seed": 3,
        "dtype": "fp32"}
SCALE = 0.37
CALLS: Counter[str] = Counter()


def _count(module: Any, name: str) -> None:
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)


def _batch() -> Any:
    from scheduling import DacpPlan
    from scheduling.payload import IGNORE_INDEX
    from workers.batch import build_rank_batch

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 512, size=n) for n in (30, 7, 64)]
    labels = [i.copy() for i in ids]
    for lab in labels:
        lab[: len(lab) // 3] = IGNORE_INDEX
    return build_rank_batch(DacpPlan(local=((0, 1, 2),), distributed=()), ids, labels, cp_rank=0, cp_size=1)


def _loss_and_grads(name: str) -> tuple[float, list[torch.Tensor]]:
    from workers.forward import micro_batch_loss_sum
    from workers.kernels import kernel_set
    from workers.models import build_model

    model = build_model(**SPEC)
    kernels = kernel_set(name)
    kernels.apply(model)
    kernels.activate(model)
    loss = micro_batch_loss_sum(model, _batch(), loss_chunk_tokens=16)
    (loss * SCALE).backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def kernel_sets() -> dict[str, dict[str, Any]]:
    import liger_kernel.ops.fused_linear_cross_entropy as flce
    import liger_kernel.transformers.functional as functional
    import liger_kernel.transformers.rope as rope

    for module, name in ((functional, "liger_rms_norm"), (functional, "liger_swiglu"),
                         (rope, "liger_rotary_pos_emb"), (flce, "fused_linear_cross_entropy_forward")):
        _count(module, name)
    reference_loss, reference = _loss_and_grads("torch")
    result = {}
    for name in ("liger", "liger_loss"):
        CALLS.clear()
        loss, grads = _loss_and_grads(name)
        worst = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, reference, strict=True))
        result[name] = {"loss": loss, "reference_loss": reference_loss, "worst_grad": worst,
                        "calls": dict(CALLS)}
    return result


def kept_per_token() -> dict[str, dict[str, float]]:
    from app.profiling.activation import Checkpointing, pass_memory, shape_from_hf
    from app.profiling.activation import kernel_set as modeled_set
    from tests.saved_tensors import kept_per_token as measured
    from workers.kernels import kernel_set
    from workers.models import build_model

    result = {}
    for name, every in (("torch", 0), ("liger", 0), ("liger", 2)):
        model = build_model(**{**SPEC, "dtype": "bf16"}, activation_checkpointing=every > 0,
                            activation_checkpointing_every=max(every, 1))
        kernel_set(name).apply(model)
        kernel_set(name).activate(model)
        shape = shape_from_hf(model.config.to_dict(), element=2)
        modeled = pass_memory(shape, modeled_set(name), Checkpointing(every), 512).kept_per_token
        key = name if not every else f"{name}, recompute every {every}"
        result[key] = {"kept": measured(model, torch.device("cpu"), (64, 128)), "modeled": modeled}
    return result


def linear_ce() -> dict[str, Any]:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from workers.kernels.liger_linear_ce import LinearCrossEntropySum

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 64, generator=generator)
    weight = torch.randn(300, 64, generator=generator) * 0.1
    targets = torch.randint(0, 300, (37,), generator=generator)

    def run(loss_fn: Any) -> tuple[torch.Tensor, ...]:
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_fn(x, w)
        (loss * SCALE).backward()
        return loss.detach(), x.grad, w.grad

    ours = run(lambda x, w: LinearCrossEntropySum.apply(x, w, None, targets, 2))
    ligers = run(lambda x, w: liger_fused_linear_cross_entropy(
        x, w, targets, reduction="sum", accum_dtype=torch.float32, chunk_mem_const=2))
    reference = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    return {"equal": all(torch.equal(a, b) for a, b in zip(ours, ligers, strict=True)),
            "loss_vs_torch": float((ours[0] - reference).abs() / reference.abs())}


if __name__ == "__main__":
    print(json.dumps({"sets": kernel_sets(), "kept": kept_per_token(), "linear_ce": linear_ce()}))
