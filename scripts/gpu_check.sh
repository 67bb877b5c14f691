#!/usr/bin/env bash
# The GPU check, for a machine with ONE GPU, as stages that each run in under 8 minutes and fit a
# GPU machine's budget (at most 10 minutes a command, about 15 minutes of device time in all,
# start-up included): what matters most runs first.
#   bash scripts/gpu_check.sh --plan             # the stages, in order, with expected times
#   bash scripts/gpu_check.sh --stage build      # one stage (repeat --stage for several)
#   bash scripts/gpu_check.sh                    # every planned stage, in order
#   bash scripts/gpu_check.sh --dry-run          # CPU (CI): resolves every stage's paths, collects
#                                                # every test it names, runs every script's --help
# Planned stages (expected seconds on an H100/H200; the plan's sum fits 12 minutes):
#   build      the extension with its CUDA plug-ins, and the environment record (env.json)
#   staged     2-4 processes on this one GPU (BYTESCALE_CUDA_TRANSPORT=staged): ring attention
#              with the real flash/cuDNN steps, CUDA collectives, static groups, HDP + offload,
#              PP 2 x HDP 2 (the one StepExecutor's 1F1B schedule and stage I/O; its lockstep
#              agreement is a CPU all-reduce on the world group), TP 3 (the local plan's
#              collectives); then the 2-process training demo
#   tests      correctness of every CUDA test (tests/cuda/, the CUDA offload and copy engines),
#              device_id=, a second NCCL rank on one GPU, the one-GPU smoke run to exit
#   grad       the HF model's training on CUDA's autograd device thread (checkpoint recompute)
#   speed      ring attention (packed lengths) and the NCCL transport against torch's nccl
# Extra stages (not in the plan; run alone when there is time): sanitizer (compute-sanitizer
# memcheck over small CUDA tests), bench_offload, profile, demo (bf16, FSDP2, resume).
# Output in $OUT (default ./gpu-out): one log per step; summary.jsonl gets one row per step as it
# ends, and summary.json (rewritten after every step, so a killed run keeps what finished) holds
# every row and the latest per step; nothing is ever truncated (--fresh starts a new summary).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

PLAN="build staged tests grad speed"
EXTRA="sanitizer bench_offload profile demo"
ALL="$PLAN $EXTRA"
# expected seconds per stage (estimates, not yet measured on this layout; each stage's steps
# have timeouts that keep it under 8 minutes)
declare -A EXPECT=([build]=210 [staged]=180 [tests]=135 [grad]=45 [speed]=60 [sanitizer]=420
                   [bench_offload]=120 [profile]=180 [demo]=240)
DRY=0
FRESH=0
STAGES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --fresh) FRESH=1 ;;
    --plan)
      total=0
      for s in $PLAN; do printf '%-14s %4d s\n' "$s" "${EXPECT[$s]}"; total=$((total + EXPECT[$s])); done
      printf '%-14s %4d s (%d min %d s)\n' total "$total" $((total / 60)) $((total % 60))
      for s in $EXTRA; do printf '%-14s %4d s (extra, not planned)\n' "$s" "${EXPECT[$s]}"; done
      exit 0 ;;
    --stage)
      shift
      [ $# -gt 0 ] && [[ " $ALL " == *" $1 "* ]] || {
        echo "gpu_check: unknown stage '${1:-}' (stages: $ALL)" >&2; exit 2; }
      STAGES+=("$1") ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (use --stage NAME, --plan, --dry-run)" >&2; exit 2 ;;
  esac
  shift
done
if [ ${#STAGES[@]} -eq 0 ]; then
  if [ "$DRY" = 1 ]; then read -r -a STAGES <<< "$ALL"; else read -r -a STAGES <<< "$PLAN"; fi
fi
mkdir -p "$OUT"
SUMMARY=$OUT/summary.jsonl
if [ "$DRY" = 0 ]; then
  [ "$FRESH" = 1 ] && : > "$SUMMARY"
  touch "$SUMMARY"
fi
FAIL=0

# ---- the checks, as data: every stage is made of these kinds of step --------------------
# pytest NAME TIMEOUT TARGET... [-- PYTEST-ARGS]     tests (dry run: collected)
# script NAME TIMEOUT SCRIPT ARGS...                  a python script (dry run: SCRIPT --help)
# module NAME TIMEOUT MODULE ARGS...                  python -m MODULE (dry run: --help)
# train  NAME TIMEOUT NPROC ENV ARGS...               torchrun -m bytescale.train (dry run: --help,
#                                                     ARGS parsed by the trainer's option parser)
# shell  NAME TIMEOUT COMMAND...                      anything else (dry run: the command resolves)
DRY_TESTS=()
DRY_CHECKS=$OUT/dry-checks.tsv  # the Python checks, run at the end in one interpreter (gpu_check_dry.py)
[ "$DRY" = 1 ] && : > "$DRY_CHECKS"
CUR_STAGE=
dry_check() {  # name kind args...: queue one check of the current stage
  local name=$1 kind=$2; shift 2
  printf '%s\t%s\t%s' "$CUR_STAGE" "$name" "$kind" >> "$DRY_CHECKS"
  printf '\t%s' "$@" >> "$DRY_CHECKS"
  printf '\n' >> "$DRY_CHECKS"
}

record() {  # name rc seconds log
  local status=pass
  [ "$2" = 0 ] || status=fail
  [ "$2" = 124 ] && status=timeout
  [ "$2" = skip ] && status=skipped
  printf '{"stage": "%s", "status": "%s", "rc": "%s", "seconds": %s, "log": "%s"}\n' \
    "$1" "$status" "$2" "$3" "$(basename "$4")" >> "$SUMMARY"
  echo "== $1: $status (${3} s, log $4)"
  [ "$status" = pass ] || [ "$status" = skipped ] || FAIL=1
  write_summary
}

write_summary() {  # summary.json from every row so far: all runs, the latest per step
  $PY - "$SUMMARY" "$OUT/summary.json" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
latest = {r["stage"]: r for r in rows}
json.dump({"latest": latest, "runs": rows,
           "passed": all(r["status"] in ("pass", "skipped") for r in latest.values())},
          open(sys.argv[2], "w"), indent=1)
EOF
}

timed() {  # name timeout log cmd...
  local name=$1 t=$2 log=$3; shift 3
  local t0=$SECONDS
  echo "== $name: $* (timeout ${t} s)"
  timeout --kill-after=20 "$t" "$@" >"$log" 2>&1
  local rc=$?
  tail -15 "$log"
  record "$name" "$rc" "$((SECONDS - t0))" "$log"
}

pytest_step() {
  local name=$1 t=$2; shift 2
  local targets=() extra=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do targets+=("$1"); shift; done
  [ $# -gt 0 ] && { shift; extra=("$@"); }
  if [ "$DRY" = 1 ]; then DRY_TESTS+=("${targets[@]}"); return; fi
  timed "$name" "$t" "$OUT/$name.log" $PY -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$OUT/$name.xml" "${targets[@]}" "${extra[@]}"
}

script_step() {
  local name=$1 t=$2 script=$3; shift 3
  if [ "$DRY" = 1 ]; then
    if [ ! -f "$script" ]; then echo "dry run: $name: missing $script"; FAIL=1; return; fi
    dry_check "$name" script "$script"
    return
  fi
  timed "$name" "$t" "$OUT/$name.log" $PY "$script" "$@"
}

module_step() {
  local name=$1 t=$2 mod=$3; shift 3
  if [ "$DRY" = 1 ]; then
    dry_check "$name" module "$mod"
    return
  fi
  timed "$name" "$t" "$OUT/$name.log" "$@"
}

# train_step NAME TIMEOUT NPROC ENV ARGS...: python -m bytescale.train under torchrun on this GPU
# (dry run: --help, and ARGS parsed by the trainer's own option parser, so a renamed option fails)
train_step() {
  local name=$1 t=$2 nproc=$3 envs=$4; shift 4
  if [ "$DRY" = 1 ]; then
    module_step "$name" 0 bytescale.train
    dry_check "$name" train "$@"
    return
  fi
  timed "$name" "$t" "$OUT/$name.log" env $envs $PY -m torch.distributed.run --standalone \
    --nproc_per_node "$nproc" -m bytescale.train "$@"
}

shell_step() {
  local name=$1 t=$2; shift 2
  if [ "$DRY" = 1 ]; then
    command -v "$1" >/dev/null || { echo "dry run: $name: '$1' not found"; FAIL=1; }
    return
  fi
  timed "$name" "$t" "$OUT/$name.log" "$@"
}

# ---- stages -------------------------------------------------------------------------------
env_record() {
  if [ "$DRY" = 1 ]; then shell_step env 60 "$PY"; return; fi
  local t0=$SECONDS
  {
    nvidia-smi || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true
    "${CXX:-c++}" --version | head -1
    command -v nvcc >/dev/null && nvcc --version | tail -2
    command -v compute-sanitizer >/dev/null && compute-sanitizer --version | head -2
  } >"$OUT/env.log" 2>&1
  $PY - >"$OUT/env.json" 2>>"$OUT/env.log" <<'EOF'
import json, platform, subprocess, torch
d = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
     "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
try:
    d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as e:  # noqa: BLE001
    d["nccl"] = f"unknown ({e})"
try:
    d["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip()
except Exception:  # noqa: BLE001
    d["driver"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d["capability"] = f"{p.major}.{p.minor}"
    d["memory_gib"] = round(p.total_memory / 2**30, 1)
print(json.dumps(d, indent=1))
EOF
  local rc=$?
  cat "$OUT/env.json"
  record env "$rc" "$((SECONDS - t0))" "$OUT/env.json"
}

stage_build() {
  # The image's default c++ (/opt/gcc) links parts of libstdc++ into the extension, whose
  # iostreams then crash beside torch's libstdc++ (seen 2026-11-22); use the system compiler.
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
  [ "$DRY" = 1 ] && { [ -f setup.py ] || { echo "dry run: setup.py missing"; FAIL=1; }; }
  env_record
  [ "$DRY" = 1 ] && return
  MAX_JOBS=${MAX_JOBS:-16} timed build 390 "$OUT/build.log" $PY setup.py build_ext --inplace
  ldd bytescale/_C*.so | grep -i "stdc\|nccl" >>"$OUT/build.log" 2>&1 || true
}

stage_tests() {
  pytest_step tests 360 tests/cuda/test_cuda_backend.py tests/cuda/test_cuda_attention.py \
    tests/cuda/test_cuda_static_groups.py \
    tests/runtime/test_offload.py::test_cuda_offload_bit_identical tests/runtime/test_copy_engines.py
  script_step smoke 90 scripts/cuda_smoke.py
}

stage_grad() {
  pytest_step grad 300 tests/cuda/test_cuda_training.py
}

stage_sanitizer() {
  # memcheck multiplies run times: small tests only
  local tests=(tests/cuda/test_cuda_backend.py::test_collectives_round_trip
               tests/cuda/test_cuda_backend.py::test_dynamic_group_and_attention_on_cuda
               tests/cuda/test_cuda_attention.py::test_merge_kernel_matches_float64_and_handles_empty_rows
               tests/cuda/test_cuda_attention.py::test_fp32_on_cuda_uses_tiled_kernel_and_is_tight
               tests/runtime/test_offload.py::test_cuda_offload_bit_identical)
  if [ "$DRY" = 1 ]; then
    DRY_TESTS+=("${tests[@]}")
    command -v compute-sanitizer >/dev/null || echo "dry run: note: compute-sanitizer not on PATH here (it ships with the CUDA toolkit)"
    return
  fi
  if ! command -v compute-sanitizer >/dev/null; then
    echo "== sanitizer: compute-sanitizer not found" > "$OUT/sanitizer.log"
    record sanitizer skip 0 "$OUT/sanitizer.log"
    return
  fi
  timed sanitizer 470 "$OUT/sanitizer.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    --target-processes all $PY -m pytest -q -p no:cacheprovider "${tests[@]}"
}

stage_staged() {
  pytest_step staged 300 tests/cuda/test_cuda_staged.py
  train_step staged_demo 150 2 BYTESCALE_CUDA_TRANSPORT=staged --device cuda \
    --data synthetic:byted --model small --capacity 4096 --tokens-per-batch 16384 --steps 3 --bf16 \
    --offload --metrics "$OUT/staged_demo.jsonl"
}

stage_speed() {
  script_step bench_ring_packed 150 benchmarks/bench_ring_attention.py --cuda --packed --reps 2 \
    --jsonl "$OUT/ring_packed.jsonl"
  script_step bench_comm 120 benchmarks/bench_comm.py --cuda --reps 10 --jsonl "$OUT/comm.jsonl"
}

stage_bench_offload() {
  script_step bench_offload 240 benchmarks/bench_offload.py --cuda --seq 65536 --dim 4096 --layers 4 \
    --jsonl "$OUT/offload.jsonl" --png "$OUT/offload_cuda.png"
}

stage_profile() {
  script_step profile 300 scripts/gpu_profile.py --out "$OUT/profile.json" --jsonl "$OUT/profile.jsonl"
}

stage_demo() {
  # the training entry point on one GPU: bf16, FSDP2, activation checkpointing, a checkpoint,
  # resume; memory per step in the metrics JSONL
  train_step demo 230 1 "" --device cuda --data synthetic:byted --model small --capacity 8192 \
    --tokens-per-batch 32768 --steps 6 --stop-after 4 --bf16 --fsdp --activation-checkpointing \
    --checkpoint-dir "$OUT/ckpt" --metrics "$OUT/train.jsonl"
  train_step demo_resume 230 1 "" --device cuda --data synthetic:byted --model small \
    --capacity 8192 --tokens-per-batch 32768 --steps 6 --bf16 --fsdp --activation-checkpointing \
    --checkpoint-dir "$OUT/ckpt" --resume --metrics "$OUT/train.jsonl"
}

declare -A STAGE_FAILED=()
for s in "${STAGES[@]}"; do
  before=$FAIL
  FAIL=0
  CUR_STAGE=$s
  "stage_$s"
  [ "$FAIL" = 1 ] && STAGE_FAILED[$s]=1
  [ "$before" = 1 ] && FAIL=1
done

if [ "$DRY" = 1 ]; then
  # the queued Python checks (scripts' and modules' --help, the trainer's options), in one process
  $PY scripts/gpu_check_dry.py "$DRY_CHECKS" > "$OUT/dry-checks.log" 2>&1 || FAIL=1
  grep -v '^failed-stage ' "$OUT/dry-checks.log"
  while read -r _ s; do STAGE_FAILED[$s]=1; done < <(grep '^failed-stage ' "$OUT/dry-checks.log")
  for s in "${STAGES[@]}"; do
    [ -z "${STAGE_FAILED[$s]:-}" ] && echo "dry run: stage $s resolves" || echo "dry run: stage $s FAILED"
  done
  # every test the stages name, collected in one pytest run (a missing file or test fails it)
  for t in "${DRY_TESTS[@]}"; do [ -e "${t%%::*}" ] || { echo "dry run: missing ${t%%::*}"; FAIL=1; }; done
  if $PY -m pytest --collect-only -q -p no:cacheprovider "${DRY_TESTS[@]}" >"$OUT/dry-collect.log" 2>&1; then
    for t in "${DRY_TESTS[@]}"; do
      grep -q "^${t}" "$OUT/dry-collect.log" || { echo "dry run: collected nothing for $t"; FAIL=1; }
    done
    echo "dry run: collected $(grep -c '::' "$OUT/dry-collect.log") tests from ${#DRY_TESTS[@]} targets"
  else
    echo "dry run: pytest --collect-only failed:"; tail -20 "$OUT/dry-collect.log"; FAIL=1
  fi
  [ "$FAIL" = 0 ] && echo "dry run: ok" || echo "dry run: FAILED"
  exit $FAIL
fi

write_summary
tar czf "$OUT/../gpu-check.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$OUT/../gpu-check.tar.gz" "$OUT/"
echo "summary: $OUT/summary.json; logs: $OUT/gpu-check.tar.gz"
exit $FAIL
