#!/usr/bin/env bash
# The checks that need NVIDIA GPUs, in stages that can be run (and re-run) alone:
#   bash scripts/gpu_check.sh install|kernels|verify|profile|bench|all [python]
# Each stage prints its numbers and writes them under $OUT (default: a new temporary directory, printed), and
# is stopped after SKRULL_STAGE_TIMEOUT_S seconds (default 600: each stage fits 10 minutes, or fails).
#   install  scripts/setup.sh: the CUDA torch that matches the driver (scripts/torch_cuda.sh), the project
#            and its dev extra into ./.venv; prints torch, its CUDA, the GPUs, deepspeed and flash-attn
#   kernels  pytest -m cuda over tests/: the CUDA attention kernels against PyTorch SDPA; fails unless at
#            least one test ran (all skipped = no CUDA in that Python = failure)
#   verify   `python -m app verify` on CUDA in bf16: every --distribute mode, tiny Qwen2 and Qwen2.5-0.5B's
#            dimensions; with >= 2 GPUs also over NCCL with --cp 2 (the ring)
#   profile  `python -m app profile` of Qwen2.5-0.5B's shape (random weights, synthetic data) on this node's
#            GPUs (DP 1 x CP = GPUs, at most 8) -> $OUT/gpu.yaml, a hardware profile of this machine
#   bench    `python -m app bench train` of the same run, with $OUT/gpu.yaml (else configs/hardware/h100.yaml)
#   all      every stage in that order, stopping at the first that fails
# Without CUDA it fails at once, saying so. [python]: the interpreter for every stage but install (default
# ./.venv/bin/python, where install puts everything, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=(install kernels verify profile bench)
usage="usage: bash scripts/gpu_check.sh install|kernels|verify|profile|bench|all [python]"
stage=${1:-}
if [ -z "$stage" ] || { [ "$stage" != all ] && [[ ! " ${STAGES[*]} " == *" $stage "* ]]; }; then
  echo "$usage" >&2
  exit 2
fi
py_given=${2:+yes}
py=${2:-}
venv_python() {  # the default interpreter: ./.venv's, where install puts everything, else python3
  if [ -n "$py_given" ]; then return; fi
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
}
venv_python
export OUT=${OUT:-$(mktemp -d -t skrull-gpu-check-XXXXXX)}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
limit=${SKRULL_STAGE_TIMEOUT_S:-600}

fail() { echo "gpu_check $stage: $*" >&2; exit 1; }

# The NVIDIA driver (every stage), then a CUDA device seen by torch in $py (every stage after install).
need_driver() {
  command -v nvidia-smi >/dev/null 2>&1 \
    || fail "CUDA is not available: no nvidia-smi (no NVIDIA driver); these checks need an NVIDIA GPU"
  nvidia-smi -L >/dev/null 2>&1 || fail "CUDA is not available: nvidia-smi fails ($(nvidia-smi -L 2>&1 | head -n 1))"
}
need_cuda() {
  need_driver
  if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    local torch_line
    torch_line=$("$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1)
    fail "CUDA is not available to $py (${torch_line##*$'\n'}): run \`bash scripts/gpu_check.sh install\` first"
  fi
}
gpu_count() { "$py" -c 'import torch; print(torch.cuda.device_count())'; }

# Run one command: its output to the terminal and $OUT/<name>.log; the last line of its stdout (the --json
# object) also to $OUT/<name>.json. Returns its exit status.
run_json() {
  local name=$1
  shift
  echo "== $*"
  "$@" 2> >(tee "$OUT/$name.err" >&2) | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
  return "$rc"
}

# Qwen2.5-0.5B's dimensions on the tiny preset (random weights: nothing downloaded), synthetic data.
QWEN05=(--set model.name_or_path=tiny-qwen2 --set model.random_init=true --set model.hidden_size=896
  --set model.num_layers=24 --set model.num_attention_heads=14 --set model.num_key_value_heads=2
  --set model.intermediate_size=4864 --set model.vocab_size=151936)
NODE_RUN=()
node_run() {  # NODE_RUN: the 0.5B GPU config on this node, DP 1 x CP = GPUs (at most 8), synthetic data
  local cp
  cp=$(gpu_count)
  [ "$cp" -gt 8 ] && cp=8
  NODE_RUN=(--config configs/qwen2.5-0.5b-gpu.yaml "${QWEN05[@]}" --set data.source=synthetic
    --set data.num_samples=512 --set parallel.num_workers="$cp" --set parallel.cp_size="$cp"
    --set scheduling.global_batch_size=64 --set scheduling.bucket_size=16384
    --set resources.cpus_per_worker=1 --set run.storage_path="$OUT/runs")
}

stage_install() {
  need_driver
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/install.log"
  bash scripts/setup.sh || fail "scripts/setup.sh failed (its message above says why)"
  py=.venv/bin/python
  "$py" - <<'EOF' | tee -a "$OUT/install.log"
import importlib.util, json, torch, deepspeed
flash = importlib.util.find_spec("flash_attn") is not None
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available":
                  torch.cuda.is_available(), "gpus": [torch.cuda.get_device_name(i) for i in
                  range(torch.cuda.device_count())], "deepspeed": deepspeed.__version__,
                  "flash_attn_installed": flash}))
EOF
  need_cuda
}

stage_kernels() {
  need_cuda
  run_json kernels_pytest "$py" -m pytest -q -p no:cacheprovider -m cuda tests/ --junitxml="$OUT/kernels.xml"
  local rc=$?
  "$py" - "$OUT/kernels.xml" <<'EOF' | tee "$OUT/kernels.json" || rc=1
import json, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
count["passed"] = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
print(json.dumps(count))
if count["passed"] < 1:
    sys.exit("gpu_check kernels: no cuda test ran (all skipped or none collected)")
EOF
  return "$rc"
}

stage_verify() {
  need_cuda
  local rc=0 gpus mode lengths=1,7,300,2048,5000
  gpus=$(gpu_count)
  for mode in none all auto; do
    run_json "verify_cp1_$mode" "$py" -m app verify --cp 1 --dtype bf16 --distribute "$mode" \
      --lengths "$lengths" --json || rc=1
  done
  run_json verify_cp1_qwen05 "$py" -m app verify --cp 1 --dtype bf16 --distribute auto --lengths 3,1000,4000 \
    "${QWEN05[@]}" --json || rc=1
  if [ "$gpus" -ge 2 ]; then
    for mode in all auto; do
      run_json "verify_cp2_$mode" "$py" -m app verify --cp 2 --dtype bf16 --distribute "$mode" \
        --lengths "$lengths" --json || rc=1
    done
    run_json verify_cp2_qwen05 "$py" -m app verify --cp 2 --dtype bf16 --distribute auto \
      --lengths 3,1000,4000 "${QWEN05[@]}" --json || rc=1
  else
    echo "verify: 1 GPU: the ring over NCCL (--cp 2) needs 2 GPUs, not run"
  fi
  return "$rc"
}

stage_profile() {
  need_cuda
  node_run
  echo "== $py -m app profile ${NODE_RUN[*]}"
  "$py" -m app profile "${NODE_RUN[@]}" --repeats 3 --steps 2 --out "$OUT/gpu.yaml" 2>&1 | tee "$OUT/profile.log"
  return "${PIPESTATUS[0]}"
}

stage_bench() {
  need_cuda
  local profile=h100
  node_run
  [ -f "$OUT/gpu.yaml" ] && profile=$OUT/gpu.yaml
  run_json bench_train "$py" -m app bench train "${NODE_RUN[@]}" --set hardware.profile="$profile" --steps 4 \
    --no-progress --json --plot "$OUT/bench_train.png"
}

if [ "${SKRULL_GPU_CHECK_STAGE:-}" = "$stage" ]; then  # one stage, inside the timeout below
  "stage_$stage"
  exit $?
fi
[ "$stage" = all ] && need_driver  # before install: a machine without a GPU stops here, at once
echo "gpu_check: results in $OUT"
for name in "${STAGES[@]}"; do
  [ "$stage" = all ] || [ "$stage" = "$name" ] || continue
  venv_python  # after install: ./.venv's (unless a python was given)
  started=$(date +%s)
  SKRULL_GPU_CHECK_STAGE=$name timeout -k 30 "$limit" bash "$0" "$name" ${py_given:+"$py"}
  rc=$?
  echo "gpu_check $name: exit $rc after $(( $(date +%s) - started )) s (results in $OUT)"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "gpu_check $name: stopped after ${limit} s (SKRULL_STAGE_TIMEOUT_S)" >&2
  fi
  [ "$rc" = 0 ] || exit "$rc"
done
