#!/usr/bin/env bash
# The checks that need NVIDIA GPUs, in stages that can be run (and re-run) alone:
#   bash scripts/gpu_check.sh install|kernels|verify|train|profile|bench|all [python]
# Each stage prints its numbers and writes them under $OUT (default: a new temporary directory, printed), and
# is stopped after SKRULL_STAGE_TIMEOUT_S seconds (default 600: each stage fits 10 minutes, or fails).
#   install  scripts/setup.sh: the CUDA torch that matches the driver (scripts/torch_cuda.sh), the project
#            and its dev extra into ./.venv; prints torch, its CUDA, the GPUs, deepspeed and flash-attn
#   kernels  pytest -m cuda over tests/: the CUDA attention kernels against PyTorch SDPA; fails unless at
#            least one test ran (all skipped = no CUDA in that Python = failure)
#   verify   `python -m app verify` on CUDA in bf16: every --distribute mode, tiny Qwen2 and Qwen2.5-0.5B's
#            dimensions; with >= 2 GPUs also over NCCL with --cp 2 (the ring)
#   train    `python -m app train` of Qwen2.5-0.5B's shape (random weights, synthetic LMSYS-like data, bf16,
#            attention_backend auto) on one GPU through the product's whole path (embedded Ray, Ray Train,
#            DeepSpeed ZeRO-2, the planner actor), 20 steps -> $OUT/train.json: tokens/s, MFU, peak GPU
#            memory against the memory model's, predicted against measured step time, all read from the
#            run's own records (`report`'s summary of metrics.jsonl, the run's config)
#   profile  `python -m app profile` of Qwen2.5-0.5B's shape (random weights, synthetic data) on this node's
#            GPUs (DP 1 x CP = GPUs, at most 8) -> $OUT/gpu.yaml, a hardware profile of this machine
#   bench    `python -m app bench train` of the same run, with $OUT/gpu.yaml (else configs/hardware/h100.yaml)
#   speed    the GPU-speed checks in one budget of SKRULL_GPU_CHECK_SPEED_BUDGET_S seconds (default 360: the
#            6 minutes docs/benchmarks.md "GPU speed" asks for), each part under the smaller of its cap and
#            the time left (a part with under 20 s left is skipped, and says so): `profile` -> gpu.yaml;
#            `bench step` of Qwen2.5-0.5B's shape at C = 16384 over the knobs (today's path, checkpointing
#            every layer; all on without checkpointing, with liger or compiled (liger's loss alone); the
#            device step on ZeRO-1 (one GPU's default) and on ZeRO-2; liger kernels; torch.compile) ->
#            speed_step.json; `train` with the config's defaults (bucket_size and checkpointing auto, on
#            gpu.yaml when profile wrote one) -> train_auto.json; the CUDA tests of the knobs and the
#            memory model (tests/test_kernels_cuda.py); `bench peer --device cuda` (TRL in bf16) ->
#            speed_peer.json. All of it in speed.json, with `complete` (every part ran and passed, the matrix
#            was not cut); exit 1 unless complete. The parts to run, in the order given:
#            SKRULL_GPU_CHECK_SPEED_PARTS (default profile,step,train,cuda_tests,peer; also
#            train_as_written: the train stage at C = 16384 -> train.json; an unknown name exits 2 before
#            any part runs). Not part of `all`.
#   all      every stage in that order, stopping at the first that fails; install is skipped when torch,
#            ray and deepspeed already import in the stages' python
# Without CUDA it fails at once, saying so.
# The python of every stage but install: [python], else $PYTHON, else the active python3 when it has torch,
# Ray and DeepSpeed, else ./.venv's (where install puts them), else python3. Its packages may come from
# PYTHONPATH (a `pip install --target DIR` of an offline wheel directory: docs/gpu-cluster.md "Offline install").
# For tests only: SKRULL_GPU_CHECK_FAKE_CUDA=1 skips the CUDA checks, and SKRULL_GPU_CHECK_TRAIN_SET="k=v ..."
# appends --set overrides to train's (tests/test_gpu_check_script.py runs train's command line on CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=(install kernels verify train profile bench)
PARTS=(speed speed_step speed_tests speed_peer)  # speed, and the parts it runs as stages of their own
usage="usage: bash scripts/gpu_check.sh install|kernels|verify|train|profile|bench|speed|all [python]"
stage=${1:-}
if [ -z "$stage" ] || { [ "$stage" != all ] && [[ ! " ${STAGES[*]} ${PARTS[*]} " == *" $stage "* ]]; }; then
  echo "$usage" >&2
  exit 2
fi
case ":${PYTHONPATH:-}:" in  # the checkout first (the stages run `-m app`), then the caller's packages
  ":$(pwd):"*) ;;
  *) export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} ;;
esac
export PYTHONUNBUFFERED=1
py=${2:-${PYTHON:-}}
py_given=${py:+yes}
has_stack() {  # $1 finds torch, ray and deepspeed (found, not imported: milliseconds)
  "$1" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("torch", "ray", "deepspeed")))' >/dev/null 2>&1
}
pick_python() {  # unless given: the active python3 with the stack, else ./.venv's, else python3
  if [ -n "$py_given" ]; then return; fi
  if has_stack python3; then py=python3; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
}
pick_python
export OUT=${OUT:-$(mktemp -d -t skrull-gpu-check-XXXXXX)}
mkdir -p "$OUT"
# Where the stages' runs (and their checkpoints, gigabytes for the 0.5B shape) go; $OUT/runs by default.
export RUNS=${SKRULL_GPU_CHECK_RUNS:-$OUT/runs}
limit=${SKRULL_STAGE_TIMEOUT_S:-600}

fail() { echo "gpu_check $stage: $*" >&2; exit 1; }

# The NVIDIA driver (every stage), then a CUDA device seen by torch in $py (every stage after install).
fake_cuda() {  # tests only: run a stage's command line on a machine without CUDA
  [ "${SKRULL_GPU_CHECK_FAKE_CUDA:-}" = 1 ] || return 1
  echo "gpu_check $stage: SKRULL_GPU_CHECK_FAKE_CUDA=1: the CUDA checks are skipped (tests only)" >&2
}
need_driver() {
  fake_cuda && return
  command -v nvidia-smi >/dev/null 2>&1 \
    || fail "CUDA is not available: no nvidia-smi (no NVIDIA driver); these checks need an NVIDIA GPU"
  nvidia-smi -L >/dev/null 2>&1 || fail "CUDA is not available: nvidia-smi fails ($(nvidia-smi -L 2>&1 | head -n 1))"
}
need_cuda() {
  fake_cuda && return
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
    --set resources.cpus_per_worker=1 --set run.storage_path="$RUNS")
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

# train: one GPU, Qwen2.5-0.5B's shape, TRAIN_STEPS steps of 64 sequences, then train.json from its run.
# TRAIN_NAME (default train) names the run and its files; `speed` runs it again with bucket_size=auto.
TRAIN_STEPS=20
stage_train() {
  need_cuda
  local name=${TRAIN_NAME:-train} profile=h100 overrides=() override
  [ -f "$OUT/gpu.yaml" ] && profile=$OUT/gpu.yaml
  read -r -a overrides <<< "${SKRULL_GPU_CHECK_TRAIN_SET:-}"
  local run=(--config configs/qwen2.5-0.5b-gpu.yaml "${QWEN05[@]}" --set data.source=synthetic
    --set data.distribution=lmsys --set data.num_samples=$((64 * TRAIN_STEPS)) --set parallel.num_workers=1
    --set parallel.cp_size=1 --set scheduling.global_batch_size=64 --set scheduling.bucket_size=16384
    --set train.steps=$TRAIN_STEPS --set hardware.profile="$profile" --set resources.cpus_per_worker=1
    --set run.storage_path="$RUNS" --set run.name="$name")
  for override in "${overrides[@]}"; do run+=(--set "$override"); done
  rm -rf "${RUNS:?}/$name"  # a re-run trains afresh: the finished run would otherwise be resumed
  # An embedded Ray of its own (no RAY_ADDRESS): the product's path on this node alone.
  run_json "${name}_run" env -u RAY_ADDRESS "$py" -m app train "${run[@]}" --json || return 1
  "$py" - "$OUT/${name}_run.json" "$OUT/$name.json" <<'EOF'
"""train.json from the run's own records: `report`'s summary of metrics.jsonl and the run's saved config,
beside the memory model (the terms of `profile`'s BucketSize) and the hardware profile's step times."""
import importlib.metadata
import json
import sys
from pathlib import Path

import torch

from app.config import load_config
from app.profiling.hardware import cost_model
from app.profiling.memory import memory_terms
from app.rundir.files import CONFIG_SNAPSHOT
from app.train.report import run_report

summary = json.loads(Path(sys.argv[1]).read_text())
run_dir = summary["run_dir"]
report, config = run_report(run_dir), load_config(Path(run_dir) / CONFIG_SNAPSHOT)
history, cost = report["history"], cost_model(config)
world = int(history[-1]["world_size"])
# The memory model of scheduling.bucket_size=auto (app/profiling/memory.py) for the run's own settings
# (its saved config: checkpointing resolved, C an int): weights, gradients and optimizer state per rank at
# its ZeRO stage, the profile's runtime term, and the phase of a micro-batch of C tokens that holds the
# most (the safety margin left out: it is what the model keeps free, not what it predicts in use).
terms = memory_terms(config)
static, alpha = terms.static + terms.runtime + terms.loss, terms.activation_per_token
bucket = config.scheduling.bucket_size
predicted = terms.peak_bytes
peaks = [h["gpu_peak_bytes"] for h in history if h.get("gpu_peak_bytes") is not None]
measured = max(peaks) if peaks else None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
keys = ("status", "steps", "tokens", "loss_first", "loss_last", "tokens_per_s", "tokens_per_s_median",
        "mfu_median", "step_s_median", "predicted_step_s_median", "profile_ratio")
# Where the call's wall time went: the steps, the first step's engine build and warm-up, the rest (Ray,
# data, the planner, the final checkpoint and export). phases_s: the driver's split of wall_s (TrainSummary);
# engine_phases_s: the engine build's (workers/engine.py); checkpoint_s: the last step's checkpoint save;
# workers_other_s: what the driver's "workers" phase holds beyond the steps, the start-up and that save (the
# worker group's start and end, the workers' imports, the export streaming).
steps_s = sum(h["step_s"] for h in history)
startup = {key: history[0].get(key) for key in ("engine_s", "warmup_s")}
phases, checkpoint_s = summary.get("phases_s") or {}, history[-1].get("checkpoint_s")
wall = {"wall_s": summary.get("wall_s"), "steps_s": steps_s, **startup,
        "other_s": summary["wall_s"] - steps_s - sum(v or 0 for v in startup.values())
        if summary.get("wall_s") else None,
        "phases_s": phases, "engine_phases_s": history[0].get("engine_phases_s"), "checkpoint_s": checkpoint_s,
        "workers_other_s": phases["workers"] - steps_s - sum(v or 0 for v in startup.values())
        - (checkpoint_s or 0) if "workers" in phases else None}
result = {
    "run_dir": run_dir, **{key: report[key] for key in keys}, "time": wall,
    "profile": config.hardware.profile, "peak_flops": cost.profile.peak_flops,
    "gpu_peak_bytes": measured, "predicted_peak_bytes": predicted,
    "gpu_peak_over_predicted": None if measured is None else measured / predicted,
    "memory_model": {"params": cost.params, "static_bytes": static, "activation_bytes_per_token": alpha,
                     "bucket_size": bucket, "world_size": world, "recompute": terms.recompute,
                     "kernels": terms.kernels, "peak_phase": terms.phase.name, "terms": terms.as_json()},
    "gpu": gpu, "python": sys.executable, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "torch_from": str(Path(torch.__file__).parent.parent),
    "ray": importlib.metadata.version("ray"), "deepspeed": importlib.metadata.version("deepspeed"),
}
Path(sys.argv[2]).write_text(json.dumps(result, indent=1) + "\n")


def num(value, spec=".3g"):
    return "-" if value is None else format(value, spec)


def gb(value):
    return "-" if value is None else f"{value / 1e9:.2f} GB"


r = report
print(f"train: {r['steps']} steps ({r['status']}), {r['tokens']} tokens on {gpu or 'no GPU'}, loss "
      f"{num(r['loss_first'], '.4f')} -> {num(r['loss_last'], '.4f')}")
print(f"  tokens/s    {num(r['tokens_per_s'], '.0f')} overall, {num(r['tokens_per_s_median'], '.0f')} median "
      f"step; MFU median {num(r['mfu_median'])} of {cost.profile.peak_flops:.3g} FLOP/s")
print(f"  step time   {num(r['step_s_median'])} s measured, {num(r['predicted_step_s_median'])} s predicted "
      f"(medians; hardware.profile={config.hardware.profile}, predicted / measured {num(r['profile_ratio'])})")
print(f"  GPU memory  {gb(measured)} peak allocated, {gb(predicted)} predicted (static, runtime and "
      f"loss {gb(static)} + {alpha / 1e3:.0f} KB/token x bucket {bucket}; recompute {terms.recompute})")
def split(parts):
    return ", ".join(f"{key} {value:.1f} s" for key, value in (parts or {}).items()) or "-"


print(f"  wall time   {num(wall['wall_s'], '.0f')} s: steps {num(steps_s, '.0f')} s, engine "
      f"{num(wall['engine_s'], '.1f')} s, warm-up {num(wall['warmup_s'], '.1f')} s, the rest (Ray, data, the "
      f"final checkpoint and export) {num(wall['other_s'], '.0f')} s; final checkpoint "
      f"{num(checkpoint_s, '.1f')} s")
print(f"              driver: {split(phases)}; in workers, beyond steps, start-up and checkpoint: "
      f"{num(wall['workers_other_s'], '.1f')} s")
print(f"              engine: {split(wall['engine_phases_s'])}")
print(f"train.json: {sys.argv[2]}")
if r["status"] != "finished":
    sys.exit(f"gpu_check train: the run is {r['status']!r}, not finished")
if gpu is not None and measured is None:
    sys.exit("gpu_check train: the workers recorded no gpu_peak_bytes on CUDA")
EOF
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

# speed: the GPU-speed matrix (the header says what): each part in a process of its own under its own time
# limit, its JSON written as it ends. SKRULL_GPU_CHECK_SPEED_{PARTS,VARIANTS,SET,STEPS} are for the CPU test.
SPEED_STEPS=${SKRULL_GPU_CHECK_SPEED_STEPS:-3}
SPEED_PART_NAMES=(profile cuda_tests peer step train train_as_written)
# The parts to run, in this order: the profile first (train sizes C from it), then what the GPU configs'
# defaults are chosen from (the matrix, the defaults' own run), then the checks (docs/benchmarks.md "GPU speed").
SPEED_PARTS=${SKRULL_GPU_CHECK_SPEED_PARTS:-profile,step,train,cuda_tests,peer}
TODAY="train.optimizer_impl=foreach,train.overlap_comm=on,model.kernels=torch,train.compile=false"
TODAY="$TODAY,train.activation_checkpointing=true,train.one_rank_zero1=false"  # the path before the knobs
STEP_ON="train.optimizer_impl=fused,train.overlap_comm=auto"
# Built in this order, so that a part that runs out of time (--max-seconds) has compared the two all-on
# candidates for the GPU configs' defaults (liger; compiled layers with liger's loss) with today first,
# then each knob alone.
SPEED_VARIANTS=(
  "today:$TODAY"
  "all:$STEP_ON,model.kernels=liger,train.compile=false,train.activation_checkpointing=false"
  "all_compiled:$STEP_ON,model.kernels=auto,train.compile=true,train.activation_checkpointing=false"
  "zero1:$TODAY,$STEP_ON,train.one_rank_zero1=true"
  "device_step:$TODAY,$STEP_ON"
  "liger:$TODAY,model.kernels=liger"
  "compile:$TODAY,train.compile=true"
)
speed_sets() {  # the 0.5B shape on synthetic LMSYS-like data, then the test's overrides
  local extra=() v
  SETS=(--config configs/qwen2.5-0.5b-gpu.yaml "${QWEN05[@]}" --set data.source=synthetic
    --set data.distribution=lmsys --set scheduling.global_batch_size=64 "$@")
  read -r -a extra <<< "${SKRULL_GPU_CHECK_SPEED_SET:-}"
  for v in "${extra[@]}"; do SETS+=(--set "$v"); done
}
stage_speed_step() {
  need_cuda
  local variants=() v
  read -r -a variants <<< "${SKRULL_GPU_CHECK_SPEED_VARIANTS:-${SPEED_VARIANTS[*]}}"
  speed_sets --set data.num_samples=$((64 * (SPEED_STEPS + 1))) --set scheduling.bucket_size=16384 \
    --set hardware.profile=h100
  for v in "${variants[@]}"; do SETS+=(--variant "$v"); done
  # --max-seconds inside the part's time limit (45 s for the last build, warm-up and exit): a matrix that
  # runs long reports the steps it measured
  run_json speed_step "$py" -m app bench step "${SETS[@]}" --steps "$SPEED_STEPS" --warmup 1 \
    --max-seconds "$(( ${SPEED_PART_LIMIT_S:-240} - 45 ))" --json
}
stage_speed_peer() {
  need_cuda
  # rows for the warm-up step, the calibration window (8) and 2 counted steps of 64 on both sides, cut at
  # 16384 tokens as the train part's (C and checkpointing then come from memory alone)
  speed_sets --set data.num_samples=$((64 * (1 + 8 + 2))) --set data.shuffle=false --set parallel.num_workers=1 \
    --set parallel.cp_size=1 --set resources.cpus_per_worker=1 --set run.storage_path="$RUNS" \
    --set data.max_length=16384
  run_json speed_peer "$py" -m app bench peer "${SETS[@]}" --device cuda --steps 2 --rounds 1 --json
}
stage_speed_tests() {
  need_cuda
  "$py" -m pytest -q -p no:cacheprovider -m cuda tests/test_kernels_cuda.py 2>&1 | tee "$OUT/speed_tests.log"
  return "${PIPESTATUS[0]}"
}
profile_progress() {  # what a stopped profile had measured: its workers' progress lines in Ray's session logs
  echo "gpu_check speed: profile stopped; its workers' last progress lines:"
  grep -h "\[skrull\] profile:" "${RAY_TMPDIR:-/tmp/ray}"/session_latest/logs/worker-*.out 2>/dev/null | tail -n 8
}
# The speed stage's parts share one budget (SPEED_BUDGET_S from the stage's start, 6 minutes by default):
# each runs under the smaller of its own cap and the time left, and a part with under SPEED_MIN_PART_S left
# is skipped. Unused time flows to the parts after it. speed_parts.txt: "name exit seconds limit" per part
# (exit "skipped" for a skipped one).
SPEED_BUDGET_S=${SKRULL_GPU_CHECK_SPEED_BUDGET_S:-360}
SPEED_MIN_PART_S=20
part() {  # part NAME CAP_S STAGE [ENV=VALUE ...]: one part as `gpu_check.sh STAGE`, time-boxed
  local name=$1 cap=$2 target=$3 started rc limit
  shift 3
  limit=$(( SPEED_DEADLINE - $(date +%s) ))
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt "$SPEED_MIN_PART_S" ]; then
    echo "$name skipped 0 $limit" >> "$OUT/speed_parts.txt"
    echo "gpu_check speed: $name skipped: ${limit} s left of the ${SPEED_BUDGET_S} s budget"
    speed_summary >/dev/null
    return 0
  fi
  started=$(date +%s)
  env "$@" PYTHON="$py" SKRULL_GPU_CHECK_STAGE="$target" SPEED_PART_LIMIT_S="$limit" \
    timeout -k 10 "$limit" bash "$0" "$target"
  rc=$?
  [ "$rc" = 124 ] && [ "$target" = profile ] && profile_progress | tee -a "$OUT/profile.log"
  echo "$name $rc $(( $(date +%s) - started )) $limit" >> "$OUT/speed_parts.txt"
  echo "gpu_check speed: $name exit $rc after $(( $(date +%s) - started )) s (limit $limit s)"
  speed_summary >/dev/null
}
speed_part() {  # speed_part NAME: one of the speed stage's parts, with the most it may take when time is
  # left (an H200, 2026-11-28: train 121 s; profile over 115 s)
  case $1 in
    profile) part profile 180 profile ;;
    cuda_tests) part cuda_tests 60 speed_tests ;;
    peer) part peer 150 speed_peer ;;
    step) part step 240 speed_step ;;
    # `train` with the config's defaults (C and checkpointing from memory, on this GPU's profile when
    # `profile` wrote one): the train stage's rows, cut at its 16384 tokens, so that the one GPU need not
    # hold the config's 131072-token maximum.
    train) part train 150 train TRAIN_NAME=train_auto SKRULL_GPU_CHECK_TRAIN_SET="${SKRULL_GPU_CHECK_TRAIN_SET:-} \
scheduling.bucket_size=auto data.max_length=16384" ;;
    train_as_written) part train_as_written 150 train TRAIN_NAME=train ;;  # the train stage (C = 16384)
  esac
}
stage_speed() {
  need_cuda
  local name names
  IFS=, read -r -a names <<< "$SPEED_PARTS"
  for name in "${names[@]}"; do
    [[ " ${SPEED_PART_NAMES[*]} " == *" $name "* ]] && continue
    echo "SKRULL_GPU_CHECK_SPEED_PARTS: unknown part '$name' (the parts: ${SPEED_PART_NAMES[*]})" >&2
    exit 2
  done
  rm -f "$OUT/speed_parts.txt"
  touch "$OUT/speed_parts.txt"
  SPEED_DEADLINE=$(( $(date +%s) + SPEED_BUDGET_S ))
  for name in "${names[@]}"; do speed_part "$name"; done
  speed_summary
}
speed_summary() {  # speed.json from what the parts wrote so far (rewritten after every part); exit 1 unless
  # every part asked for ran to its end and passed, and the bench step matrix measured every variant
  "$py" - "$OUT" "$SPEED_BUDGET_S" <<'EOF'
"""speed.json: the budget, every part's exit status, seconds and time limit, the JSON each wrote, the
profile, and the end of each part's output (one file holds it all: a lent machine may give back only a few
files). `complete`: every part asked for ran and passed, and the bench step matrix was not cut short."""
import json
import sys
from pathlib import Path

out, budget = Path(sys.argv[1]), int(sys.argv[2])
parts = {}
for line in (out / "speed_parts.txt").read_text().splitlines():
    name, rc, seconds, limit = line.split()
    skipped = rc == "skipped"
    status = "skipped" if skipped else "passed" if rc == "0" else "stopped" if rc in ("124", "137") else "failed"
    parts[name] = {"exit": None if skipped else int(rc), "status": status, "seconds": int(seconds),
                   "limit_s": int(limit)}
result = {"budget_s": budget, "seconds": sum(p["seconds"] for p in parts.values()), "parts": parts}
for key, file in (("bench_step", "speed_step.json"), ("train", "train_auto.json"),
                  ("train_as_written", "train.json"), ("peer", "speed_peer.json")):
    try:
        result[key] = json.loads((out / file).read_text())
    except (OSError, ValueError):
        result[key] = None
step_cut = (result["bench_step"] or {}).get("stopped_early") if "step" in parts else None
if step_cut and parts["step"]["exit"] == 1:  # bench step's own exit status for a matrix it cut short
    parts["step"]["status"] = "cut"
result["complete"] = all(p["status"] == "passed" for p in parts.values()) and not step_cut
profile = out / "gpu.yaml"
result["profile"] = profile.read_text() if profile.exists() else None
result["output_tails"] = {f.name: f.read_text(errors="replace")[-4000:]
                          for pattern in ("*.err", "*.log") for f in sorted(out.glob(pattern))}
(out / "speed.json").write_text(json.dumps(result, indent=1) + "\n")
unfinished = [f"{name} ({p['status']}{': ' + step_cut if name == 'step' and step_cut else ''})"
              for name, p in parts.items() if p["status"] != "passed"]
print(f"speed.json: {out / 'speed.json'}: {result['seconds']} s of the {budget} s budget"
      + (f"; not complete: {', '.join(unfinished)}" if unfinished else ", every part passed"))
sys.exit(0 if result["complete"] else 1)
EOF
}

if [ "${SKRULL_GPU_CHECK_STAGE:-}" = "$stage" ]; then  # one stage, inside the timeout below
  "stage_$stage"
  exit $?
fi
[ "$stage" = all ] && need_driver  # before install: a machine without a GPU stops here, at once
echo "gpu_check: results in $OUT"
for name in "${STAGES[@]}" "${PARTS[@]}"; do
  [ "$stage" = all ] && [[ " ${PARTS[*]} " == *" $name "* ]] && continue  # speed is not part of all
  [ "$stage" = all ] || [ "$stage" = "$name" ] || continue
  pick_python  # after install: ./.venv's (unless a python was given or python3 has the stack)
  if [ "$stage" = all ] && [ "$name" = install ]; then
    if stack=$("$py" -c 'import torch, ray, deepspeed
print("torch", torch.__version__, "CUDA", torch.version.cuda, "ray", ray.__version__, "deepspeed",
      deepspeed.__version__)' 2>&1); then
      echo "gpu_check install: skipped: $py imports ${stack##*$'\n'}"
      continue
    elif [ -n "$py_given" ]; then  # install fills ./.venv, which the stages, given $py, would not use
      fail "$py cannot import torch, ray and deepspeed (${stack##*$'\n'}): install them \
into it or onto its PYTHONPATH (docs/gpu-cluster.md, \"Offline install\"), or give no python and let install make ./.venv"
    fi
  fi
  started=$(date +%s)
  [ "$name" = speed ] && limit=${SKRULL_STAGE_TIMEOUT_S:-$(( SPEED_BUDGET_S + 60 ))}  # its parts: in its budget
  PYTHON=$py SKRULL_GPU_CHECK_STAGE=$name timeout -k 30 "$limit" bash "$0" "$name"
  rc=$?
  echo "gpu_check $name: exit $rc after $(( $(date +%s) - started )) s (results in $OUT)"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "gpu_check $name: stopped after ${limit} s (SKRULL_STAGE_TIMEOUT_S)" >&2
  fi
  [ "$rc" = 0 ] || exit "$rc"
done
