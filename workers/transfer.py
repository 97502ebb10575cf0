"""Host -> device copies that never make the host wait.

A copy from pageable host memory to a CUDA device is synchronous (the host blocks until the device has
the data). From pinned memory with `non_blocking=True` it is only queued on the current stream, so the
host can run ahead and queue the step's kernels. Pinning needs a CUDA runtime, so it happens only when
the target is a CUDA device; anything else is a plain `.to`.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`: pinned and non-blocking when `device` is CUDA, a plain `.to` otherwise.

    The pinned buffer may be dropped right away: PyTorch's caching host allocator keeps it until the
    queued copy has run.
    """
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
