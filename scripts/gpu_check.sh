#!/usr/bin/env bash
# The GPU check: ONE command for a machine with ONE GPU (about 25 minutes on an H100):
#   bash scripts/gpu_check.sh                # every stage below, in order
#   bash scripts/gpu_check.sh STAGE ...      # some stages (names below)
#   bash scripts/gpu_check.sh --dry-run      # CPU (CI): resolves every path, collects every test
#                                            # it names (pytest --collect-only), runs every
#                                            # script's --help; runs nothing on a GPU
# Stages:
#   env        environment record: GPU, driver, torch, CUDA, cuDNN, NCCL, compiler (env.json)
#   build      the extension with its CUDA plug-ins
#   tests      every CUDA test (tests/cuda/, the CUDA offload test)
#   grad       issue 21 finding 4 on CUDA: checkpoint recompute on autograd's device thread
#   device_id  init_process_group(device_id=) creates the communicator; a second NCCL rank on the
#              same GPU fails fast; the one-GPU smoke run from init to interpreter exit
#   sanitizer  compute-sanitizer memcheck over the small CUDA tests
#   staged     2-4 processes on this one GPU (BYTESCALE_CUDA_TRANSPORT=staged): ring attention
#              with the real flash/cuDNN steps, CUDA collectives, HDP + offload; a 2-process demo
#   bench_ring ring attention: packed variable lengths (cuDNN vs flash, first call vs steady,
#              host memory), then the single-document table
#   bench_offload  activation offloading at 64K tokens (peak allocated / reserved memory)
#   bench_comm the NCCL transport against torch's nccl backend (world size 1)
#   profile    a cost profile (planner / simulator) of a llama3-8b block on this GPU
#   demo       python -m bytescale.train on this GPU (bf16, FSDP2, checkpointing, resume),
#              memory per step in the metrics JSONL
# Output in $OUT (default ./gpu-out): one log per stage, summary.json (per stage: status, exit
# code, seconds, log), every benchmark's rows in *.jsonl as they are measured (a timeout loses
# nothing), and gpu-check.tar.gz holding all of it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

ALL="env build tests grad device_id sanitizer staged bench_ring bench_offload bench_comm profile demo"
DRY=0
STAGES=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) [[ " $ALL " == *" $a "* ]] || { echo "gpu_check: unknown stage '$a' (stages: $ALL)" >&2; exit 2; }
       STAGES+=("$a") ;;
  esac
done
[ ${#STAGES[@]} -eq 0 ] && read -r -a STAGES <<< "$ALL"
mkdir -p "$OUT"
SUMMARY=$OUT/summary.jsonl
[ "$DRY" = 1 ] || : > "$SUMMARY"
FAIL=0

# ---- the checks, as data: every stage is made of these kinds of step --------------------
# pytest NAME TIMEOUT TARGET... [-- PYTEST-ARGS]     tests (dry run: collected)
# script NAME TIMEOUT SCRIPT ARGS...                  a python script (dry run: SCRIPT --help)
# module NAME TIMEOUT MODULE ARGS...                  python -m MODULE (dry run: --help)
# train  NAME TIMEOUT NPROC ENV ARGS...               torchrun -m bytescale.train (dry run: --help,
#                                                     ARGS parsed by the trainer's option parser)
# shell  NAME TIMEOUT COMMAND...                      anything else (dry run: the command resolves)
DRY_TESTS=()

record() {  # name rc seconds log
  local status=pass
  [ "$2" = 0 ] || status=fail
  [ "$2" = 124 ] && status=timeout
  [ "$2" = skip ] && status=skipped
  printf '{"stage": "%s", "status": "%s", "rc": "%s", "seconds": %s, "log": "%s"}\n' \
    "$1" "$status" "$2" "$3" "$(basename "$4")" >> "$SUMMARY"
  echo "== $1: $status (${3} s, log $4)"
  [ "$status" = pass ] || [ "$status" = skipped ] || FAIL=1
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
    if $PY "$script" --help >/dev/null 2>"$OUT/dry-$name.err"; then echo "dry run: $name: $script --help ok"
    else echo "dry run: $name: $script --help failed:"; tail -5 "$OUT/dry-$name.err"; FAIL=1; fi
    return
  fi
  timed "$name" "$t" "$OUT/$name.log" $PY "$script" "$@"
}

module_step() {
  local name=$1 t=$2 mod=$3; shift 3
  if [ "$DRY" = 1 ]; then
    if $PY -m "$mod" --help >/dev/null 2>"$OUT/dry-$name.err"; then echo "dry run: $name: -m $mod --help ok"
    else echo "dry run: $name: python -m $mod --help failed:"; tail -5 "$OUT/dry-$name.err"; FAIL=1; fi
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
    if $PY -c 'import sys; from bytescale.train.config import parse_args; parse_args(sys.argv[1:])' "$@" \
        >/dev/null 2>"$OUT/dry-$name-args.err"; then echo "dry run: $name: bytescale.train options ok"
    else echo "dry run: $name: bytescale.train rejects the options:"; tail -5 "$OUT/dry-$name-args.err"; FAIL=1; fi
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
stage_env() {
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
  [ "$DRY" = 1 ] && { [ -f setup.py ] || { echo "dry run: setup.py missing"; FAIL=1; }; return; }
  MAX_JOBS=${MAX_JOBS:-16} timed build 900 "$OUT/build.log" $PY setup.py build_ext --inplace
  ldd bytescale/_C*.so | grep -i "stdc\|nccl" >>"$OUT/build.log" 2>&1 || true
}

stage_tests() {
  pytest_step tests 600 tests/cuda/test_cuda_backend.py tests/cuda/test_cuda_attention.py \
    tests/runtime/test_offload.py::test_cuda_offload_bit_identical tests/runtime/test_copy_engines.py
}

stage_grad() {
  pytest_step grad 300 tests/cuda/test_cuda_training.py
}

stage_device_id() {
  pytest_step device_id 300 tests/cuda/test_cuda_backend.py::test_device_id_creates_the_communicator \
    tests/cuda/test_cuda_backend.py::test_second_nccl_rank_on_the_same_gpu_fails_fast
  script_step smoke 120 scripts/cuda_smoke.py
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
  timed sanitizer 900 "$OUT/sanitizer.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    --target-processes all $PY -m pytest -q -p no:cacheprovider "${tests[@]}"
}

stage_staged() {
  pytest_step staged 900 tests/cuda/test_cuda_staged.py
  train_step staged_demo 300 2 BYTESCALE_CUDA_TRANSPORT=staged --device cuda \
    --data synthetic:byted --model small --capacity 4096 --tokens-per-batch 16384 --steps 4 --bf16 \
    --offload --metrics "$OUT/staged_demo.jsonl"
}

stage_bench_ring() {
  script_step bench_ring_packed 420 benchmarks/bench_ring_attention.py --cuda --packed --reps 3 \
    --jsonl "$OUT/ring_packed.jsonl"
  script_step bench_ring 360 benchmarks/bench_ring_attention.py --cuda --reps "${REPS:-3}" \
    --lengths 8192 32768 131072 --jsonl "$OUT/ring.jsonl" --png "$OUT/ring_attention.png"
}

stage_bench_offload() {
  script_step bench_offload 240 benchmarks/bench_offload.py --cuda --seq 65536 --dim 4096 --layers 4 \
    --jsonl "$OUT/offload.jsonl" --png "$OUT/offload_cuda.png"
}

stage_bench_comm() {
  script_step bench_comm 180 benchmarks/bench_comm.py --cuda --reps 20 --jsonl "$OUT/comm.jsonl"
}

stage_profile() {
  script_step profile 300 scripts/gpu_profile.py --out "$OUT/profile.json" --jsonl "$OUT/profile.jsonl"
}

stage_demo() {
  # the training entry point on one GPU: bf16, FSDP2, activation checkpointing, a checkpoint,
  # resume; memory per step in the metrics JSONL
  train_step demo 240 1 "" --device cuda --data synthetic:byted --model small --capacity 8192 \
    --tokens-per-batch 32768 --steps 6 --stop-after 4 --bf16 --fsdp --activation-checkpointing \
    --checkpoint-dir "$OUT/ckpt" --metrics "$OUT/train.jsonl"
  train_step demo_resume 240 1 "" --device cuda --data synthetic:byted --model small \
    --capacity 8192 --tokens-per-batch 32768 --steps 6 --bf16 --fsdp --activation-checkpointing \
    --checkpoint-dir "$OUT/ckpt" --resume --metrics "$OUT/train.jsonl"
}

for s in "${STAGES[@]}"; do
  "stage_$s"
done

if [ "$DRY" = 1 ]; then
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

$PY - "$SUMMARY" "$OUT/summary.json" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"stages": rows, "passed": all(r["status"] in ("pass", "skipped") for r in rows)},
          open(sys.argv[2], "w"), indent=1)
EOF
tar czf "$OUT/../gpu-check.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$OUT/../gpu-check.tar.gz" "$OUT/"
echo "summary: $OUT/summary.json; logs: $OUT/gpu-check.tar.gz"
exit $FAIL
