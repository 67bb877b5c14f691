"""Reproduces the ByteScale paper's scale results with the step simulator (issue 14).

    PYTHONPATH=. python benchmarks/bench_sim.py --png benchmarks/sim.png --tp-png benchmarks/sim_tp.png [--seeds 3]

1. Ablation (paper: LLaMA-7B, 2M context, 1,024 GPUs; speed-up over static DP x CP of dynamic
   communication 1.59x, + offloading 2.01x, + balance 3.69x, + remote loading 3.89x), both corpora.
2. Fig. 17's trend: context 256K -> 2M (32M-token batches, 1,024 GPUs): static loses about half its
   throughput per doubling, HDP about 1.08x.
3. The best case (paper: up to 7.89x, GitHub, 2M, LLaMA-7B): hdp-full over static for GitHub at 2M
   on 256-4,096 GPUs.
4. Sensitivity of the ablation to the K/V bytes (the Table 1 GQA-8 preset vs an MHA LLaMA-7B).
5. HDP + TP (paper: LLaMA-7B/13B/30B trained with HDP + TP; GitHub 2M 6.21-7.89x over static):
   hdp-full beside static DP x CP x TP, TP 1-8, 1,024 GPUs, 2M context, both corpora.
Every number is a prediction of bytescale.sim's stated model (h100-nvlink-ib400 preset, FLOP-derived
cost model at 40% of peak, the paper's Table 1 shapes); nothing is fitted to the paper. Means over
``--seeds`` global batches.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List

import numpy as np

from bytescale.data.synthetic import global_batch_lengths
from bytescale.sim import STRATEGIES, simulate_batch, split_at_context

PAPER_ABLATION = {"hdp": 1.59, "hdp-offload": 2.01, "hdp-balance": 3.69, "hdp-full": 3.89}
K = 1024


def run(corpus: str, context: int, gpus: int, seeds: int, names=tuple(STRATEGIES), model="llama-7b",
        tokens: int = 32 << 20, tp: int = 1) -> Dict[str, Dict[str, float]]:
    """Per strategy: mean step time, tokens/s, MFU and speed-up over static (when simulated)."""
    acc: Dict[str, List[tuple]] = {n: [] for n in names}
    info: Dict[str, dict] = {}
    for seed in range(seeds):
        lens = split_at_context(global_batch_lengths(corpus, tokens, seed=seed), context)
        res = {r.strategy: r for r in simulate_batch(lens, model, gpus, 8, list(names), tp=tp)}
        base = res["static"].step_time_s if "static" in res else float("nan")
        for n, r in res.items():
            acc[n].append((r.step_time_s, r.tokens_per_s, r.mfu, base / r.step_time_s))
            b = r.breakdown()
            acc[n][-1] += (b["tp_comm_s"] / r.step_time_s, b["exposed_comm_s"] / r.step_time_s)
            info[n] = {"capacity": r.info["capacity"], "cp": r.info.get("cp"), "max_ring": r.info.get("max_ring")}
    return {n: dict(zip(("step_s", "tokens_per_s", "mfu", "speedup", "tp_share", "comm_share"), np.mean(v, axis=0)))
            | {"speedup_min": float(min(x[3] for x in v)), "speedup_max": float(max(x[3] for x in v))} | info[n]
            for n, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--png", default=None)
    ap.add_argument("--tp-png", default=None, help="the HDP + TP figure (section 5)")
    args = ap.parse_args()
    t0 = time.perf_counter()

    print("## 1. Ablation: LLaMA-7B, 2M context, 1,024 GPUs, 32M-token batches "
          f"(speed-up over static, mean of {args.seeds} batches [min-max])\n")
    abl = {c: run(c, 2 * K * K, 1024, args.seeds) for c in ("byted", "github")}
    print("| strategy | paper | byted | github | byted step (s) | github step (s) | byted MFU | github MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for n in STRATEGIES:
        b, g = abl["byted"][n], abl["github"][n]
        paper = f"{PAPER_ABLATION[n]:.2f}x" if n in PAPER_ABLATION else ("1.00x" if n == "static" else "-")
        print(f"| {n} | {paper} | {b['speedup']:.2f}x [{b['speedup_min']:.2f}-{b['speedup_max']:.2f}] | "
              f"{g['speedup']:.2f}x [{g['speedup_min']:.2f}-{g['speedup_max']:.2f}] | {b['step_s']:.1f} | "
              f"{g['step_s']:.1f} | {b['mfu']:.3f} | {g['mfu']:.3f} |")

    print("\n## 2. Fig. 17's trend: throughput vs context (LLaMA-7B, 1,024 GPUs, 32M tokens)\n")
    ctxs = [256 * K, 512 * K, 1024 * K, 2048 * K]
    trend = {c: [run(c, x, 1024, args.seeds, ("static", "hdp-full")) for x in ctxs] for c in ("byted", "github")}
    print("| corpus | context | static tokens/s | hdp-full tokens/s | static loss vs previous | "
          "hdp-full loss vs previous | hdp-full / static |")
    print("|---|---|---|---|---|---|---|")
    for c, rows in trend.items():
        for i, (x, r) in enumerate(zip(ctxs, rows)):
            s, h = r["static"]["tokens_per_s"], r["hdp-full"]["tokens_per_s"]
            ls = f"{rows[i - 1]['static']['tokens_per_s'] / s:.2f}x" if i else "-"
            lh = f"{rows[i - 1]['hdp-full']['tokens_per_s'] / h:.2f}x" if i else "-"
            print(f"| {c} | {x // K}K | {s:.4g} | {h:.4g} | {ls} | {lh} | {h / s:.2f}x |")

    print("\n## 3. Best case: GitHub, 2M context, LLaMA-7B (paper: up to 7.89x)\n")
    best = {}
    print("| GPUs | hdp-full / static | static step (s) | hdp-full step (s) |")
    print("|---|---|---|---|")
    for gpus in (256, 512, 1024, 2048, 4096):
        r = run("github", 2 * K * K, gpus, args.seeds, ("static", "hdp-full"))
        best[gpus] = r["hdp-full"]["speedup"]
        print(f"| {gpus} | {r['hdp-full']['speedup']:.2f}x [{r['hdp-full']['speedup_min']:.2f}-"
              f"{r['hdp-full']['speedup_max']:.2f}] | {r['static']['step_s']:.1f} | {r['hdp-full']['step_s']:.1f} |")
    print(f"\nup to {max(best.values()):.2f}x (paper 7.89x)")

    print("\n## 4. Sensitivity of the ablation (byted, 2M, 1,024 GPUs) to the ring-communication term\n")
    from dataclasses import replace as _replace

    from bytescale.sim import model_shape

    mha = _replace(model_shape("llama-7b"), name="llama-7b-mha", kv_heads=32)
    variants = [("llama-7b (Table 1, GQA-8: 4 KB K/V per token per layer)", "llama-7b"),
                ("llama-7b with MHA K/V (16 KB; the former preset)", mha)]
    print("| model | " + " | ".join(STRATEGIES) + " |")
    print("|---|" + "---|" * len(STRATEGIES))
    for label, m in variants:
        r = run("byted", 2 * K * K, 1024, args.seeds, model=m)
        print(f"| {label} | " + " | ".join(f"{r[n]['speedup']:.2f}x" for n in STRATEGIES) + " |")

    print("\n## 5. HDP + TP: LLaMA-7B/13B/30B, 2M context, 1,024 GPUs, 32M-token batches "
          "(hdp-full beside static DP x CP x TP; paper, GitHub 2M: 6.21-7.89x)\n")
    tps = (1, 2, 4, 8)
    tpr: Dict[tuple, Dict[str, Dict[str, float]]] = {}
    print("| model | TP | units | capacity / unit | corpus | static CP | static step (s) | hdp-full step (s) | "
          "hdp-full / static | MFU static / hdp-full | TP comm share static / hdp-full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in ("llama-7b", "llama-13b", "llama-30b"):
        for t in tps:
            for c in ("byted", "github"):
                r = run(c, 2 * K * K, 1024, args.seeds, ("static", "hdp-full"), model=m, tp=t)
                tpr[(m, t, c)] = r
                st, h = r["static"], r["hdp-full"]
                print(f"| {m} | {t} | {1024 // t} | {st['capacity']} | {c} | {st['cp']} | {st['step_s']:.1f} | "
                      f"{h['step_s']:.1f} | {h['speedup']:.2f}x [{h['speedup_min']:.2f}-{h['speedup_max']:.2f}] | "
                      f"{st['mfu']:.3f} / {h['mfu']:.3f} | {st['tp_share']:.1%} / {h['tp_share']:.1%} |")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")

    if args.tp_png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (b1, b2) = plt.subplots(1, 2, figsize=(12, 4.6))
        cols = {"llama-7b": "#4c72b0", "llama-13b": "#dd8452", "llama-30b": "#55a868"}
        for m, col in cols.items():
            for c, ls in (("github", "-"), ("byted", ":")):
                b1.plot(tps, [tpr[(m, t, c)]["hdp-full"]["tokens_per_s"] for t in tps], "o" + ls, color=col,
                        label=f"hdp-full {m} ({c})")
                b1.plot(tps, [tpr[(m, t, c)]["static"]["tokens_per_s"] for t in tps], "x" + ls, color=col, alpha=0.5,
                        label=f"static {m} ({c})")
                b2.plot(tps, [tpr[(m, t, c)]["hdp-full"]["speedup"] for t in tps], "o" + ls, color=col,
                        label=f"{m} ({c})")
        b2.axhspan(6.21, 7.89, color="#8c8c8c", alpha=0.25, label="paper, GitHub 2M (6.21-7.89x)")
        for ax in (b1, b2):
            ax.set_xscale("log", base=2)
            ax.set_xticks(tps, [str(t) for t in tps])
            ax.set_xlabel("TP (GPUs per HDP unit)")
        b1.set_yscale("log")
        b1.set_ylabel("tokens/s (simulated)")
        b1.set_title("HDP + TP vs static DP x CP x TP: 2M, 1,024 GPUs")
        b1.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        b2.set_ylabel("hdp-full / static")
        b2.set_title("speed-up over static DP x CP x TP")
        b2.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        fig.tight_layout()
        fig.savefig(args.tp_png, dpi=110, bbox_inches="tight")
        print(f"wrote {args.tp_png}")

    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
        xs = np.arange(len(STRATEGIES))
        w = 0.27
        a1.bar(xs - w, [1.0] + [float("nan")] + [PAPER_ABLATION.get(n, np.nan) for n in list(STRATEGIES)[2:]],
               w, label="paper", color="#8c8c8c")
        a1.bar(xs, [abl["byted"][n]["speedup"] for n in STRATEGIES], w, label="sim byted", color="#4c72b0")
        a1.bar(xs + w, [abl["github"][n]["speedup"] for n in STRATEGIES], w, label="sim github", color="#dd8452")
        a1.set_xticks(xs, list(STRATEGIES), fontsize=8)
        a1.set_ylabel("speed-up over static DP x CP")
        a1.set_title("ablation: LLaMA-7B, 2M, 1,024 GPUs")
        a1.legend(fontsize=8)
        for c, col in (("byted", "#4c72b0"), ("github", "#dd8452")):
            a2.plot([x // K for x in ctxs], [r["static"]["tokens_per_s"] for r in trend[c]], "o--", color=col,
                    label=f"static ({c})")
            a2.plot([x // K for x in ctxs], [r["hdp-full"]["tokens_per_s"] for r in trend[c]], "o-", color=col,
                    label=f"hdp-full ({c})")
        a2.set_xscale("log", base=2)
        a2.set_yscale("log")
        a2.set_xlabel("context (K tokens)")
        a2.set_ylabel("tokens/s (simulated)")
        a2.set_title("Fig. 17 trend: throughput vs context")
        a2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
