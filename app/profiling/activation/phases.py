"""A micro-batch's activation memory as phases: the most that is live at once, linear in its tokens T.

    kept_l     what decoder layer l keeps after its forward: its saved set S (LayerBytes.saved), or, when it
               recomputes, only its input (e h; nothing with offload: the input is in host memory)
    loss       the end of the forward, while the loss runs:
                   sum_l kept_l + head.kept + head.loss_extra   per token
                   head.loss_fixed                              fixed (chunk temporaries, head gradient)
    final norm the final norm's backward, every layer's kept tensors still alive:
                   sum_l kept_l + head.kept - the loss's saved input gradient + head.norm_backward
                   head.head_grad                               fixed
    backward   layer l's backward, for the l where it is largest (the last recomputed one, or the last):
                   sum_{j<=l} kept_j + head.after_loss + S - shared_input [+ e h offloaded]   (l recomputes)
                   + LayerBytes.backward_extra                  per token
                   head.head_grad                               fixed (the LM head's gradient)
    peak(T)    max over the phases of fixed + per_token * T

Each phase is counted only while it is live: the loss's chunk temporaries never meet a recompute (the loss
runs before the first backward), and only one layer recomputes at a time. Other moments (a layer's own
forward, the final norm's backward, the attention's backward) hold less than one of these two.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.profiling.activation.checkpointing import Checkpointing
from app.profiling.activation.kernel_set import KernelSet
from app.profiling.activation.shape import ModelShape


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    fixed: float
    """Bytes that do not grow with the micro-batch's tokens (the loss's, the LM head's gradient)."""
    per_token: float

    def at(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens

    def as_json(self) -> dict[str, float | str]:
        return {"name": self.name, "fixed": self.fixed, "per_token": self.per_token}


@dataclass(frozen=True, slots=True)
class PassMemory:
    """One micro-batch's forward + backward: what the forward keeps and the phases of its peak."""

    kept_per_token: float
    """Bytes per token the forward (loss included) keeps for the backward: the ledger's measure."""
    phases: tuple[Phase, ...]

    def peak(self, tokens: float) -> float:
        return max(p.at(tokens) for p in self.phases)

    def phase_at(self, tokens: float) -> Phase:
        """The phase holding the most at `tokens` (the loss's on a tie: it comes first)."""
        return max(self.phases, key=lambda p: p.at(tokens))


def pass_memory(shape: ModelShape, kernels: KernelSet, setting: Checkpointing,
                loss_chunk_tokens: int) -> PassMemory:
    """The module docstring's phases for `shape` under a kernel set and checkpointing setting."""
    layer, head = kernels.layer(shape), kernels.head(shape, loss_chunk_tokens)
    inp = float(shape.element * shape.hidden)
    recomputes = [setting.recomputes(i) for i in range(shape.layers)]
    kept = [(0.0 if setting.offload else inp) if r else layer.saved for r in recomputes]
    total = sum(kept) + head.kept
    loss = Phase("loss", head.loss_fixed, total + head.loss_extra)
    norm = Phase("final norm backward", head.head_grad,
                 total - head.parts.get("loss_input_grad", 0.0) + head.norm_backward)
    below, worst = 0.0, 0.0
    for i, recompute in enumerate(recomputes):
        below += kept[i]
        rebuilt = layer.saved - layer.shared_input + (inp if setting.offload else 0.0) if recompute else 0.0
        worst = max(worst, below + rebuilt)
    backward = Phase("backward", head.head_grad, worst + head.after_loss + layer.backward_extra)
    return PassMemory(kept_per_token=total, phases=(loss, norm, backward))
