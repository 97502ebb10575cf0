"""The torch kernel set: transformers' own modules and workers/loss.py's chunked linear cross-entropy."""

from __future__ import annotations

import torch

from workers.kernels.rope import install_rope, original_rope
from workers.loss import LOSS_HEAD, linear_cross_entropy_sum


class TorchKernels:
    name = "torch"

    def apply(self, model: torch.nn.Module) -> None:
        getattr(model, LOSS_HEAD).linear_ce = linear_cross_entropy_sum

    def activate(self, model: torch.nn.Module) -> None:
        install_rope(model, original_rope(model))
