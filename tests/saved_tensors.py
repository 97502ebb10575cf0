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


def kept_per_token(model: torch.nn.Module, device: torch.device, sizes: tuple[int, int]) -> float:
    """Bytes per token the forward and loss of a micro-batch keep: saved_bytes' slope between two
    micro-batches of `sizes` tokens, each four equal sequences, every token labeled (after one untimed pass
    at the smaller size: lazy inits, Triton's compiles and workspaces, stay out of the count)."""
    import numpy as np

    from scheduling import DacpPlan
    from workers.batch import build_rank_batch
    from workers.forward import micro_batch_loss_sum

    def saved(tokens: int) -> int:
        rng = np.random.default_rng(tokens)
        ids = [rng.integers(1, model.config.vocab_size, tokens // 4) for _ in range(4)]
        batch = build_rank_batch(DacpPlan(local=((0, 1, 2, 3),), distributed=()), ids, ids, cp_rank=0,
                                 cp_size=1).to(device)
        return saved_bytes(model, lambda: micro_batch_loss_sum(model, batch, loss_chunk_tokens=512))

    saved(sizes[0])
    small, large = saved(sizes[0]), saved(sizes[1])
    return (large - small) / (sizes[1] - sizes[0])
