"""The liger kernel set: liger-kernel's fused Triton kernels (CUDA) for RMSNorm, SwiGLU, RoPE and the
linear cross-entropy, through its functional API (liger_kernel.transformers.functional; the loss through its
ops module).

Module instances are patched in place (their parameters stay, so state dicts, checkpoints and ZeRO's
partitioning are unchanged): every RMSNorm of the decoder runs `liger_rms_norm` (llama casting: the
normalization in fp32, the weight applied in the input's dtype, as transformers' Llama/Qwen2 RMSNorm), every
gated MLP `down_proj(liger_swiglu(gate_proj(x), up_proj(x)))`. RoPE is the family's module-level function
(workers/kernels/rope.py). The loss is liger's fused linear cross-entropy over the label rows only, with
the sum reduction the product's normalization needs (workers/step.py divides by the global batch's label
tokens) and fp32 accumulation of the head's gradient, its backward without liger's host synchronization
(workers/kernels/liger_linear_ce.py); its chunk is sized so that one chunk holds about
train.loss_chunk_tokens rows, as the torch set's chunks do (liger's default would cut a 150k vocabulary's
micro-batch into chunks of ~128 rows, GEMMs too thin for a GPU).
"""

from __future__ import annotations

import math
import types

import torch

from workers.kernels.liger_linear_ce import LinearCrossEntropySum
from workers.kernels.rope import install_rope
from workers.loss import LOSS_HEAD

RMS_NORM_CLASS_SUFFIX = "RMSNorm"


def _functional():
    from liger_kernel.transformers import functional

    return functional


def liger_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-6)
    return _functional().liger_rms_norm(hidden_states, self.weight, eps, 0.0, "llama", True)


def liger_swiglu_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_functional().liger_swiglu(self.gate_proj(x), self.up_proj(x)))


def liger_linear_ce(hidden_TE: torch.Tensor, head: torch.nn.Linear, targets_T: torch.Tensor,
                    chunk_tokens: int = 4096, *, label_rows: torch.Tensor) -> torch.Tensor:
    """fp32 sum of CE(head(hidden[t]), targets[t]) over the label rows (workers/loss.py's contract)."""
    hidden = hidden_TE.index_select(0, label_rows)
    targets = targets_T.index_select(0, label_rows)
    vocab, width = head.weight.shape
    # liger's chunk: next_pow2(rows / ceil(V / (k * H))) rows; k makes it ~chunk_tokens rows.
    per_chunk = max(1, math.ceil(hidden.shape[0] / max(chunk_tokens, 1)))
    mem_const = max(1, math.ceil(vocab / (width * per_chunk)))
    return LinearCrossEntropySum.apply(hidden, head.weight, head.bias, targets, mem_const).float()


def _is_rms_norm(module: torch.nn.Module) -> bool:
    named = type(module).__name__.endswith(RMS_NORM_CLASS_SUFFIX)
    return named and getattr(module, "weight", None) is not None


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")) and act in ("silu",
                                                                                                  "swish")


class LigerKernels:
    name = "liger"

    def apply(self, model: torch.nn.Module) -> None:
        for module in model.get_decoder().modules():
            if _is_rms_norm(module):
                module.forward = types.MethodType(liger_rms_norm_forward, module)
            elif _is_gated_mlp(module):
                module.forward = types.MethodType(liger_swiglu_forward, module)
        getattr(model, LOSS_HEAD).linear_ce = liger_linear_ce

    def activate(self, model: torch.nn.Module) -> None:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        install_rope(model, liger_rotary_pos_emb)
