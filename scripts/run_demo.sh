#!/usr/bin/env bash
# The main job. (1) Prepare, once, a real corpus present on every machine: the source and
# documentation files of the installed Python packages and of the standard library, one document
# per package cut at 2 MiB (the paper's 2M context), byte-level tokens (python -m
# bytescale.data.prepare --python-packages). (2) Train a small Llama on it with HDP: 4 CPU
# processes, torchrun, the bytescale backend (python -m bytescale.train), every document scaled to
# 1/2048 of its length; the loss falls. (3) Train the static DP x CP baseline (one CP degree sized
# for the longest document) on the same global batches from the same weights. (4) Ask the
# simulator (python -m bytescale.sim) what the three layouts would do with the same corpus,
# unscaled, at the paper's scale (LLaMA-7B, 2M context, 1,024 GPUs). (5) Print the measured runs
# side by side with the prediction, and draw loss/throughput over steps.
#   STEPS=40 BASELINE_STEPS=16 NPROC=4 bash scripts/run_demo.sh [more bytescale.train options]
# SKIP_SETUP=1 skips scripts/setup_env.sh (an installed, built tree); DATA=synthetic:byted trains
# on the synthetic corpus instead; PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
NPROC=${NPROC:-4}
STEPS=${STEPS:-40}
BASELINE_STEPS=${BASELINE_STEPS:-16}
DATA=${DATA:-data/python-packages-2m}
OUT=${OUT:-runs/demo}
# Documents are cut at 2 MiB = 2M byte tokens; 1/2048 of that is 1024 tokens, which needs all 4
# ranks at 256 tokens each (static CP 4), as a 2M document needs 256 GPUs at 8K each.
LENGTH_SCALE=0.00048828125

if [[ "$DATA" != synthetic:* && ! -f "$DATA/data.idx" ]]; then
  echo "=== preparing the python-packages corpus into $DATA (once)"
  $PY -m bytescale.data.prepare --python-packages --max-doc-bytes 2097152 --workers 2 --output "$DATA"
fi
rm -rf "$OUT"
mkdir -p "$OUT"
COMMON=(--data "$DATA" --length-scale "$LENGTH_SCALE" --model tiny --capacity 256 --tokens-per-batch 4096
        --steps "$STEPS" --lr 1e-2 --warmup-steps 3)
RUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m bytescale.train)

echo "=== HDP: $NPROC ranks, bytescale backend"
"${RUN[@]}" "${COMMON[@]}" --metrics "$OUT/hdp.jsonl" --samples-log "$OUT/hdp.samples.jsonl" \
  --checkpoint-dir "$OUT/checkpoints" --save-every 10 "$@"

echo "=== static DP x CP baseline: the same batches and weights, first $BASELINE_STEPS steps"
"${RUN[@]}" "${COMMON[@]}" --strategy static --stop-after "$BASELINE_STEPS" --run-name "static DPxCP" \
  --metrics "$OUT/static.jsonl" --samples-log "$OUT/static.samples.jsonl" "$@"

echo "=== at cluster scale: the simulator on the same corpus, unscaled ($OUT/sim.txt, sim.json, sim.png)"
if [[ "$DATA" == synthetic:* ]]; then SIM_SRC=(--corpus "${DATA#synthetic:}"); else SIM_SRC=(--lengths "$DATA"); fi
$PY -m bytescale.sim "${SIM_SRC[@]}" --model llama-7b --gpus 1024 --gpus-per-node 8 --context 2M \
  --strategy static,pow2,hdp-balance --json "$OUT/sim.json" --png "$OUT/sim.png" >"$OUT/sim.txt"

echo "=== side by side: measured here, and predicted at scale"
$PY -m bytescale.train.report HDP="$OUT/hdp.jsonl" "static DPxCP=$OUT/static.jsonl" --plot "$OUT/demo.png" \
  --sim "$OUT/sim.json"
