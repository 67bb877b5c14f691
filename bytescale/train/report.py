"""Side by side: ``python -m bytescale.train.report NAME=metrics.jsonl ... [--plot out.png] [--skip K]``.

For each run (a metrics JSONL of ``python -m bytescale.train``): steps, first and last loss, mean
tokens/s, MFU, data wait and measured imbalance over the steps after the first ``--skip``
(warm-up), restricted to the steps every run has (the same global batches); then the speed-up of
the first run over each other one, and a PNG of loss and throughput over steps.
"""
from __future__ import annotations

import argparse
import sys
from statistics import mean
from typing import Dict, List, Optional, Sequence

from .metrics import plot_runs, read_jsonl

__all__ = ["compare", "main"]


def compare(runs: Dict[str, List[dict]], skip: int = 2) -> str:
    """The side-by-side table (module docstring) as text."""
    common = set.intersection(*(set(r["step"] for r in recs) for recs in runs.values()))
    steps = sorted(s for s in common if s >= skip) or sorted(common)
    lines = [f"same global batches: steps {steps[0]}..{steps[-1]} ({len(steps)} steps after {skip} warm-up)",
             f"{'run':<24} {'steps':>5} {'loss first->last':>18} {'tok/s':>9} {'MFU':>7} {'wait/step':>10} {'imbalance':>9}"]
    speed = {}
    for name, recs in runs.items():
        by = {r["step"]: r for r in recs}
        sel = [by[s] for s in steps]
        speed[name] = sum(r["tokens"] for r in sel) / sum(r["step_time_s"] for r in sel)
        lines.append(f"{name:<24} {len(recs):>5} {recs[0]['loss']:>8.4f} -> {recs[-1]['loss']:<7.4f} "
                     f"{speed[name]:>9.0f} {100 * mean(r['mfu'] for r in sel):>6.2f}% "
                     f"{1e3 * mean(r['data_wait_s'] for r in sel):>7.1f} ms {mean(r['imbalance'] for r in sel):>9.2f}")
    names = list(runs)
    for other in names[1:]:
        lines.append(f"speed-up {names[0]} / {other}: {speed[names[0]] / speed[other]:.2f}x "
                     "(tokens per second on the same steps)")
    for s in steps[:1] + steps[-1:]:
        losses = {n: next(r["loss"] for r in recs if r["step"] == s) for n, recs in runs.items()}
        lines.append(f"loss at step {s}: " + ", ".join(f"{n} {v:.4f}" for n, v in losses.items()))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="NAME=metrics.jsonl")
    ap.add_argument("--plot", help="PNG of loss and throughput over steps")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the means")
    a = ap.parse_args(argv)
    runs = {}
    for item in a.runs:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = path or item, item
        try:
            runs[name] = read_jsonl(path)
        except (OSError, ValueError) as e:
            print(f"bytescale.train.report: error: {path}: {e}", file=sys.stderr)
            return 2
        if not runs[name]:
            print(f"bytescale.train.report: error: {path} has no steps", file=sys.stderr)
            return 2
    print(compare(runs, a.skip))
    if a.plot and plot_runs(runs, a.plot):
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
