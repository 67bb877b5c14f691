"""HDP 2 x TP 2 against HDP 4 on the same global batches, measured on CPU through the real entry point
(``torchrun --nproc_per_node 4 -m bytescale.train``): the same data, model, seed and steps, run
``--rounds`` times alternately (TP, HDP, TP, HDP, ...) so load on the machine hits both alike.

    python benchmarks/bench_tp.py --steps 8 --rounds 2 --model small --json tp.json

Reported per configuration: the median step time over the measured steps (the first two are
warm-up), tokens/s, the loss of the last step (both runs see the same batches from the same
weights, so the losses agree to float tolerance) and the machine's load average during the run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tmp: Path, name: str, args, extra) -> dict:
    metrics = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "-m", "bytescale.train", "--data", args.data, "--model", args.model, "--steps", str(args.steps),
           "--capacity", str(args.capacity), "--tokens-per-batch", str(args.tokens_per_batch),
           "--synthetic-docs", "2000", "--synthetic-scale", str(args.scale), "--progress=false",
           "--max-length", str(args.capacity * 2),  # the same documents for 2 units and 4 ranks
           "--metrics", str(metrics), "--plot", str(tmp / f"{name}.png"), *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    load0 = os.getloadavg()[0]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=3600)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"rows": rows, "load": (load0 + os.getloadavg()[0]) / 2}


def run_arguments(doc: str, capacity_help: str) -> argparse.ArgumentParser:
    """The options of the measured entry-point benchmarks (what :func:`_run` reads)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="synthetic:byted")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=2048, help=capacity_help)
    ap.add_argument("--tokens-per-batch", type=int, default=16384)
    ap.add_argument("--scale", type=float, default=1 / 256)
    ap.add_argument("--json")
    return ap


def main(argv=None) -> None:
    ap = run_arguments(__doc__, "tokens per micro-batch per rank (HDP 4) and per unit (HDP 2 x TP 2)")
    args = ap.parse_args(argv)
    configs = {"HDP 2 x TP 2": ["--tp", "2"], "HDP 4": []}
    runs = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for name, extra in configs.items():
                runs[name].append(_run(Path(d), f"{name.replace(' ', '')}-{r}", args, extra))
    out = {}
    for name, rs in runs.items():
        times = [row["step_time_s"] for run in rs for row in run["rows"][2:]]
        tokens = [row["tokens"] for run in rs for row in run["rows"][2:]]
        out[name] = {"median_step_s": statistics.median(times), "tokens_per_s": sum(tokens) / sum(times),
                     "last_loss": rs[0]["rows"][-1]["loss"], "load": statistics.mean(run["load"] for run in rs),
                     "steps_measured": len(times)}
    base = out["HDP 4"]["median_step_s"]
    print(f"{'config':<14} {'median step (s)':>16} {'tokens/s':>10} {'vs HDP 4':>9} {'last loss':>10} {'load':>6}")
    for name, o in out.items():
        print(f"{name:<14} {o['median_step_s']:>16.3f} {o['tokens_per_s']:>10.0f} {base / o['median_step_s']:>8.2f}x "
              f"{o['last_loss']:>10.4f} {o['load']:>6.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
