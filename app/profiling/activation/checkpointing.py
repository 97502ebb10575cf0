"""A checkpointing setting: which decoder layers recompute in backward, and where their inputs wait."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Checkpointing:
    """every = 0: nothing recomputed; n >= 1: layers 0, n, 2n, ... (transformers' every_n_layers) recompute,
    keeping only their input, in host memory with `offload`."""

    every: int = 0
    offload: bool = False

    def __post_init__(self) -> None:
        if self.every < 0 or (self.offload and not self.every):
            raise ValueError(f"checkpointing every={self.every} offload={self.offload}: offload applies to "
                             "recomputed layers (every >= 1)")

    def recomputes(self, layer: int) -> bool:
        return bool(self.every) and layer % self.every == 0

    def recomputed_layers(self, layers: int) -> int:
        """c = ceil(L / n): how many of `layers` recompute."""
        return -(-layers // self.every) if self.every else 0

    @property
    def name(self) -> str:
        """off | every layer | every 2nd layer | ..., with ` + offload`."""
        if not self.every:
            return "off"
        n = self.every
        suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
        what = "every layer" if n == 1 else f"every {n}{suffix} layer"
        return what + (" + offload" if self.offload else "")

    def train_values(self) -> dict[str, bool | int]:
        """The train section's keys that select this setting."""
        return {"activation_checkpointing": bool(self.every),
                "activation_checkpointing_every": self.every or 1, "activation_offload": self.offload}
