"""DACP attention: varlen kernels (CPU torch / CUDA flash-attn), zigzag ring CP, the HF integration."""

from workers.attention.dacp import dacp_attention
from workers.attention.hf import ATTENTION_NAME, register_dacp_attention
from workers.attention.kernels import VarlenKernel, get_kernel, kernel_for
from workers.attention.layout import DacpLayout

__all__ = [
    "ATTENTION_NAME", "DacpLayout", "VarlenKernel", "dacp_attention", "get_kernel", "kernel_for",
    "register_dacp_attention",
]
