#!/usr/bin/env bash
# Create (or reuse) ./.venv and install this project into it.
# torch goes first: a bare `torch` requirement resolved by deepspeed/transformers would otherwise pull a
# multi-GB CUDA wheel on a CPU-only machine. On a machine with an NVIDIA driver the default (CUDA) torch is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${SKRULL_EXTRAS:-dev}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.skrull-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRAS
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VPY" -m pip install -q --upgrade pip
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch
  else
    # The CPU wheel (local find-links on our machines; PyTorch's CPU index elsewhere via PIP_EXTRA_INDEX_URL).
    "$VPY" -m pip install -q torch==2.13.0
  fi
fi
"$VPY" -m pip install -q -e ".[$EXTRAS]"
echo "$want" > "$stamp"
