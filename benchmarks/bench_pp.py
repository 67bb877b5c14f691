"""Pipeline parallelism under HDP (issue 23): PP-Balance against Megatron's lockstep slots, DP-Balance
per pipeline and naive ordering in the planner, and HDP + PP-Balance against static DP x CP x TP x PP
in the simulator.

    PYTHONPATH=. python benchmarks/bench_pp.py [--seeds 3] [--png benchmarks/pp.png] [--sections planner,sim,mixed]
    PYTHONPATH=. python benchmarks/bench_pp.py --sections paper --seeds 5 --png benchmarks/pp_paper.png

1. Planner (the C++ planner's own cost model and 1F1B replay, ``bytescale.plan(..., pp=P)``): one
   stage of LLaMA-70B at TP 8 (the simulator's FLOP-derived cost model, ``layers / P`` layers), its
   stage-to-stage transfers, 8M-token batches of the synthetic corpora cut at 512K (32 pipelines of
   16K-token units hold 512K without offloading; no strategy offloads here, so every one plans the
   same micro-batch sizes' problem); per (corpus, pipelines H, depth P) the replayed step over the pipelined lower bound and the bubble (idle share
   of every stage) of ``pp-balance``, ``pp-lockstep`` (every pipeline the same slots, Megatron's
   dynamic CP with PP), ``balanced`` (DP-Balance per pipeline: the flat sync-aware order, rings
   aligned at common slots) and ``naive`` (Alg. 1's token-balanced order, slotted), plus planning
   time.
2. Simulator (``bytescale.sim``): the paper's LLaMA-70B and Mistral 8x7B (Table 1 shapes) at 2M
   context, 32M-token batches, GitHub- and Byted-like data: static DP x CP x TP x PP against HDP
   with DP-Balance per pipeline (hdp-full), lockstep slots and PP-Balance (hdp-pp-balance); the
   paper reports 3.42x-4.28x for PP-balanced large models.
3. Issue 34 (``paper``): PP-Balance (``hdp-pp-balance``) against Megatron's lockstep slots
   (``lockstep``, i.e. ``pp-lockstep``) and the static DP x CP x TP x PP baseline, side by side on the
   same batches, at the paper's large-model settings: LLaMA-70B and Mixtral 8x22B (Table 1 shapes),
   32M-token batches, 256K-2M context, GitHub- and Byted-like data; step ratios against static and
   against lockstep, bubbles, the step's breakdown, and which candidate PP-Balance kept.
4. Mixed small batches (``mixed``): PP-Balance, lockstep slots, DP-Balance per pipeline and naive
   ordering on 80 seeded batches of 2-8 pipelines x 2-7 stages, with and without rings.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

import bytescale
from bytescale.data.synthetic import global_batch_lengths
from bytescale.sim import cluster, cost_model, default_capacity, model_shape, planner_cost, simulate_batch, split_at_context
from bytescale.sim.model import FWD_SHARE, p2p_terms

M = 1 << 20
PLANNER_STRATEGIES = ("pp-balance", "pp-lockstep", "balanced", "naive")
SIM_STRATEGIES = ("static", "hdp-full", "lockstep", "hdp-pp-balance")
# model -> (TP, PP, GPUs): our choice (the brief does not give the paper's degrees; see RESULTS.md)
SIM_RUNS = {"llama-70b": (8, 4, 4096), "mistral-8x7b": (4, 4, 1024)}
PAPER_STRATEGIES = ("static", "lockstep", "hdp-pp-balance")
# (model, TP, PP, GPUs): our degrees (the brief gives neither the paper's GPU counts nor its TP/PP
# degrees): TP 8 inside a node, the fewest GPUs whose pipelines hold a 2M sequence without offloading
# (pipelines x capacity >= 2M: 70B 128 x 16K, 8x22B 64 x 32K), and one deeper pipeline of each
PAPER_RUNS = (("llama-70b", 8, 4, 4096), ("llama-70b", 8, 8, 8192),
              ("mistral-8x22b", 8, 4, 2048), ("mistral-8x22b", 8, 8, 4096))
PAPER_CONTEXTS = (256 * 1024, 512 * 1024, M, 2 * M)


def planner_section(seeds: int, rows: List[dict]) -> None:
    shape = model_shape("llama-70b")
    print("## 1. Planner: step, step / pipelined lower bound, bubble, planning ms (LLaMA-70B stage, TP 8, "
          "512K context, 8M-token batches)")
    print(f"{'corpus':<7} {'H':>3} {'P':>2} {'cap':>6} | " + " | ".join(f"{s:^24}" for s in PLANNER_STRATEGIES))
    for corpus in ("github", "byted"):
        for P in (2, 4, 8):
            for H in (32,):
                gpus = H * 8 * P
                cl = cluster("h100-nvlink-ib400", gpus, 8)
                cm = planner_cost(cost_model(shape, cl, tp=8, pp=P), shape, cl, 8)
                cap = default_capacity(shape, cl, cost_model(shape, cl, tp=8, pp=P), tp=8, pp=P)
                per_token, bw, lat = p2p_terms(shape, cl, 8, P)
                pipe = {"fwd_share": FWD_SHARE, "p2p_bytes_per_token": per_token, "p2p_bw": bw, "p2p_latency": lat}
                acc: Dict[str, List[tuple]] = {s: [] for s in PLANNER_STRATEGIES}
                for seed in range(seeds):
                    lens = split_at_context(global_batch_lengths(corpus, 8 * M, seed=seed), M // 2)
                    for s in PLANNER_STRATEGIES:
                        t0 = time.perf_counter()
                        try:
                            p = bytescale.plan(lens, H, cap, strategy=s, cost=cm, pp=P, pipeline=pipe)
                        except ValueError as e:
                            acc[s].append((np.nan, np.nan, np.nan, np.nan))
                            print(f"  {s}: {e}")
                            continue
                        ms = (time.perf_counter() - t0) * 1e3
                        acc[s].append((p.makespan, p.makespan / p.lower_bound, p.bubble, ms))
                        if p.strategy != s:
                            print(f"  {corpus} P={P} seed {seed}: {s} kept its {p.strategy} candidate")
                line = f"{corpus:<7} {H:>3} {P:>2} {cap:>6} |"
                means = {s: np.nanmean(np.array(v), axis=0) for s, v in acc.items()}
                for s in PLANNER_STRATEGIES:
                    step, ratio, bub, ms = means[s]
                    line += f" {step:7.1f}s x{ratio:5.3f} {bub:5.1%} {ms:5.0f}ms |"
                    rows.append({"section": "planner", "corpus": corpus, "H": H, "P": P, "strategy": s, "step_s": step,
                                 "bound_ratio": ratio, "bubble": bub, "plan_ms": ms})
                print(line)


def sim_section(seeds: int, rows: List[dict]) -> None:
    print("\n## 2. Simulator: 2M context, 32M-token batches; speed-up over static DP x CP x TP x PP")
    print(f"{'model':<13} {'TP':>2} {'PP':>2} {'GPUs':>5} {'corpus':<7} " +
          " ".join(f"{s:>22}" for s in SIM_STRATEGIES))
    for model, (tp, pp, gpus) in SIM_RUNS.items():
        for corpus in ("github", "byted"):
            acc: Dict[str, List[tuple]] = {s: [] for s in SIM_STRATEGIES}
            info: Dict[str, dict] = {}
            for seed in range(seeds):
                lens = split_at_context(global_batch_lengths(corpus, 32 * M, seed=seed), 2 * M)
                res = {r.strategy: r for r in simulate_batch(lens, model, gpus, 8, list(SIM_STRATEGIES), tp=tp, pp=pp)}
                base = res["static"].step_time_s
                for s, r in res.items():
                    b = r.breakdown()
                    acc[s].append((r.step_time_s, base / r.step_time_s, r.bubble, r.mfu,
                                   b["exposed_comm_s"] / r.step_time_s))
                    info[s] = {"capacity": r.info["capacity"], "cp": r.info.get("cp"), "max_ring": r.info.get("max_ring")}
            line = f"{model:<13} {tp:>2} {pp:>2} {gpus:>5} {corpus:<7}"
            for s in SIM_STRATEGIES:
                v = np.array(acc[s])
                step, up, bub, mfu, comm = v.mean(axis=0)
                line += f" {step:6.1f}s {up:4.2f}x b{bub:4.0%}"
                rows.append({"section": "sim", "model": model, "tp": tp, "pp": pp, "gpus": gpus, "corpus": corpus,
                             "strategy": s, "step_s": step, "speedup": up, "speedup_min": float(v[:, 1].min()),
                             "speedup_max": float(v[:, 1].max()), "bubble": bub, "mfu": mfu, "comm_share": comm,
                             **info[s]})
            print(line)


def paper_section(seeds: int, rows: List[dict]) -> None:
    """Issue 34: the three pipeline strategies on the same batches (module docstring, item 3)."""
    from bytescale.sim import build_schedule, check_pp, simulate

    print("\n## 3. Issue 34: PP-Balance vs pp-lockstep vs static DP x CP x TP x PP (simulator), 32M-token "
          f"batches, means of {seeds} batches; step ratio = static's step / the strategy's (> 1: faster)")
    print(f"{'model':<14} {'TPxPP':>5} {'GPUs':>5} {'ctx':>5} {'corpus':<7} {'static':>18} {'lockstep':>20} "
          f"{'pp-balance':>20} {'bal/lock':>8} {'kept':>22}")
    for model, tp, pp, gpus in PAPER_RUNS:
        shape = model_shape(model)
        cl = cluster("h100-nvlink-ib400", gpus, 8)
        pipes = check_pp(shape, cl, tp, pp)
        cm = cost_model(shape, cl, tp=tp, pp=pp)
        pcm = planner_cost(cm, shape, cl, tp)
        cap = default_capacity(shape, cl, cm, tp=tp, pp=pp)
        per_token, bw, lat = p2p_terms(shape, cl, tp, pp)
        pipe = {"fwd_share": FWD_SHARE, "p2p_bytes_per_token": per_token, "p2p_bw": bw, "p2p_latency": lat}
        for ctx in PAPER_CONTEXTS:
            for corpus in ("github", "byted"):
                acc: Dict[str, List[tuple]] = {s: [] for s in PAPER_STRATEGIES}
                kept: Dict[str, int] = {}
                cp = []
                for seed in range(seeds):
                    lens = split_at_context(global_batch_lengths(corpus, 32 * M, seed=seed), ctx)
                    tokens, sum_sq = int(lens.sum()), float((lens.astype(np.float64) ** 2).sum())
                    plans: Dict = {}
                    res = {}
                    for s in PAPER_STRATEGIES:
                        sched = build_schedule(s, lens, pipes, cap, pcm, plans, pp, pipe)
                        res[s] = simulate(sched, cl, shape, cm, tokens, sum_sq, None, tp=tp)
                        if s == "static":
                            cp.append(sched.info["cp"])
                    k = plans[("pp-balance", True)].strategy
                    kept[k] = kept.get(k, 0) + 1
                    base, lock = res["static"].step_time_s, res["lockstep"].step_time_s
                    for s, r in res.items():
                        b = r.breakdown()
                        acc[s].append((r.step_time_s, base / r.step_time_s, lock / r.step_time_s, r.bubble, r.mfu,
                                       b["compute_s"] / r.step_time_s, b["exposed_comm_s"] / r.step_time_s,
                                       b["offload_s"] / r.step_time_s, b["data_stall_s"] / r.step_time_s))
                line = f"{model:<14} {tp}x{pp:<3} {gpus:>5} {ctx // 1024:>4}K {corpus:<7}"
                for s in PAPER_STRATEGIES:
                    v = np.array(acc[s])
                    step, up, vs_lock, bub, mfu, comp, comm, off, stall = v.mean(axis=0)
                    line += (f" {step:6.1f}s b{bub:4.0%} c{comm:4.0%}" if s == "static" else
                             f" {step:6.1f}s {up:4.2f}x b{bub:4.0%}")
                    rows.append({"section": "paper", "model": model, "tp": tp, "pp": pp, "gpus": gpus, "context": ctx,
                                 "corpus": corpus, "strategy": s, "capacity": cap, "pipelines": pipes,
                                 "static_cp": float(np.mean(cp)), "step_s": step, "vs_static": up,
                                 "vs_static_min": float(v[:, 1].min()), "vs_static_max": float(v[:, 1].max()),
                                 "vs_lockstep": vs_lock, "bubble": bub, "mfu": mfu, "compute_share": comp,
                                 "comm_share": comm, "offload_share": off, "data_stall_share": stall,
                                 **({"kept": dict(kept)} if s == "hdp-pp-balance" else {})})
                bl = np.mean(np.array(acc["hdp-pp-balance"])[:, 2])
                line += f" {bl:7.2f}x {','.join(f'{k}:{n}' for k, n in sorted(kept.items())):>22}"
                print(line, flush=True)


def paper_plot(path: str, rows: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paper = [r for r in rows if r["section"] == "paper"]
    runs = sorted({(r["model"], r["tp"], r["pp"], r["gpus"]) for r in paper}, key=lambda x: (x[0], x[2]))
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.8), sharey=True)
    for ax, (model, tp, pp, gpus) in zip(np.atleast_1d(axes), runs):
        for s, style in (("lockstep", "--"), ("hdp-pp-balance", "-")):
            for corpus, color in (("github", "C0"), ("byted", "C3")):
                pts = sorted((r["context"], r["vs_static"]) for r in paper if (r["model"], r["pp"], r["gpus"]) ==
                             (model, pp, gpus) and r["strategy"] == s and r["corpus"] == corpus)
                ax.plot([c // 1024 for c, _ in pts], [y for _, y in pts], style, color=color, marker="o",
                        label=f"{s} {corpus}")
        ax.axhspan(3.42, 4.28, color="grey", alpha=0.2, label="paper 3.42-4.28x (2M)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_title(f"{model}, TP {tp} x PP {pp}, {gpus} GPUs", fontsize=9)
    np.atleast_1d(axes)[0].set_ylabel("speed-up over static DP x CP x TP x PP")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def mixed_section(n: int = 80) -> None:
    """Seeded small batches (the GoogleTest's generator): 2-8 pipelines x 2-7 stages, 10-90
    sequences, 60% up to a quarter of the capacity, 30% up to the capacity, 10% up to the capacity
    (no rings) or the whole world's (rings); the planner's default cost model. Mean step over
    lockstep's."""
    print("\n## 4. Mixed batches: step / pp-lockstep's step (means of %d batches)" % n)
    print(f"{'batches':<12} " + " ".join(f"{s:>12}" for s in PLANNER_STRATEGIES) + "  pp-balance / bound")
    for label, wide in (("no rings", False), ("with rings", True)):
        rng = np.random.default_rng(5)
        out = []
        for _ in range(n):
            H, P, cnt, cap = int(rng.integers(2, 9)), int(rng.integers(2, 8)), int(rng.integers(10, 90)), 1024
            u = rng.random(cnt)
            top = cap * (H if wide else 1)
            lens = np.where(u < 0.6, 1 + rng.random(cnt) * cap / 4,
                            np.where(u < 0.9, 1 + rng.random(cnt) * cap, 1 + rng.random(cnt) * top)).astype(int)
            plans = [bytescale.plan(lens, H, cap, strategy=s, pp=P) for s in PLANNER_STRATEGIES]
            lock = plans[1].makespan
            out.append([p.makespan / lock for p in plans] + [plans[0].makespan / plans[0].lower_bound])
        a = np.mean(out, axis=0)
        print(f"{label:<12} " + " ".join(f"{x:>12.3f}" for x in a[:-1]) + f"  {a[-1]:.3f}")


def plot(path: str, rows: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    plan = [r for r in rows if r["section"] == "planner" and r["H"] == 32]
    labels = sorted({(r["corpus"], r["P"]) for r in plan})
    x = np.arange(len(labels))
    for i, s in enumerate(PLANNER_STRATEGIES):
        ys = [next(r["bubble"] for r in plan if (r["corpus"], r["P"]) == lab and r["strategy"] == s) for lab in labels]
        ax.bar(x + (i - 1.5) * 0.2, ys, 0.2, label=s)
    ax.set_xticks(x, [f"{c}\nP={p}" for c, p in labels])
    ax.set_ylabel("bubble (idle share of every stage)")
    ax.set_title("planner, 32 pipelines, LLaMA-70B stage (TP 8)")
    ax.legend(fontsize=8)
    ax = axes[1]
    sim = [r for r in rows if r["section"] == "sim"]
    labels = sorted({(r["model"], r["corpus"]) for r in sim})
    x = np.arange(len(labels))
    for i, s in enumerate(SIM_STRATEGIES):
        ys = [next(r["speedup"] for r in sim if (r["model"], r["corpus"]) == lab and r["strategy"] == s) for lab in labels]
        ax.bar(x + (i - 1.5) * 0.2, ys, 0.2, label=s)
    ax.axhspan(3.42, 4.28, color="grey", alpha=0.2, label="paper 3.42-4.28x")
    ax.set_xticks(x, [f"{m}\n{c}" for m, c in labels])
    ax.set_ylabel("speed-up over static DP x CP x TP x PP")
    ax.set_title("simulator, 2M context (70B: 4,096 GPUs, 8x7B: 1,024)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--png", default=None)
    ap.add_argument("--sections", default="planner,sim,mixed", help="any of planner, sim, paper, mixed")
    ap.add_argument("--json", default=None, help="the rows of the sections run")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows: List[dict] = []
    sections = args.sections.split(",")
    if "planner" in sections:
        planner_section(args.seeds, rows)
    if "sim" in sections:
        sim_section(args.seeds, rows)
    if "paper" in sections:
        paper_section(args.seeds, rows)
    if "mixed" in sections:
        mixed_section()
    if args.png and "planner" in sections and "sim" in sections:
        plot(args.png, rows)
    if args.png and sections == ["paper"]:
        paper_plot(args.png, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
