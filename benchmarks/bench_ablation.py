"""The paper's ablation row by row, with each row's breakdown (issue 39).

    PYTHONPATH=. python benchmarks/bench_ablation.py [--seeds 3] [--json benchmarks/ablation.json]

LLaMA-7B (Table 1's GQA-8 shape), 2M context, 1,024 GPUs, 32M-token global batches of the paper's
two corpora (bytescale.data.synthetic), the simulator's stated model (bytescale.sim). Rows in the
paper's order and by its definitions: static DP x CP; + dynamic communication (HDP's any-size
rings, no balance scheduler, so every rank runs the same micro-batch slots in lockstep:
``hdp-lockstep``); + selective offloading (``hdp-offload-lockstep``); + balance scheduler
(``hdp-balance``, which drops the lockstep); + remote loading (``hdp-full``). The rows bytescale
also had before (``hdp``, ``hdp-offload``: the same plans without the lockstep, each rank running
its own micro-batches as soon as its ring partners are free) and ``pow2`` are printed too.
Per row: speed-up over static (mean and range over seeds) and the mean per-rank step breakdown
(compute, exposed ring communication, exposed offload copies, idle, gradient sync, data stall; as
shares of the step), the longest ring, the tokens no rank shares and the largest micro-batch count.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import numpy as np

from bytescale.data.synthetic import global_batch_lengths
from bytescale.sim import simulate_batch, split_at_context

ROWS = ("static", "pow2", "hdp", "hdp-lockstep", "hdp-offload", "hdp-offload-lockstep", "hdp-balance", "hdp-full")
PAPER = {"static": 1.0, "hdp-lockstep": 1.59, "hdp-offload-lockstep": 2.01, "hdp-balance": 3.69, "hdp-full": 3.89}
PARTS = ("compute_s", "exposed_comm_s", "offload_s", "idle_s", "grad_sync_s", "data_stall_s")


def run(corpus: str, seeds: int) -> Dict[str, Dict[str, float]]:
    acc: Dict[str, List[Dict[str, float]]] = {n: [] for n in ROWS}
    for seed in range(seeds):
        lens = split_at_context(global_batch_lengths(corpus, 32 << 20, seed=seed), 2 << 20)
        res = {r.strategy: r for r in simulate_batch(lens, "llama-7b", 1024, 8, list(ROWS))}
        base = res["static"].step_time_s
        for n, r in res.items():
            d = r.to_dict()
            acc[n].append({"speedup": base / r.step_time_s, "step_s": r.step_time_s,
                           **{k: d["breakdown_share"][k] for k in PARTS},
                           "max_ring": float(r.info.get("max_ring", 1)),
                           "local_tokens": d["local_tokens"] / max(r.tokens, 1),
                           "mbs_max": float(d["micro_batches_per_rank_max"])})
    out = {}
    for n, v in acc.items():
        m = {k: float(np.mean([x[k] for x in v])) for k in v[0]}
        m["speedup_min"] = float(min(x["speedup"] for x in v))
        m["speedup_max"] = float(max(x["speedup"] for x in v))
        out[n] = m
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    doc = {}
    for corpus in ("byted", "github"):
        r = doc[corpus] = run(corpus, a.seeds)
        print(f"\n### {corpus}: LLaMA-7B, 2M, 1,024 GPUs, 32M tokens, {a.seeds} seeds\n")
        print("| row | paper | speed-up [min-max] | step (s) | compute | exposed comm | offload | idle | grad sync "
              "| data | max ring | local tokens | max mbs/rank |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n in ROWS:
            m = r[n]
            paper = f"{PAPER[n]:.2f}x" if n in PAPER else "-"
            print(f"| {n} | {paper} | {m['speedup']:.2f}x [{m['speedup_min']:.2f}-{m['speedup_max']:.2f}] | "
                  f"{m['step_s']:.1f} | " + " | ".join(f"{100 * m[k]:.0f}%" for k in PARTS) +
                  f" | {m['max_ring']:.0f} | {100 * m['local_tokens']:.0f}% | {m['mbs_max']:.0f} |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
