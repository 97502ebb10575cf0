"""The liger-loss kernel set, what `model.kernels: auto` runs under train.compile on CUDA: transformers' own
RMSNorm, gated MLP and RoPE in the decoder layers, which the compiler fuses itself (workers/compile.py),
and liger-kernel's fused linear cross-entropy for the loss, which runs outside the compiled layers
(workers/kernels/liger_set.py `liger_linear_ce`: the label rows only, the sum reduction, fp32 accumulation).

The loss is where the two routes differ most outside the layers: the torch set's chunked loss
(workers/loss.py) makes several fp32 passes over each chunk's [rows, vocabulary] logits, liger's computes
the logits' gradient in place chunk by chunk during the forward.
"""

from __future__ import annotations

import torch

from workers.kernels.liger_set import liger_linear_ce
from workers.kernels.torch_set import TorchKernels
from workers.loss import LOSS_HEAD


class LigerLossKernels(TorchKernels):
    """The torch set (its RoPE activated), with liger's loss."""

    name = "liger_loss"

    def apply(self, model: torch.nn.Module) -> None:
        getattr(model, LOSS_HEAD).linear_ce = liger_linear_ce
