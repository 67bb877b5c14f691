#!/usr/bin/env bash
# The GPU session's checks, in one command for the lent single-GPU machine (see DEVELOPERS notes in
# benchmarks/RESULTS.md): build there, run the CUDA tests, the benchmarks and a short demo.
#   bash scripts/gpu_check.sh [build] [test] [bench] [demo]     (default: all)
# Logs go to $OUT (or ./gpu-out) when set.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
stages=${*:-build test bench demo}
rc=0
has() { [[ " $stages " == *" $1 "* ]] && echo "== stage $1 at $(date +%T)"; }
if has build; then
  nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  # The image's default c++ (/opt/gcc) links parts of libstdc++ into the extension, whose
  # iostreams then crash beside torch's libstdc++ (seen 2026-11-22); use the system compiler.
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
  ${CXX:-c++} --version | head -1
  t0=$(date +%s)
  MAX_JOBS=16 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  ldd bytescale/_C*.so | grep -i "stdc\|nccl"
fi
if has test; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_attention.py tests/test_cuda_backend.py \
    "tests/test_offload.py::test_cuda_offload_bit_identical" 2>&1 | tee "$OUT/tests.log" | tail -40
  rc=$(( rc | ${PIPESTATUS[0]} ))
  timeout 60 python3 scripts/cuda_smoke.py 2>&1 | tee "$OUT/smoke.log" | tail -5
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
if has bench; then
  timeout 200 python3 benchmarks/bench_ring_attention.py --cuda --reps ${REPS:-3} --json "$OUT/ring.json" --png "$OUT/ring_attention.png" 2>&1 | tee "$OUT/bench_ring.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
if has offload; then
  timeout 90 python3 benchmarks/bench_offload.py --cuda --seq 32768 --dim 4096 --layers 4 --png "$OUT/offload_cuda.png" 2>&1 | tee "$OUT/bench_offload.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
if has demo; then
  # the training entry point on one GPU: bf16, FSDP2, activation checkpointing, a checkpoint, resume
  timeout 120 torchrun --standalone --nproc_per_node 1 -m bytescale.train --device cuda --data synthetic:byted \
    --model small --capacity 8192 --tokens-per-batch 32768 --steps 6 --stop-after 4 --bf16 --fsdp \
    --activation-checkpointing --checkpoint-dir "$OUT/ckpt" --metrics "$OUT/train.jsonl" 2>&1 | tee "$OUT/demo.log" | tail -25
  rc=$(( rc | ${PIPESTATUS[0]} ))
  timeout 120 torchrun --standalone --nproc_per_node 1 -m bytescale.train --device cuda --data synthetic:byted \
    --model small --capacity 8192 --tokens-per-batch 32768 --steps 6 --bf16 --fsdp --activation-checkpointing \
    --checkpoint-dir "$OUT/ckpt" --resume --metrics "$OUT/train.jsonl" 2>&1 | tee -a "$OUT/demo.log" | tail -8
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
exit $rc
