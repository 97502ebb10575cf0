"""DACP attention: varlen kernels (CPU torch / CUDA flash-attn), zigzag ring CP, the HF integration."""

from workers.attention.dacp import dacp_attention
from workers.attention.hf import ATTENTION_NAME, register_dacp_attention
from workers.attention.index import DacpIndex, VarlenBlock
from workers.attention.kernels import BACKENDS, VarlenKernel, make_kernel
from workers.attention.layout import DacpLayout
from workers.attention.runtime import AttentionRuntime

__all__ = [
    "ATTENTION_NAME", "BACKENDS", "AttentionRuntime", "DacpIndex", "DacpLayout", "VarlenBlock",
    "VarlenKernel", "dacp_attention", "make_kernel", "register_dacp_attention",
]
