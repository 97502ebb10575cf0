#!/usr/bin/env bash
# Create (or reuse) ./.venv and install this project into it.
# torch goes first: a bare `torch` requirement resolved by deepspeed/transformers would otherwise pull a
# multi-GB CUDA wheel on a CPU-only machine.
# On a machine with an NVIDIA driver (nvidia-smi) it installs the CUDA build of the same torch that matches
# the driver's CUDA version, from a package index alone (scripts/torch_cuda.sh: no compiler, no CUDA toolkit),
# replacing a CPU-only torch found in .venv, and checks that torch then sees the GPU.
# flash-attn stays optional (`attention_backend: auto` uses PyTorch's own flash kernel without it):
# SKRULL_FLASH_ATTN=1 builds it after the project, with --no-build-isolation (its setup.py imports torch).
# It has no wheel on the package index: the build needs nvcc from a CUDA toolkit matching torch.version.cuda
# and takes 3-5 minutes on 64 cores with ninja (flash-attn's README; about 2 hours without ninja); MAX_JOBS
# (default 4 here) caps the parallel compile jobs, each of which can take several GB of RAM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${SKRULL_EXTRAS:-dev}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.skrull-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRAS-${SKRULL_TORCH_INDEX:-}-${SKRULL_FLASH_ATTN:-0}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# The CUDA build of torch for this driver (scripts/torch_cuda.sh says which, or why there is none).
install_cuda_torch() {
  local args
  args=$(bash scripts/torch_cuda.sh) || exit 1
  mapfile -t args <<< "$args"
  echo "setup.sh: installing ${args[*]}"
  if ! "$VPY" -m pip install -q "${args[@]}"; then
    echo "setup.sh: could not install ${args[*]}: update the NVIDIA driver to one with CUDA >= 13.0 (the" \
      "package index's build), or set SKRULL_TORCH_INDEX to a PyTorch wheel index for your driver's CUDA" >&2
    exit 1
  fi
}

"$VPY" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  # A CPU-only torch already here (installed before the driver, or by hand) is replaced by a CUDA one.
  if ! "$VPY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    "$VPY" -m pip uninstall -q -y torch 2>/dev/null || true
    install_cuda_torch
  fi
elif ! "$VPY" -c 'import torch' 2>/dev/null; then
  # The CPU wheel (local find-links on our machines; PyTorch's CPU index elsewhere via PIP_EXTRA_INDEX_URL).
  "$VPY" -m pip install -q torch==2.13.0
fi
# The project's requirements with uv when it installs (its resolver and parallel installer: 42 s instead of
# pip's 108 s on 2 cores, the same versions, measured 2026-11-25), else pip. --compile-bytecode: pip writes
# .pyc files at install time and uv does not by default; without them every Ray worker process compiles its
# imports again (the suite took 41 instead of 23 minutes). uv keeps the torch installed above (it satisfies
# every requirement) but reads no pip.conf: SKRULL_INSTALLER=pip uses pip's own index settings.
if [ "${SKRULL_INSTALLER:-uv}" = uv ] && "$VPY" -m pip install -q uv \
    && .venv/bin/uv pip install -q --python "$VPY" --compile-bytecode -e ".[$EXTRAS]"; then
  :
else
  "$VPY" -m pip install -q -e ".[$EXTRAS]"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  # liger-kernel (model.kernels=auto|liger: fused RMSNorm, SwiGLU, RoPE, linear cross-entropy): a pure-Python
  # wheel on the Triton that CUDA torch ships; the `gpu` extra has it too, beside flash-attn's source build.
  "$VPY" -m pip install -q "liger-kernel>=0.8.5"
fi
if [[ ",$EXTRAS," == *,dev,* ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
  # liger-kernel's own kernels for the CPU tests, run by Triton's interpreter (tests/test_liger_interpreted.py),
  # in a directory of their own: in .venv itself liger would count as installed for model.kernels=auto.
  # Pinned: tests/triton_interpreter.py closes gaps of this Triton's interpreter for this liger's kernels.
  rm -rf .venv/liger-interpret
  "$VPY" -m pip install -q --no-deps --target .venv/liger-interpret "triton==3.6.0" "liger-kernel==0.8.5"
fi
if [ "${SKRULL_FLASH_ATTN:-0}" = 1 ]; then
  "$VPY" -m pip install -q ninja packaging
  MAX_JOBS=${MAX_JOBS:-4} "$VPY" -m pip install --no-build-isolation "flash-attn>=2.7,<2.9"
fi
if command -v nvidia-smi >/dev/null 2>&1 \
  && ! "$VPY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "setup.sh: torch $("$VPY" -c 'import torch; print(torch.__version__)') does not see a GPU although" \
    "nvidia-smi is here: run nvidia-smi and check the driver (scripts/torch_cuda.sh: which torch for it)" >&2
  exit 1
fi
echo "$want" > "$stamp"
