"""Device memory of one forward+backward by tensor accounting: what a forward keeps, its peak, and what
activation offload leaves on the device.

    ledger = DeviceLedger()
    with ledger, offload_counted_as_host(ledger):
        micro_batch_loss_sum(model, batch).backward()
    ledger.peak        bytes: the largest sum of live tensor storages created inside, host copies excluded

    pass_ledger(model, batch) -> PassLedger(kept, peak)
        kept           bytes created by the forward (the loss included) that are still alive when it
                       returns: what autograd saved for the backward and what the checkpoints hold
        peak           the ledger's peak over the forward and the backward

Every storage a dispatched op creates is counted from its creation to its release (a weakref finalizer),
once per storage (views share theirs). transformers' activation offload (`activation_checkpointing_enable(
offload=True)`) wraps each recomputed layer in torch's `save_on_cpu`, which copies the tensors autograd
saves for that layer (its inputs) to host memory; on a GPU they then leave the device. On a CPU-only
host device and host are one memory, so the allocator or RSS cannot see the difference, and torch's
save_on_cpu cannot run there as transformers calls it (pinned memory needs an accelerator). The ledger
therefore swaps transformers' `save_on_cpu` for one that makes the same host copy, unpinned, and counts
it as host memory: the peak is what the device would hold. The model's parameters and buffers are not
counted (they existed before the pass; `exclude`); gradients created during it are.

Used for the measurement of docs/benchmarks.md and tests/test_memory_model.py; CUDA's own allocator
counters (workers/tools/profile_memory.py) measure the same on a GPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class DeviceLedger(TorchDispatchMode):
    """Live and peak bytes of the storages created while it is active, minus those marked host."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._host: set[int] = set()

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._sizes:
            return
        self._sizes[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        if key in self._host:
            self._host.discard(key)
        else:
            self.live -= size

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (a model's parameters and buffers, which a pass reaches
        through views such as a weight's transpose: they existed before it)."""
        for tensor in tensors:
            self._sizes.setdefault(tensor.untyped_storage().data_ptr(), 0)

    def mark_host(self, tensor: torch.Tensor) -> None:
        """`tensor`'s storage lives in host memory: no longer counted as device memory."""
        key = tensor.untyped_storage().data_ptr()
        if key in self._sizes and key not in self._host:
            self._host.add(key)
            self.live -= self._sizes[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._count, out)
        return out


@contextmanager
def offload_counted_as_host(ledger: DeviceLedger) -> Iterator[None]:
    """transformers' offload with its host copies counted as host memory by `ledger` (module docstring)."""
    import transformers.modeling_utils as modeling_utils

    class CountedSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
                packed = tensor.to("cpu", copy=True)
                ledger.mark_host(packed)
                return tensor.device, packed

            def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
                device, tensor = packed
                return tensor.to(device)

            super().__init__(pack, unpack)

    original = modeling_utils.save_on_cpu
    modeling_utils.save_on_cpu = CountedSaveOnCpu
    try:
        yield
    finally:
        modeling_utils.save_on_cpu = original


def peak_device_bytes(model: torch.nn.Module, batch: Any, *, loss_chunk_tokens: int = 4096) -> int:
    """The ledger's peak over one forward+backward of `batch` (a RankBatch) through the chunked loss."""
    from workers.forward import micro_batch_loss_sum

    ledger = DeviceLedger()
    ledger.exclude([*model.parameters(), *model.buffers()])
    with ledger, offload_counted_as_host(ledger):
        micro_batch_loss_sum(model, batch, loss_chunk_tokens=loss_chunk_tokens).backward()
    return ledger.peak


@dataclass(frozen=True, slots=True)
class PassLedger:
    """One forward+backward by the ledger (module docstring)."""

    kept: int
    peak: int


def pass_ledger(model: torch.nn.Module, batch: Any, *, loss_chunk_tokens: int = 4096) -> PassLedger:
    """What the forward of `batch` (a RankBatch) through the chunked loss keeps, and the pass's peak."""
    from workers.forward import micro_batch_loss_sum

    ledger = DeviceLedger()
    ledger.exclude([*model.parameters(), *model.buffers()])
    with ledger, offload_counted_as_host(ledger):
        loss = micro_batch_loss_sum(model, batch, loss_chunk_tokens=loss_chunk_tokens)
        kept = ledger.live
        loss.backward()
    return PassLedger(kept=kept, peak=ledger.peak)
