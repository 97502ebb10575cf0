"""The CUDA caching allocator's settings for a training process: expandable segments, unless the user
configured the allocator.

A packed micro-batch has a different token count every time, so its activations are blocks of ever
different sizes; with fixed-size segments the cache fragments and reserves far more than it allocates
(or fails to find a block although the memory is free in pieces). Expandable segments map more memory into
one growing segment instead (PyTorch's CUDA memory notes). A user's PYTORCH_CUDA_ALLOC_CONF (or its newer
name PYTORCH_ALLOC_CONF) wins; set before the first CUDA allocation, the setting applies to every segment.
"""

from __future__ import annotations

import os

SETTING = "expandable_segments:True"
USER_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Turn expandable segments on unless the user set the allocator; True when this call set it."""
    if any(os.environ.get(name) for name in USER_VARIABLES):
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = SETTING
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # the variable is read at CUDA init
        torch.cuda.memory._set_allocator_settings(SETTING)
    return True
