"""The decoder's elementwise kernels and the loss, one module per kernel set, behind one registry.

    KERNEL_SETS["torch"]   transformers' own RMSNorm / gated MLP / RoPE, workers/loss.py's chunked linear CE
    KERNEL_SETS["liger"]   liger-kernel's fused Triton kernels for the same four (CUDA only)
    KERNEL_SETS["liger_loss"]  transformers' modules in the layers, liger's fused linear cross-entropy for
                           the loss (CUDA only): `auto` under train.compile, whose compiler fuses the layers

A set is applied once to a built model (`apply`: patches module instances, sets the loss head's linear
cross-entropy), and `activate`d in the process before the model runs: RoPE is a module-level function of
the model's transformers modeling module, called by every attention module of that family, so the set
whose model runs next must be the one installed there (one model per process in training; `bench step`
activates each variant's set before its step).

`model.kernels: auto` resolves, per worker, to liger when the worker's device is CUDA, liger-kernel
imports and the model's family is one liger's functions cover here (liger_loss under train.compile), else
torch.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from workers.presets import LIGER_FAMILIES as KERNEL_FAMILIES


class KernelSet(Protocol):
    name: str

    def apply(self, model: torch.nn.Module) -> None:
        """Patch `model` (a causal LM of workers/models.py, loss head attached) to this set's kernels."""

    def activate(self, model: torch.nn.Module) -> None:
        """Install this set's module-level functions (RoPE) for `model`'s family in this process."""


def liger_available() -> bool:
    """liger-kernel is installed (found, not imported: importing it imports Triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def kernels_problem(setting: str, *, on_gpu: bool, available: bool | None = None) -> str | None:
    """Why `model.kernels=setting` cannot run on these workers (naming the knob), or None."""
    if setting != "liger":
        return None
    if not on_gpu:
        return ("model.kernels=liger runs liger-kernel's Triton kernels, which need CUDA, but "
                "resources.gpus_per_worker=0: use model.kernels=torch (or auto) on CPU workers")
    if not (liger_available() if available is None else available):
        return ("model.kernels=liger needs liger-kernel, which is not installed: install the project's "
                "`gpu` extra (pip install -e '.[gpu]'), or use model.kernels=torch (or auto)")
    return None


def resolve_kernels(setting: str, device: torch.device, model_type: str, *, compile: bool = False) -> str:
    """The kernel set a worker on `device` runs for model.kernels=`setting` (ValueError naming the knob when
    liger is asked where it cannot run); `compile`: train.compile, under which `auto` leaves the layers'
    elementwise ops to the compiler and takes liger's loss alone (liger_loss) where liger would run."""
    if setting == "torch":
        return "torch"
    fits = model_type in KERNEL_FAMILIES
    problem = kernels_problem(setting, on_gpu=device.type == "cuda")
    if setting == "liger":
        if problem:
            raise ValueError(problem)
        if not fits:
            raise ValueError(f"model.kernels=liger covers the {', '.join(KERNEL_FAMILIES)} families; this "
                             f"model is {model_type!r}: use model.kernels=torch (or auto)")
        return "liger"
    if device.type == "cuda" and liger_available() and fits:
        return "liger_loss" if compile else "liger"
    return "torch"


def kernel_set(name: str) -> KernelSet:
    """The registered set `name` (its module is imported only when asked for: liger imports Triton)."""
    if name == "torch":
        from workers.kernels.torch_set import TorchKernels

        return TorchKernels()
    if name == "liger":
        from workers.kernels.liger_set import LigerKernels

        return LigerKernels()
    if name == "liger_loss":
        from workers.kernels.liger_loss_set import LigerLossKernels

        return LigerLossKernels()
    raise ValueError(f"model.kernels={name!r} is not one of: auto, torch, liger")
