"""What a forward keeps for its backward, counted by autograd's saved-tensor hooks: the distinct storages
(not the parameters') they receive. They see every save, a compiled graph's and a custom Function's (liger's)
too, which the tensor ledger (workers/tools/tensor_ledger.py) cannot: a compiled graph allocates outside the
dispatcher it watches."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the storages saved while `forward()` runs (it returns the loss); the backward runs after it,
    so that compiled graphs and liger's Functions free what they saved."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    loss.backward()
    return sum(seen.values())
