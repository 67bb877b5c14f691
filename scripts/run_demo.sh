#!/usr/bin/env bash
# The main job: a real multi-process HDP training run of a small Llama-style model on CPU with the
# bytescale backend (4 processes via torchrun), then the same data under a static DP x CP
# baseline, side by side. Installs and builds what it needs first (scripts/setup_env.sh).
#   STEPS=20 NPROC=4 bash scripts/run_demo.sh [extra args for examples/train_llama.py]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python3 -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-4}" \
  examples/train_llama.py --steps "${STEPS:-20}" --baseline "$@"
