"""Side by side: ``python -m bytescale.train.report NAME=metrics.jsonl ... [--plot out.png] [--skip K]
[--sim sim.json]``.

For each run (a metrics JSONL of ``python -m bytescale.train``): steps, first and last loss, mean
tokens/s, MFU, data wait, measured imbalance and the layout (the share of sequences, and of
tokens, that no rank shares: local) over the steps after the first ``--skip`` (warm-up),
restricted to the steps every run has (the same global batches); then the speed-up of the first
run over each other one, and a PNG of loss and throughput over steps. ``--sim`` adds what
``python -m bytescale.sim --json`` predicted at cluster scale, per strategy, with the same layout
columns, and one line setting the measured speed-up next to the predicted one. Runs whose records
carry the transport's counters (the trainer's ``comm_bytes``, ``ring_steps``, ``ring_wait_s``,
``local_token_share``) get a second table: bytes moved by ring attention and gradient sync, ring
steps and each rank's ring waiting per step, and the share of tokens that never leave their rank.
``--compare`` prints ``python -m bytescale.sim --compare``'s predictions on several distributions.
"""
from __future__ import annotations

import argparse
import json
import sys
from statistics import mean
from typing import Any, Dict, List, Optional, Sequence

from .metrics import plot_runs, read_jsonl

__all__ = ["compare", "sim_summary", "main"]

# how the simulator's strategies are named in the summary
SIM_NAMES = {"static": "static DP x CP", "pow2": "pow2 (Megatron-style CP)", "hdp": "HDP, dynamic comm only",
             "hdp-offload": "HDP + offload", "hdp-balance": "HDP + balance", "hdp-full": "HDP + remote loading"}


def _layout(sel: List[dict]) -> str:
    """Local sequences and tokens of the selected steps, e.g. ``71% /  15%``; ``-`` for metrics
    written before the trainer recorded the layout."""
    if not sel or any("sharded_sequences" not in r for r in sel):
        return f"{'-':>6} / {'-':>4}"
    seqs = sum(r["sequences"] for r in sel)
    toks = sum(r["tokens"] for r in sel)
    loc_s = 1 - sum(r["sharded_sequences"] for r in sel) / max(seqs, 1)
    loc_t = 1 - sum(r["sharded_tokens"] for r in sel) / max(toks, 1)
    return f"{loc_s:>6.0%} / {loc_t:>4.0%}"


def _traffic_lines(runs: Dict[str, List[dict]], steps: List[int]) -> List[str]:
    """Measured traffic per step, means over ``steps`` (runs without the fields are left out)."""
    rows, ring_mb = [], {}
    for name, recs in runs.items():
        by = {r["step"]: r for r in recs}
        sel = [by[s] for s in steps if "comm_bytes" in by[s]]
        if not sel:
            continue
        mb = {k: mean(r["comm_bytes"][k] for r in sel) / 1e6 for k in sel[0]["comm_bytes"]}
        ring = ring_mb[name] = mb["ring_kv_fwd"] + mb["ring_kv_bwd"] + mb["ring_dkv_bwd"]
        ring_steps = mean(mean(r["ring_steps"]) for r in sel)
        waits = [mean(r["ring_wait_s"][k] for r in sel) for k in range(len(sel[0]["ring_wait_s"]))]
        local = mean(r["local_token_share"] for r in sel)
        rows.append(f"{name:<24} {ring:>9.2f} {mb['ring_kv_fwd']:>8.2f} {mb['ring_kv_bwd']:>8.2f} "
                    f"{mb['ring_dkv_bwd']:>8.2f} {mb['grad_sync']:>8.2f} {ring_steps:>10.1f} "
                    f"{1e3 * min(waits):>6.0f}-{1e3 * max(waits):<6.0f} {local:>6.0%}")
    if not rows:
        return []
    names = list(ring_mb)
    ratios = [f"{n} / {names[0]}: {ring_mb[n] / ring_mb[names[0]]:.2f}x" for n in names[1:] if ring_mb[names[0]] > 0]
    return ["measured per step, counted by the transport (independent of the machine's load; MB summed over ranks):",
            f"{'run':<24} {'ring MB':>9} {'K/V fwd':>8} {'K/V bwd':>8} {'dK/dV':>8} {'grad MB':>8} "
            f"{'ring steps':>10} {'wait ms/rank':>13} {'local tokens':>12}"] + rows + \
        ([f"ring attention bytes per step, {', '.join(ratios)}"] if ratios else [])


def compare(runs: Dict[str, List[dict]], skip: int = 2) -> str:
    """The side-by-side table (module docstring) as text."""
    common = set.intersection(*(set(r["step"] for r in recs) for recs in runs.values()))
    steps = sorted(s for s in common if s >= skip)
    note = f"{len(steps)} steps after {skip} warm-up"
    if not steps:
        steps, note = sorted(common), f"all {len(common)} common steps: fewer than the {skip} warm-up"
    lines = [f"same global batches: steps {steps[0]}..{steps[-1]} ({note})",
             f"{'run':<24} {'steps':>5} {'loss first->last':>18} {'tok/s':>9} {'MFU':>7} {'wait/step':>10} "
             f"{'imbalance':>9}  local seqs / tokens"]
    speed = {}
    for name, recs in runs.items():
        by = {r["step"]: r for r in recs}
        sel = [by[s] for s in steps]
        speed[name] = sum(r["tokens"] for r in sel) / sum(r["step_time_s"] for r in sel)
        lines.append(f"{name:<24} {len(recs):>5} {recs[0]['loss']:>8.4f} -> {recs[-1]['loss']:<7.4f} "
                     f"{speed[name]:>9.0f} {100 * mean(r['mfu'] for r in sel):>6.2f}% "
                     f"{1e3 * mean(r['data_wait_s'] for r in sel):>7.1f} ms {mean(r['imbalance'] for r in sel):>9.2f}"
                     f"  {_layout(sel)}")
    traffic = _traffic_lines(runs, steps)
    if traffic:
        lines += traffic
    names = list(runs)
    for other in names[1:]:
        lines.append(f"speed-up {names[0]} / {other}: {speed[names[0]] / speed[other]:.2f}x "
                     "(tokens per second on the same steps)")
    for s in steps[:1] + steps[-1:]:
        losses = {n: next(r["loss"] for r in recs if r["step"] == s) for n, recs in runs.items()}
        lines.append(f"loss at step {s}: " + ", ".join(f"{n} {v:.4f}" for n, v in losses.items()))
    return "\n".join(lines)


def sim_summary(doc: Dict[str, Any], measured: Optional[str] = None) -> str:
    """What ``python -m bytescale.sim --json`` predicted, as a short table: per strategy the step
    time, tokens/s, MFU, the speed-up over ``static`` and the layout; ``measured`` (a line such as
    the CPU speed-up) is printed under it, next to the prediction it is compared with."""
    c = doc["config"]
    st = doc["strategies"]
    ctx = c["context"]
    ctx_s = f"{ctx >> 20}M" if ctx % (1 << 20) == 0 else f"{ctx >> 10}K" if ctx % 1024 == 0 else str(ctx)
    lines = [f"predicted at cluster scale by python -m bytescale.sim ({c['source']}: {c['sequences']} sequences, "
             f"{c['tokens'] / 1e6:.1f}M tokens, as one global batch): {c['model']} on {c['gpus']:,} GPUs "
             f"({c['gpus_per_node']} per node, {c['cluster']}), {ctx_s} context, {c['capacity']:,} tokens per GPU",
             f"{'strategy':<26} {'step (s)':>9} {'tokens/s':>10} {'MFU':>6} {'speed-up':>8} {'max ring':>8}"
             "  local seqs / tokens"]
    base = st.get("static")
    for name, r in st.items():
        up = f"{base['step_time_s'] / r['step_time_s']:.2f}x" if base and r["step_time_s"] > 0 else "-"
        loc = (f"{r['local_sequences'] / max(c['sequences'], 1):>6.0%} / {r['local_tokens'] / max(r['tokens'], 1):>4.0%}"
               if "local_sequences" in r else f"{'-':>6} / {'-':>4}")
        lines.append(f"{SIM_NAMES.get(name, name):<26} {r['step_time_s']:>9.2f} {r['tokens_per_s']:>10.3g} "
                     f"{r['mfu']:>6.3f} {up:>8} {r.get('max_ring', 1):>8}  {loc}")
    if measured:
        lines.append(measured)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="NAME=metrics.jsonl")
    ap.add_argument("--plot", help="PNG of loss and throughput over steps")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the means")
    ap.add_argument("--sim", help="JSON of python -m bytescale.sim --json: print its prediction after the runs")
    ap.add_argument("--compare", help="JSON of python -m bytescale.sim --compare --json: print the predictions on "
                    "several distributions last")
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
    text = compare(runs, a.skip)
    print(text)
    if a.plot and plot_runs(runs, a.plot):
        print(f"plot: {a.plot}")
    if a.sim:
        try:
            with open(a.sim) as f:
                doc = json.load(f)
            measured = next((ln for ln in text.splitlines() if ln.startswith("speed-up ")), None)
            base = doc["strategies"].get("static")
            hdp = doc["strategies"].get("hdp-balance") or doc["strategies"].get("hdp-full")
            note = None
            if measured and base and hdp:
                note = (f"measured here: {measured[len('speed-up '):].split(' (')[0]}; predicted at scale: "
                        f"HDP + balance / static DP x CP: {base['step_time_s'] / hdp['step_time_s']:.2f}x")
            print()
            print(sim_summary(doc, note))
        except (OSError, ValueError, KeyError) as e:
            print(f"bytescale.train.report: error: {a.sim}: {e!r}", file=sys.stderr)
            return 2
    if a.compare:
        try:
            from ..sim.compare import compare_table

            with open(a.compare) as f:
                doc = json.load(f)
            print()
            print(compare_table(doc))
            mine = doc["distributions"].get("this corpus")
            if mine:
                speed = next((ln for ln in text.splitlines() if ln.startswith("speed-up ")), "")
                ring = next((ln for ln in text.splitlines() if ln.startswith("ring attention bytes")), "")
                print(f"this corpus: measured here (tokens/s on shared CPU cores, load-dependent) "
                      f"{speed[len('speed-up '):].split(' (')[0] or '-'}; counted {ring or 'ring traffic: -'}; "
                      f"predicted at scale: HDP + balance / static DP x CP {mine['speedup']['hdp-balance']:.2f}x")
        except (OSError, ValueError, KeyError) as e:
            print(f"bytescale.train.report: error: {a.compare}: {e!r}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
