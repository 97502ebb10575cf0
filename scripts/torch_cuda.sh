#!/usr/bin/env bash
# The pip arguments that install the CUDA build of torch 2.13.0 matching this machine's NVIDIA driver, one a
# line (scripts/setup.sh uses them); exits 1 with the reason on stderr when there is none.
#   bash scripts/torch_cuda.sh [CUDA]     CUDA: the driver's "CUDA Version" (default: read from nvidia-smi)
# The wheels carry CUDA's libraries, so nothing is compiled and no CUDA toolkit is needed; the driver only
# has to support the wheel's CUDA version:
#   driver CUDA >= 13.0      torch==2.13.0 from the package index (PyPI's 2.13.0 wheel is built for CUDA 13.0:
#                            its metadata requires cuda-toolkit 13.0.3; NVIDIA drivers R580 and newer)
#   driver CUDA 12.8 - 12.x  torch==2.13.0+cu128 from PyTorch's wheel index for CUDA 12.8
#   driver CUDA 12.6 - 12.7  torch==2.13.0+cu126 from PyTorch's wheel index for CUDA 12.6
#   older                    none: update the NVIDIA driver
# (PyPI's build was read from its metadata; the cu12x builds are those PyTorch's index usually carries, which
# this project's machines cannot see: where one is missing, scripts/setup.sh's install fails saying what to do.)
# SKRULL_TORCH_INDEX=<index URL> overrides the choice: torch==2.13.0 from that index (another cuXYZ build).
set -euo pipefail
version=2.13.0
cuda=${1:-$({ nvidia-smi 2>/dev/null || true; } | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)}
if [ -n "${SKRULL_TORCH_INDEX:-}" ]; then
  printf '%s\n' "torch==$version" --index-url "$SKRULL_TORCH_INDEX"
  exit 0
fi
if ! [[ "$cuda" =~ ^[0-9]+\.[0-9]+$ ]]; then
  echo "torch_cuda.sh: no CUDA version from nvidia-smi ('CUDA Version: X.Y' in its header; is the NVIDIA" \
    "driver loaded?): fix the driver, or set SKRULL_TORCH_INDEX to the PyTorch wheel index for your CUDA" >&2
  exit 1
fi
major=${cuda%%.*} minor=${cuda#*.}
if [ "$major" -ge 13 ]; then
  printf '%s\n' "torch==$version"
elif [ "$major" -eq 12 ] && [ "$minor" -ge 6 ]; then
  tag=cu126
  if [ "$minor" -ge 8 ]; then tag=cu128; fi
  printf '%s\n' "torch==$version+$tag" --extra-index-url "https://download.pytorch.org/whl/$tag"
else
  echo "torch_cuda.sh: the NVIDIA driver supports CUDA $cuda, older than any torch $version build (CUDA >=" \
    "12.6): update the driver (R580+ runs the package index's CUDA 13.0 build), or set SKRULL_TORCH_INDEX" \
    "to a PyTorch wheel index whose torch runs on CUDA $cuda" >&2
  exit 1
fi
