"""Planner benchmark: the synchronised step of every strategy against the lower bound, and latency.

    python benchmarks/bench_planner.py [--png benchmarks/planner.png] [--quick] [--sections grid,comm,small,latency]

Batches of ~32M tokens: "byted" and "github" from bytescale.data.synthetic (2M context), and
"files": a heavy-tailed real batch present on every machine, one document per installed Python
package (its .py sources concatenated, ~4 bytes per token, split at 2M tokens), drawn without
replacement in a fixed order until the batch holds 32M tokens.

Strategies, all judged by the same cost model (the default: a LLaMA-7B-class layer on an H100,
derived from FLOP counts, not measured) and the same replay (bytescale._C.planner: each rank runs
its micro-batches in order, a ring starts when all its members are free):
  balanced  bytescale's sync-aware planner (any-integer rings on a timeline)
  pow2      bytescale's power-of-two dynamic CP baseline (token-balanced)
  naive     the paper's Alg. 1 (token-balanced, memory-sized rings)
  kk        verl-style: one static CP size (the power of two the longest sequence needs), the
            sequences Karmarkar-Karp-partitioned over the DP groups by predicted compute, each
            group packing its share into micro-batches of CP x capacity tokens (a packed
            micro-batch pays one ring pass, not one per document)
  megatron  Megatron-style dynamic CP: each sequence on a power-of-two CP group (aligned rank
            blocks) sized by its length, sequences grouped into rounds that balance the DP x CP
            ranks' predicted time, each round led by the largest remaining sequence
(kk and megatron are reimplemented here from their projects' published descriptions.)

Reported: step / lower bound, where the bound is max(total work / ranks, the largest piece: a
sequence at its best ring size, communication included). Small worlds (2-64 ranks): the corpora
scaled so sequences span 1-8 ranks, every strategy's step against a reference schedule (the
exhaustive optimum where small enough, else a local search started from balanced's plan;
csrc/planner/reference.h). Latency: best of a few single-threaded C++ planning calls, the Python
call included, as CPU time of the calling thread (the planner is single-threaded: its time on one
core, whatever else runs on the machine) and as wall time.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import heapq
import math
import os
import platform
import sysconfig
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from bytescale import _C
from bytescale.data.synthetic import global_batch_lengths
from bytescale.planner import CostModel, plan

MAX_CONTEXT = 2 * 1024 * 1024
K = 1024


# ---- batches ---------------------------------------------------------------------------------

def package_lengths() -> np.ndarray:
    """Tokens (bytes / 4) of every installed Python package's .py sources, split at 2M tokens."""
    paths = sorted({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    sizes: Dict[str, int] = collections.Counter()
    for base in paths:
        for entry in sorted(os.scandir(base), key=lambda e: e.name):
            name = entry.name
            if name.startswith((".", "_")) or name.endswith((".dist-info", ".egg-info")) \
                    or name in ("site-packages", "test", "tests"):
                continue
            if entry.is_dir(follow_symlinks=False):
                for root, _, files in os.walk(entry.path):
                    for f in files:
                        if f.endswith(".py"):
                            try:
                                sizes[name] += os.path.getsize(os.path.join(root, f))
                            except OSError:
                                pass
            elif name.endswith(".py"):
                sizes[name[:-3]] += entry.stat().st_size
    out = []
    for name in sorted(sizes):
        tokens = sizes[name] // 4
        while tokens > MAX_CONTEXT:
            out.append(MAX_CONTEXT)
            tokens -= MAX_CONTEXT
        if tokens > 0:
            out.append(tokens)
    return np.asarray(out, dtype=np.int64)


def files_batch(tokens: int, seed: int = 0) -> np.ndarray:
    docs = package_lengths()
    order = np.random.default_rng(seed).permutation(len(docs))
    reps = int(math.ceil(tokens / max(1, docs.sum())))  # more tokens than installed: repeat
    order = np.concatenate([order] * reps)
    csum = np.cumsum(docs[order])
    return docs[order[: int(np.searchsorted(csum, tokens)) + 1]]


# ---- reimplemented peers, as raw schedules for the same replay --------------------------------

def next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


class Schedule:
    """Per-rank lists of (ring id or -1, cost), with ring groups, for _C.planner.replay."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.items: List[List[Tuple[int, float]]] = [[] for _ in range(world)]
        self.groups: List[np.ndarray] = []

    def ring(self, ranks: np.ndarray, cost: float) -> None:
        if len(ranks) == 1:
            self.items[int(ranks[0])].append((-1, cost))
            return
        rid = len(self.groups)
        self.groups.append(ranks)
        for r in ranks.tolist():
            self.items[r].append((rid, cost))

    def step(self) -> float:
        counts = [len(x) for x in self.items]
        rank_mb = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = [it for lst in self.items for it in lst]
        mb_ring = np.asarray([i for i, _ in flat], dtype=np.int64)
        cost = np.asarray([c for _, c in flat], dtype=np.float64)
        sizes = [len(g) for g in self.groups]
        ring_grp = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        grp = np.concatenate(self.groups).astype(np.int32) if self.groups else np.zeros(0, np.int32)
        return _C.planner.replay(_C.planner.Schedule(self.world, rank_mb, mb_ring, ring_grp, grp), cost).step_time


def karmarkar_karp(weights: np.ndarray, k: int) -> List[np.ndarray]:
    """Largest differencing method for k partitions: repeatedly merge the two partial solutions
    whose sums spread most, pairing one's largest part with the other's smallest. A partial
    solution keeps only its non-empty parts (the rest are zeros); merged parts get new ids whose
    parents are recorded, and items find their final part by following parents at the end."""
    n = len(weights)
    parent = np.full(2 * n * max(1, min(k, n)) + n, -1, dtype=np.int64)
    next_id = n
    heap = [(-float(w), i, np.array([w], dtype=np.float64), np.array([i])) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    tie = n
    while len(heap) > 1:
        _, _, sa, ia = heapq.heappop(heap)
        _, _, sb, ib = heapq.heappop(heap)
        m = min(k, len(sa) + len(sb))
        a_s = np.zeros(m); a_s[:len(sa)] = sa
        a_i = np.full(m, -1); a_i[:len(ia)] = ia
        b_s = np.zeros(m); b_s[m - len(sb):] = sb[::-1]  # b ascending, zeros first
        b_i = np.full(m, -1); b_i[m - len(ib):] = ib[::-1]
        sums = a_s + b_s
        both = (a_i >= 0) & (b_i >= 0)
        ids = np.where(a_i >= 0, a_i, b_i)
        if both.any():  # parts that really merge get a new id
            new = np.arange(next_id, next_id + int(both.sum()))
            next_id += len(new)
            parent[a_i[both]] = new
            parent[b_i[both]] = new
            ids[both] = new
        order = np.argsort(-sums, kind="stable")
        sums, ids = sums[order], ids[order]
        spread = sums[0] - (sums[-1] if len(sums) == k else 0.0)
        heapq.heappush(heap, (-float(spread), tie, sums, ids))
        tie += 1
    final = heap[0][3] if heap else np.zeros(0, dtype=np.int64)
    root = np.arange(n)
    while True:  # follow parents to the final part of every item
        up = parent[root]
        moved = up >= 0
        if not moved.any():
            break
        root = np.where(moved, up, root)
    return [np.nonzero(root == pid)[0] for pid in final.tolist()]


def packed_time(cm: CostModel, seqs: List[int], cp: int) -> float:
    """Predicted time of one packed micro-batch whose documents are each zig-zag sharded over the
    same cp ranks: the documents' compute shares, one g, and ONE ring pass for the whole
    micro-batch whose exposed part is what its total attention cannot hide (the cost model's
    sharded_time, applied to a packed micro-batch instead of once per document)."""
    s = np.asarray(seqs, dtype=np.float64)
    attn = cm.a1 * float((s * s).sum()) / cp
    linear = cm.b1 * float(s.sum()) / cp
    comm = 3.0 * (cp - 1) * (cm.ring_latency + cm.kv_bytes_per_token * float(s.sum()) / cp / cm.ring_bw)
    return cm.layers * (attn + linear + cm.g + max(0.0, comm - attn))


def verl_kk(lengths: np.ndarray, world: int, cap: int, cm: CostModel) -> Optional[float]:
    cp = next_pow2(int(math.ceil(lengths.max() / cap)))
    if cp > world:
        return None
    dp = world // cp
    s = lengths.astype(np.float64)
    work = cm.layers * (cm.a1 * s * s + cm.b1 * s) / cp  # the partitioner's workload estimate
    sched = Schedule(world)
    for g, part in enumerate(karmarkar_karp(work, dp)):
        ranks = np.arange(g * cp, (g + 1) * cp)
        # pack the group's sequences into micro-batches of cp x cap tokens (best fit decreasing)
        bins: List[List[int]] = []
        room: List[int] = []
        for i in sorted(part.tolist(), key=lambda i: -lengths[i]):
            fit = [j for j in range(len(bins)) if room[j] >= lengths[i]]
            j = min(fit, key=lambda j: room[j]) if fit else len(bins)
            if j == len(bins):
                bins.append([])
                room.append(cp * cap)
            bins[j].append(int(lengths[i]))
            room[j] -= int(lengths[i])
        for b in bins:
            sched.ring(ranks, packed_time(cm, b, cp))
    return sched.step()


def megatron(lengths: np.ndarray, world: int, cap: int, cm: CostModel) -> Optional[float]:
    cps = [min(next_pow2(int(math.ceil(s / cap))), world) for s in lengths.tolist()]
    if any(int(math.ceil(s / cap)) > world for s in lengths.tolist()):
        return None
    w = np.asarray([cm.sharded_time(int(s), c) for s, c in zip(lengths.tolist(), cps)])
    order = sorted(range(len(lengths)), key=lambda i: (-w[i], i))
    sched = Schedule(world)
    remaining = order
    while remaining:
        load = np.zeros(world)
        target = w[remaining[0]]  # the round's length: its largest sub-sample
        left = []
        for i in remaining:
            c = cps[i]
            block = load.reshape(-1, c).max(axis=1)
            b = int(np.argmin(block))
            if block[b] + w[i] <= target * (1 + 1e-9):
                load[b * c:(b + 1) * c] = block[b] + w[i]
                sched.ring(np.arange(b * c, (b + 1) * c), float(w[i]))
            else:
                left.append(i)
        remaining = left
    return sched.step()


# ---- the benchmark ---------------------------------------------------------------------------

def timed(fn, reps: int, clock=time.perf_counter):
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = clock()
        out = fn()
        best = min(best, clock() - t0)
    return best, out


STRATS = ("balanced", "pow2", "naive", "kk", "megatron")


def quality(batches, worlds, caps, cm: CostModel, peers: bool):
    rows = []
    for name, lengths in batches.items():
        for w in worlds:
            for cap in caps:
                try:
                    base = {s: plan(lengths, world_size=w, capacity=cap, strategy=s, cost=cm)
                            for s in ("balanced", "pow2", "naive")}
                except ValueError:  # the longest sequence needs more ranks than exist
                    continue
                lb = base["balanced"].lower_bound
                step = {s: p.makespan for s, p in base.items()}
                # balanced keeps the pow2 plan when that replays shorter (the plan then says so)
                step["net"] = float(base["balanced"].strategy == "pow2")
                if peers:
                    step["kk"] = verl_kk(lengths, w, cap, cm)
                    step["megatron"] = megatron(lengths, w, cap, cm)
                parts = base["balanced"].bound_parts
                rows.append((name, w, cap, lb, step, max(parts, key=parts.get)))
    return rows


def small_world(cm: CostModel, reps: int, worlds=(2, 4, 8, 16, 32, 64), cap: int = 4 * K):
    """The paper's corpora scaled so that sequences span 1-8 ranks (2M tokens -> 8 x capacity,
    nothing longer than the world), 1 or 4 capacities' worth of tokens per rank. Every strategy's
    replayed step against the reference: the exhaustive search where it is small enough (<= 6
    sequences, <= 8 ranks), else the local search (csrc/planner/reference.h) started from
    balanced's own plan and from a greedy schedule, 20,000 schedules (fewer above 200 sequences)."""
    rows = []
    scale = 8 * cap / MAX_CONTEXT
    for corpus in ("byted", "github"):
        for per_rank in (0.25, 1, 4):
            for w in worlds:
                lengths = global_batch_lengths(corpus, int(w * cap * per_rank), seed=w,
                                               scale=scale, max_len=w * cap)
                opts = _C.planner.PlanOptions()
                opts.world_size, opts.capacity, opts.cost = w, cap, cm
                plans = {s: plan(lengths, world_size=w, capacity=cap, strategy=s, cost=cm)
                         for s in ("balanced", "pow2", "naive")}
                bal = plans["balanced"]
                exact = len(lengths) <= 6 and w <= 8
                budget = 50_000_000 if exact else int(min(20000, 4_000_000 // len(lengths)))
                t0 = time.process_time()
                ref, optimal, _ = _C.planner.reference_plan(lengths, opts, exact=exact, budget=budget,
                                                          start=None if exact else bal.raw)
                ref_s = time.process_time() - t0
                cpu = timed(lambda: plan(lengths, world_size=w, capacity=cap, cost=cm), reps,
                            time.process_time)[0] * 1e3
                step = {s: p.makespan for s, p in plans.items()}
                step["megatron"] = megatron(lengths, w, cap, cm)
                rows.append(dict(corpus=corpus, per_rank=per_rank, world=w, n=len(lengths),
                                 longest=int(lengths.max()), ref=ref.makespan,
                                 ref_kind="exact" if optimal else "search", bound=bal.lower_bound,
                                 step=step, strategy=bal.strategy, ms=cpu, ref_s=ref_s))
    return rows


def fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--png", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer worlds and capacities")
    ap.add_argument("--sections", default="grid,comm,small,latency",
                    help="comma-separated: grid (step / bound at 256-16,384 ranks), comm (the ring "
                         "communication term), small (2-64 ranks against the reference), latency")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    cm = CostModel()
    print(f"# bench_planner ({datetime.date.today()}, {platform.machine()} "
          f"{os.cpu_count()} cores, single-threaded planner)\n")
    batches = {"byted": global_batch_lengths("byted", 32 << 20, seed=2),
               "github": global_batch_lengths("github", 32 << 20, seed=2),
               "files": files_batch(32 << 20)}
    for n, b in batches.items():
        print(f"{n}: {len(b)} sequences, {b.sum() / 2**20:.1f}M tokens, longest {b.max()}")
    worlds = (256, 1024, 4096, 16384) if not a.quick else (256, 4096)
    caps = (2 * K, 4 * K, 8 * K, 16 * K, 32 * K) if not a.quick else (2 * K, 8 * K, 32 * K)

    sections = set(a.sections.split(","))
    rows, lat = [], []
    if "grid" in sections:
        grid(batches, worlds, caps, cm, rows)
    if "comm" in sections:
        comm_term(batches, cm)
    if "small" in sections:
        small_block(cm, a.reps)
    if "latency" in sections:
        latency(cm, a.reps, lat)
    print(f"\nbenchmark wall time {time.perf_counter() - t_start:.0f} s")
    if a.png and rows and lat:
        plot(a.png, rows, lat, caps)


def grid(batches, worlds, caps, cm: CostModel, rows) -> None:
    """Step / lower bound of every strategy and peer at 256-16,384 ranks."""
    rows.extend(quality(batches, worlds, caps, cm, peers=True))
    print("\nSynchronised step / lower bound (1.000 = optimal under the cost model; '-': the "
          "peer cannot place the longest sequence)\n")
    print("| batch | ranks | capacity | bound (s) | " + " | ".join(STRATS) + " |")
    print("|---|---|---|---|" + "---|" * len(STRATS))
    for name, w, cap, lb, step, part in rows:
        cells = " | ".join(fmt(None if step.get(s) is None else step[s] / lb) for s in STRATS)
        print(f"| {name} | {w} | {cap // K}K | {lb:.2f} {part} | {cells} |")
    print("\n(bound: 'work' = total work / ranks, 'piece' = the longest sequence at its best ring "
          "size, 'waves' = wide rings that cannot all run at once)")
    ok = [r for r in rows if r[1] <= 4096]
    worst = max(r[4]["balanced"] / r[3] for r in ok) if ok else float("nan")
    never = all(r[4]["balanced"] <= r[4]["pow2"] * (1 + 1e-9) for r in rows)
    print(f"\nbalanced: worst step/bound at 256-4096 ranks {worst:.3f}; never worse than pow2: {never}; "
          f"returned the pow2 plan (its safety net) in {int(sum(r[4]['net'] for r in rows))} of {len(rows)} cases")
    geo = {}
    for s in STRATS[1:]:
        ratios = [r[4][s] / r[4]["balanced"] for r in rows if r[4].get(s) is not None]
        geo[s] = (math.exp(np.mean(np.log(ratios))), max(ratios), len(ratios)) if ratios else None
    for s, g in geo.items():
        if g:
            print(f"  {s}: step {g[0]:.2f}x balanced's (geo-mean over {g[2]} cases), worst {g[1]:.2f}x")


def comm_term(batches, cm: CostModel) -> None:
    """How much rests on the ring-communication term of the cost model."""
    print("\nRing communication term (never measured beyond one GPU): pow2 / balanced step and "
          "balanced's step / bound, byted, with the default ring bandwidth, 10x slower rings, and "
          "no ring cost at all\n")
    print("| ranks | capacity | comm model | balanced / bound | pow2 / balanced | megatron / balanced |")
    print("|---|---|---|---|---|---|")
    variants = [("default 50 GB/s, 10 us", {}), ("10x slower", {"ring_bw": 5e9, "ring_latency": 1e-4}),
                ("free (no comm)", {"kv_bytes_per_token": 0.0, "ring_latency": 0.0})]
    for w, cap in ((256, 8 * K), (1024, 4 * K), (4096, 8 * K)):
        for label, over in variants:
            c2 = CostModel()
            for k, v in over.items():
                setattr(c2, k, v)
            r = quality({"byted": batches["byted"]}, (w,), (cap,), c2, peers=False)
            mg = megatron(batches["byted"], w, cap, c2)
            if r:
                _, _, _, lb, step, _ = r[0]
                print(f"| {w} | {cap // K}K | {label} | {step['balanced'] / lb:.3f} | "
                      f"{step['pow2'] / step['balanced']:.2f} | {fmt(mg / step['balanced'] if mg else None)} |")


def small_block(cm: CostModel, reps: int) -> None:
    """The small-world table: every strategy against the reference at 2-64 ranks."""
    print("\nSmall worlds (2-64 ranks, capacity 4K; corpora scaled so 2M tokens span 8 ranks, no "
          "sequence longer than the world): replayed step / the reference's (1.000 = as short; "
          "the reference is the exhaustive optimum where marked 'exact', else a local search "
          "started from balanced's plan, so never above it)\n")
    print("| batch | tokens / rank | ranks | sequences | longest | reference (s) | ref / bound | "
          "balanced | pow2 | naive | megatron | balanced CPU ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    small = small_world(cm, reps)
    for r in small:
        st = r["step"]
        cells = " | ".join(fmt(None if st[s] is None else st[s] / r["ref"])
                           for s in ("balanced", "pow2", "naive", "megatron"))
        name = " (pow2 plan)" if r["strategy"] == "pow2" else ""
        print(f"| {r['corpus']} | {r['per_rank']:g}C | {r['world']} | {r['n']} | {r['longest']} | "
              f"{r['ref']:.4f} {r['ref_kind']} | {r['ref'] / r['bound']:.3f} | {cells}{name} | {r['ms']:.2f} |")
    worst = max(r["step"]["balanced"] / r["ref"] for r in small)
    never = all(r["step"]["balanced"] <= r["step"]["pow2"] * (1 + 1e-9) for r in small)
    print(f"\nbalanced: worst step / reference {worst:.3f}; never worse than pow2: {never}")


def latency(cm: CostModel, reps: int, lat) -> None:
    """Planning time at 16,384 ranks (32M and 128M tokens, every capacity) and 1,024 ranks at 2K."""
    print("\nLatency (ms, best of %d, one thread, Python call included): CPU time of the thread "
          "(wall time)\n" % reps)
    print("| ranks | tokens | sequences | capacity | balanced | pow2 | naive |\n|---|---|---|---|---|---|---|")
    cases = [(16384, mtok, cap) for mtok in (32, 128) for cap in (2 * K, 4 * K, 8 * K, 16 * K, 32 * K)]
    cases.append((1024, 32, 2 * K))
    for world, mtok, cap in cases:
        b = global_batch_lengths("byted", mtok << 20, seed=1)
        cells, ms = [], []
        for s in ("balanced", "pow2", "naive"):
            def call(s=s):
                return plan(b, world_size=world, capacity=cap, strategy=s, cost=cm)
            cpu = timed(call, reps, time.thread_time)[0] * 1e3
            wall = timed(call, reps, time.perf_counter)[0] * 1e3
            ms.append(cpu)
            cells.append(f"{cpu:.2f} ({wall:.2f})")
        if world == 16384:
            lat.append((mtok, cap, ms))
        print(f"| {world} | {mtok}M | {len(b)} | {cap // K}K | " + " | ".join(cells) + " |")


def plot(path: str, rows, lat, caps) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = sorted({r[0] for r in rows}, key=["byted", "github", "files"].index)
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4.2 * (len(names) + 1), 3.8))
    cap = 8 * K
    for ax, name in zip(axes, names):
        sel = [r for r in rows if r[0] == name and r[2] == cap]
        xs = [r[1] for r in sel]
        for s in STRATS:
            ys = [r[4][s] / r[3] if r[4].get(s) is not None else np.nan for r in sel]
            ax.plot(xs, ys, marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks([1.0, 1.1, 1.5, 2.0, 4.0, 8.0])
        ax.axhline(1.1, color="gray", ls="--", lw=0.8, label="bound + 10%")
        ax.set_title(f"{name}, capacity {cap // K}K")
        ax.set_xlabel("ranks")
        ax.set_ylabel("synchronised step / lower bound")
    axes[0].legend(fontsize=8)
    ax = axes[-1]
    for mtok in sorted({m for m, _, _ in lat}):
        sel = [x for x in lat if x[0] == mtok]
        ax.plot([c // K for _, c, _ in sel], [ms[0] for _, _, ms in sel], marker="o",
                label=f"balanced, {mtok}M tokens (CPU time)")
    ax.axhline(10, color="gray", ls="--", lw=0.8, label="10 ms goal (32M)")
    ax.axhline(40, color="gray", ls=":", lw=0.8, label="40 ms goal (128M)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("capacity (K tokens), 16,384 ranks")
    ax.set_ylabel("planning latency (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
