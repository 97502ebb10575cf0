#!/usr/bin/env bash
# The checks that need a CUDA device, for one GPU: the CUDA attention kernels against PyTorch SDPA, the
# model-level parity of the DACP forward/backward on CUDA (bf16, cp=1: NCCL cannot put two ranks on one
# GPU, so the ring itself needs >= 2 GPUs: run `python -m app verify --cp 2` there), and the compute
# profile fit of Qwen2.5-0.5B's dimensions (random weights) on this GPU, the full `profile` of that shape
# (written to $OUT/h100.yaml: the first real H100 profile) and `bench train` on one GPU with it.
# Usage: bash scripts/gpu_check.sh [python]   (logs also go to $OUT when it is set)
set -uo pipefail
py=${1:-python3}
out=${OUT:-$(mktemp -d)}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
status=0
step() { echo "== $*"; "$@" 2>&1 | tee -a "$out/gpu_check.log"; local rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu_check.log"
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu_check.log"
step "$py" -m pytest -q -p no:cacheprovider -m cuda tests/test_attention_kernel.py
for mode in none all auto; do
  step "$py" -m app verify --cp 1 --dtype bf16 --distribute "$mode" --lengths 1,7,300,2048,5000
done
qwen05="--set model.name_or_path=tiny-qwen2 --set model.hidden_size=896 --set model.num_layers=24
  --set model.num_attention_heads=14 --set model.num_key_value_heads=2 --set model.intermediate_size=4864
  --set model.vocab_size=151936"
# shellcheck disable=SC2086
step "$py" -m app verify --cp 1 --dtype bf16 --distribute auto --lengths 3,1000,4000 $qwen05
# shellcheck disable=SC2086
"$py" -m app bench compute --config configs/qwen2.5-0.5b-gpu.yaml $qwen05 --repeats 3 --json \
  > "$out/bench_compute.json" || status=1
# shellcheck disable=SC2086
step "$py" -m app bench compute --config configs/qwen2.5-0.5b-gpu.yaml $qwen05 --repeats 3
# shellcheck disable=SC2086
step "$py" -m app profile --config configs/qwen2.5-0.5b-gpu.yaml $qwen05 --set parallel.num_workers=1 \
  --set parallel.cp_size=1 --set scheduling.cost_formula=model --set model.random_init=true \
  --set scheduling.bucket_size=16384 --out "$out/h100.yaml"
one_gpu="--set parallel.num_workers=1 --set parallel.cp_size=1 --set model.dtype=bf16 --set resources.gpus_per_worker=1"
# shellcheck disable=SC2086
step "$py" -m app profile --config configs/bench/cpu-lmsys.yaml $one_gpu --out "$out/gpu-bench.yaml"
# shellcheck disable=SC2086
step "$py" -m app bench train --config configs/bench/cpu-lmsys.yaml $one_gpu \
  --set hardware.profile="$out/gpu-bench.yaml" --steps 8 --json --plot "$out/bench_train.png"
exit $status
