#!/usr/bin/env bash
# The main job. (1) Prepare, once, a real corpus present on every machine: the installed Python
# packages and the standard library as a code corpus, one document per source file plus one
# repository-level document per package (its files concatenated, as long-context code corpora are
# built), cut at 2 MiB = 2M byte tokens (the paper's 2M context): python -m bytescale.data.prepare
# --python-code; its length histogram is printed and drawn (DATA/lengths.png). CORPUS=packages
# takes the former corpus instead (one document per package, --python-packages). (2) Train a small
# Llama on it with HDP: 4 CPU processes, torchrun, the bytescale backend (python -m bytescale.train),
# every document scaled to 1/2048 of its length; the loss falls. (3) Train the static DP x CP
# baseline (one CP degree sized for the longest document) on the same global batches from the
# same weights. Both runs record, per step, what the transport counted: bytes moved by ring
# attention (K/V forward and backward, dK/dV) and by gradient sync, ring steps, each rank's time
# waiting for ring partners, and the share of tokens that never leave their rank. (4) Ask the
# simulator (python -m bytescale.sim --compare) what static DP x CP, pow2 and HDP would do at the
# paper's scale (LLaMA-7B, 2M context, 1,024 GPUs) on a 32M-token batch of this corpus and of four
# published distributions (the paper's byted and github, MagiAttention's short and long ones).
# (5) Print the runs side by side (tokens/s next to the counted traffic) and the predictions, and
# draw loss/throughput over steps.
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
CORPUS=${CORPUS:-code}
case "$CORPUS" in
  code) DEFAULT_DATA=data/python-code-2m; PREP_FLAG=--python-code ;;
  packages) DEFAULT_DATA=data/python-packages-2m; PREP_FLAG=--python-packages ;;
  *) echo "CORPUS=$CORPUS: choose code (the default) or packages" >&2; exit 2 ;;
esac
DATA=${DATA:-$DEFAULT_DATA}
OUT=${OUT:-runs/demo}
# Documents are cut at 2 MiB = 2M byte tokens; 1/2048 of that is 1024 tokens, which needs all 4
# ranks at 256 tokens each (static CP 4), as a 2M document needs 256 GPUs at 8K each.
LENGTH_SCALE=0.00048828125

if [[ "$DATA" != synthetic:* ]]; then
  if [[ ! -f "$DATA/data.idx" ]]; then
    echo "=== preparing the installed packages ($PREP_FLAG) into $DATA (once)"
    $PY -m bytescale.data.prepare "$PREP_FLAG" --max-doc-bytes 2097152 --workers 2 --output "$DATA"
  fi
  echo "=== the corpus's document lengths"
  $PY -m bytescale.data.prepare --output "$DATA" --describe
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

echo "=== at cluster scale: the simulator on a 32M-token batch of this corpus and of four published distributions"
DISTS=byted,github,magi-short,magi-long
[[ "$DATA" == synthetic:* ]] || DISTS="this corpus=$DATA,$DISTS"
$PY -m bytescale.sim --compare "$DISTS" --model llama-7b --gpus 1024 \
  --gpus-per-node 8 --context 2M --global-batch-tokens 32M --json "$OUT/compare.json" --png "$OUT/compare.png" \
  >"$OUT/compare.txt"

echo "=== side by side: measured here, and predicted at scale"
$PY -m bytescale.train.report HDP="$OUT/hdp.jsonl" "static DPxCP=$OUT/static.jsonl" --plot "$OUT/demo.png" \
  --compare "$OUT/compare.json"
