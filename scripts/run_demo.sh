#!/usr/bin/env bash
# The main job. (1) Prepare, once, a real corpus present on every machine: the source and
# documentation files of the installed Python packages and of the standard library, one document
# per package, byte-level tokens (python -m bytescale.data.prepare --python-packages). (2) Train a
# small Llama on it with HDP: 4 CPU processes, torchrun, the bytescale backend
# (python -m bytescale.train); the loss falls. (3) Train the static DP x CP baseline (one CP degree
# sized for the longest document) on the same global batches from the same weights. (4) Print
# both side by side with the speed-up and draw loss/throughput over steps.
#   STEPS=40 BASELINE_STEPS=16 NPROC=4 bash scripts/run_demo.sh [more bytescale.train options]
# SKIP_SETUP=1 skips scripts/setup_env.sh (an installed, built tree); DATA=synthetic:byted trains
# on the synthetic corpus instead.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
NPROC=${NPROC:-4}
STEPS=${STEPS:-40}
BASELINE_STEPS=${BASELINE_STEPS:-16}
DATA=${DATA:-data/python-packages}
OUT=${OUT:-runs/demo}

if [[ "$DATA" != synthetic:* && ! -f "$DATA/data.idx" ]]; then
  echo "=== preparing the python-packages corpus into $DATA (once)"
  # each package's document is cut at 512 KiB; training keeps its first 1/512 (--length-scale):
  # the corpus' length distribution (a heavy tail), 1 to 1024 tokens, at CPU scale
  $PY -m bytescale.data.prepare --python-packages --max-doc-bytes 524288 --workers 2 --output "$DATA"
fi
rm -rf "$OUT"
mkdir -p "$OUT"
COMMON=(--data "$DATA" --length-scale 0.001953125 --model tiny --capacity 256 --tokens-per-batch 4096
        --steps "$STEPS" --lr 1e-2 --warmup-steps 3)
RUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m bytescale.train)

echo "=== HDP: $NPROC ranks, bytescale backend"
"${RUN[@]}" "${COMMON[@]}" --metrics "$OUT/hdp.jsonl" --samples-log "$OUT/hdp.samples.jsonl" \
  --checkpoint-dir "$OUT/checkpoints" --save-every 10 "$@"

echo "=== static DP x CP baseline: the same batches and weights, first $BASELINE_STEPS steps"
"${RUN[@]}" "${COMMON[@]}" --strategy static --stop-after "$BASELINE_STEPS" --run-name "static DPxCP" \
  --metrics "$OUT/static.jsonl" --samples-log "$OUT/static.samples.jsonl" "$@"

echo "=== side by side"
$PY -m bytescale.train.report HDP="$OUT/hdp.jsonl" "static DPxCP=$OUT/static.jsonl" --plot "$OUT/demo.png"
