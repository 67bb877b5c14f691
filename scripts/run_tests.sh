#!/usr/bin/env bash
# All tests: the C++ GoogleTest suite (ctest) and the Python suite (pytest, multi-process tests
# included). Installs and builds what it needs first (scripts/setup_env.sh); on a built tree that
# finds out in seconds, and the GoogleTest and sanitizer builds (build-cpp, build-asan) are
# incremental too. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=${PYTHON:-python3}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)}  # as setup_env.sh: cache hits across clones

echo "== C++ tests (GoogleTest) =="
cmake -S . -B build-cpp -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-cpp
ctest --test-dir build-cpp --output-on-failure

echo "== C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer =="
bash scripts/sanitize.sh

echo "== Python tests (pytest) =="
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# (tests/cuda/test_gpu_check_dry_run.py runs `bash scripts/gpu_check.sh --dry-run` here: every
# path, test and script the GPU check names must resolve on CPU.)
"$PY" -m pytest tests -q "$@"

echo "== CUDA's execution model on CPU (BYTESCALE_NCCL_ORDER=1) =="
# One in-order queue per group's transport (as one NCCL stream per communicator) and every
# backward on a separate thread (as CUDA autograd's device thread): the multi-process runtime,
# attention and HF-training tests again (bytescale/testing.py).
BYTESCALE_NCCL_ORDER=1 "$PY" -m pytest tests/runtime tests/attention tests/train/test_train_hf.py -q "$@"
