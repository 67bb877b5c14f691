"""Peer budget benchmark (issue 35): what bounding ring neighbours costs, and that the bound holds.

    PYTHONPATH=. python benchmarks/bench_peers.py [--sections quality,bound] [--steps 10000]
        [--big-steps 300] [--quick]

quality: the synchronised step / lower bound of the planner with the default peer budget (K = 4)
    against the unbounded planner (K = 0: the plans before the budget, byte for byte), on
    bench_planner.py's grid: ~32M-token batches of the paper's byted and github distributions
    (bytescale.sim.distributions.draw_batch, seed 2), 256-16,384 ranks, capacities 2K-32K,
    strategies balanced / pow2 / naive; and pp-balance / pp-lockstep at 256 pipelines of 4 stages.
    The bound (csrc/planner/bound.h) is the unbounded problem's, so it is a bound for both.
bound: planning only, in C++ (benchmarks/peer_steps.cpp, built against build-cpp's core library):
    a fresh batch every step (the byted distribution's segments from bytescale.data.synthetic,
    about ranks x capacity / 2 tokens, capacity 8K, odd steps with offloading) with every
    ring-forming strategy, counting each rank's distinct ring neighbours (the previous and next
    member of every ring it is in) over all steps: at 1,024 ranks for --steps steps (pp-balance, the
    slow search, a tenth), at 16,384 ranks for --big-steps (fewer for the slower strategies:
    planning time), and the unbounded balanced planner for comparison.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import tempfile
import time

import numpy as np

from bytescale import _C
from bytescale.planner import CostModel
from bytescale.planner.inputs import _options
from bytescale.sim.distributions import draw_batch

K = 1024
FLAT = ("balanced", "pow2", "naive")


def make(lengths: np.ndarray, world: int, cap: int, strategy: str, budget: int, cm: CostModel,
         offload: bool = False, pp: int = 1):
    opts = _options(world, cap, strategy, offload, cm, None, None, pp=pp, peer_budget=budget)
    return _C.planner.make_plan(lengths, opts)


def quality(cm: CostModel, worlds, caps) -> None:
    print("\n## quality: step / lower bound, unbounded (K=0) -> K=4, and the change\n")
    print("| batch | ranks | capacity | " + " | ".join(f"{s} K=0 | {s} K=4 | change" for s in FLAT) + " |")
    print("|---|---|---|" + "---|---|---|" * len(FLAT))
    changes = {s: [] for s in FLAT}
    for dist in ("byted", "github"):
        lengths = draw_batch(dist, 32 << 20, seed=2)
        for w in worlds:
            for cap in caps:
                cells = []
                try:
                    for s in FLAT:
                        a = make(lengths, w, cap, s, 0, cm)
                        b = make(lengths, w, cap, s, 4, cm)
                        lb = a.lower_bound
                        assert abs(b.lower_bound - lb) <= 1e-12 * lb
                        ch = b.makespan / a.makespan - 1
                        changes[s].append((ch, dist, w, cap))
                        cells.append(f"{a.makespan / lb:.3f} | {b.makespan / lb:.3f} | {100 * ch:+.2f}%")
                except ValueError:  # the longest sequence needs more ranks than exist
                    continue
                print(f"| {dist} | {w} | {cap // K}K | " + " | ".join(cells) + " |", flush=True)
    for s in FLAT:
        c = changes[s]
        if c:
            worst = max(c)
            print(f"{s}: step change K=4 vs K=0: mean {100 * np.mean([x[0] for x in c]):+.2f}%, "
                  f"worst {100 * worst[0]:+.2f}% ({worst[1]}, {worst[2]} ranks, {worst[3] // K}K), "
                  f"{sum(x[0] > 0.03 for x in c)} of {len(c)} cells above +3%")
    print("\npp-balance / pp-lockstep, 256 pipelines x 4 stages (stage = 1/4 of the layers):\n")
    print("| batch | capacity | pp-balance K=0 | K=4 | change | pp-lockstep K=0 | K=4 | change |")
    print("|---|---|---|---|---|---|---|---|")
    pcm = CostModel()
    pcm.layers = cm.layers // 4
    for dist in ("byted", "github"):
        lengths = draw_batch(dist, 8 << 20, seed=2)
        for cap in (4 * K, 16 * K):
            cells = []
            try:
                for s in ("pp-balance", "pp-lockstep"):
                    a = make(lengths, 256, cap, s, 0, pcm, pp=4)
                    b = make(lengths, 256, cap, s, 4, pcm, pp=4)
                    cells.append(f"{a.makespan / a.lower_bound:.3f} | {b.makespan / a.lower_bound:.3f} | "
                                 f"{100 * (b.makespan / a.makespan - 1):+.2f}%")
            except ValueError:
                continue
            print(f"| {dist} | {cap // K}K | " + " | ".join(cells) + " |", flush=True)


def _driver() -> str:
    """benchmarks/peer_steps.cpp built against the GoogleTests' core library (build-cpp)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lib = os.path.join(root, "build-cpp", "libbytescale_core.a")
    if not os.path.exists(lib):
        raise SystemExit("bench_peers: build the C++ core first: cmake -S . -B build-cpp -G Ninja && "
                         "cmake --build build-cpp")
    exe = os.path.join(root, "build-cpp", "peer_steps")
    src = os.path.join(root, "benchmarks", "peer_steps.cpp")
    if not os.path.exists(exe) or os.path.getmtime(exe) < max(os.path.getmtime(src), os.path.getmtime(lib)):
        subprocess.run(["g++", "-O2", "-std=c++17", "-I", os.path.join(root, "csrc"), src, lib, "-lpthread",
                        "-o", exe], check=True)
    return exe


def bound(steps: int, big_steps: int) -> None:
    """Distinct ring neighbours over many planned steps, planning only, in C++ (peer_steps.cpp):
    fresh batches of the byted distribution's segments (bytescale.data.synthetic) every step."""
    from bytescale.data.synthetic import CORPORA

    exe = _driver()
    segs, probs = CORPORA["byted"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for sg, pr in zip(segs, probs):
            f.write(f"{sg.lo} {sg.hi} {pr}\n")
        seg_file = f.name
    print("\n## bound: distinct ring neighbours per rank over many planned steps (capacity 8K, byted)\n")
    print("| ranks | strategy | K | steps | rings | max neighbours | mean | planning s/step |")
    print("|---|---|---|---|---|---|---|---|")
    # (world, strategy, budget, steps): the slow searches get fewer steps (planning time)
    runs = [(1024, s, 4, steps) for s in ("balanced", "naive", "pow2", "static", "pp-lockstep")]
    runs += [(1024, "pp-balance", 4, max(2, steps // 10)), (1024, "balanced", 0, min(steps, 300)),
             (1024, "balanced", 0, steps)]
    runs += [(16384, "balanced", 4, big_steps), (16384, "static", 4, big_steps * 10 // 3),
             (16384, "pp-lockstep", 4, max(2, big_steps // 3)), (16384, "pow2", 4, max(2, big_steps // 10)),
             (16384, "naive", 4, max(2, big_steps // 10)), (16384, "pp-balance", 4, max(2, big_steps // 60)),
             (16384, "balanced", 0, big_steps)]
    for world, s, k, n in runs:
        pp = "4" if s.startswith("pp-") else "1"
        out = subprocess.run([exe, str(world), str(n), s, str(8 * K), str(k), seg_file, pp], check=True,
                             capture_output=True, text=True).stdout
        kv = dict(x.split("=") for x in out.split())
        print(f"| {world} | {s} | {k} | {n} | {kv['rings']} | {kv['max']} | {kv['mean']} | "
              f"{float(kv['plan_s_per_step']):.3f} |", flush=True)
        if k:
            assert int(kv["max"]) <= k, out
    os.unlink(seg_file)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="quality,bound")
    ap.add_argument("--steps", type=int, default=10000, help="planned steps at 1,024 ranks")
    ap.add_argument("--big-steps", type=int, default=300, help="planned steps at 16,384 ranks")
    ap.add_argument("--quick", action="store_true", help="fewer worlds and capacities")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cm = CostModel()
    print(f"# bench_peers ({datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores)")
    sections = set(a.sections.split(","))
    if "quality" in sections:
        worlds = (256, 1024, 4096, 16384) if not a.quick else (256, 4096)
        caps = (2 * K, 4 * K, 8 * K, 16 * K, 32 * K) if not a.quick else (2 * K, 8 * K, 32 * K)
        quality(cm, worlds, caps)
    if "bound" in sections:
        bound(a.steps, a.big_steps)
    print(f"\nbenchmark wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
