#!/usr/bin/env bash
# All tests: the C++ GoogleTest suite (ctest), the same under ASan + UBSan, and the Python suite
# (pytest, multi-process tests included, each CUDA-order variant as a parameter of its test).
# Installs and builds what it needs first (scripts/setup_env.sh); on a built tree that finds out
# in seconds, and the GoogleTest and sanitizer builds (build-cpp, build-asan) are incremental too.
# PYTHON picks the interpreter (default python3); extra arguments go to pytest. Prints the wall
# time of every stage and, from pytest, the slowest tests and each directory's total.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)}  # as setup_env.sh: cache hits across clones

stages=()
stage() {  # stage NAME COMMAND...: run it, note its wall time
  local name=$1 t0=$SECONDS
  shift
  echo "== $name =="
  "$@"
  stages+=("$(printf '%6d s  %s' $((SECONDS - t0)) "$name")")
}
report() {
  echo "== stage times =="
  printf '%s\n' "${stages[@]}"
}
trap report EXIT

stage "set-up (install, build)" bash scripts/setup_env.sh

cpp_tests() {
  cmake -S . -B build-cpp -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build-cpp
  ctest --test-dir build-cpp --output-on-failure -j "$(nproc)"
}
stage "C++ tests (GoogleTest)" cpp_tests
stage "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer" bash scripts/sanitize.sh

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# (tests/cuda/test_gpu_check_dry_run.py runs `bash scripts/gpu_check.sh --dry-run` here: every
# path, test and script the GPU check names must resolve on CPU.) Tests marked nccl_order run a
# second time under CUDA's execution model on CPU (BYTESCALE_NCCL_ORDER=1: one in-order queue per
# group's transport, every backward on a separate thread), after all others (tests/conftest.py).
stage "Python tests (pytest; CUDA-order variants included)" "$PY" -m pytest tests -q "$@"
