"""What the simulator prints and draws: a table of strategies and a per-rank timeline PNG."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from .engine import SimResult

__all__ = ["table", "timeline_png", "sample_ranks"]


def table(results: Sequence[SimResult], baseline: Optional[str] = "static") -> str:
    """A fixed-width table: step time, tokens/s, MFU, speed-up over ``baseline`` (when present)
    and the mean per-rank breakdown as shares of the step (a ``tp`` column for the TP collectives
    when any result has tensor parallelism; a ``bubble`` column, the 1F1B replay's idle share of the
    micro-batch phase, when any has pipelines)."""
    base = next((r for r in results if r.strategy == baseline), None)
    with_tp = any(r.tp > 1 for r in results)
    with_pp = any(r.pp > 1 for r in results)
    head = (f"{'strategy':<14} {'step (s)':>10} {'tokens/s':>12} {'MFU':>6} {'speed-up':>8} "
            f"{'compute':>8} {'comm':>6}{' ' + format('tp', '>6') if with_tp else ''} {'offload':>7} "
            f"{'idle':>6}{' ' + format('bubble', '>6') if with_pp else ''} {'sync':>6} {'data':>6}  max ring")
    lines = [head, "-" * len(head)]
    for r in results:
        b = r.breakdown()
        sh = {k: v / r.step_time_s if r.step_time_s else 0.0 for k, v in b.items()}
        up = f"{base.step_time_s / r.step_time_s:.2f}x" if base is not None and r.step_time_s else "-"
        tpc = f" {sh['tp_comm_s']:>6.1%}" if with_tp else ""
        bub = f" {r.bubble:>6.1%}" if with_pp else ""
        lines.append(f"{r.strategy:<14} {r.step_time_s:>10.3f} {r.tokens_per_s:>12.4g} {r.mfu:>6.3f} {up:>8} "
                     f"{sh['compute_s']:>8.1%} {sh['exposed_comm_s']:>6.1%}{tpc} {sh['offload_s']:>7.1%} "
                     f"{sh['idle_s']:>6.1%}{bub} {sh['grad_sync_s']:>6.1%} {sh['data_stall_s']:>6.1%}  "
                     f"{r.info.get('max_ring', 1)}")
    return "\n".join(lines)


def sample_ranks(world: int, k: int = 48) -> np.ndarray:
    """All ranks when there are at most ``k``, else ``k`` evenly spread ones (first and last kept)."""
    if world <= k:
        return np.arange(world)
    return np.unique(np.linspace(0, world - 1, k).round().astype(np.int64))


def timeline_png(results: Sequence[SimResult], path: str, max_ranks: int = 48, title: str = "") -> None:
    """One panel per strategy: per sampled rank, its data stall, each micro-batch (compute blue for
    local, orange for a ring; exposed communication red; exposed offload purple), idle gaps blank,
    and the gradient sync (grey) at the end. Shared time axis, so panels compare directly."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(results)
    tmax = max(r.step_time_s for r in results) if results else 1.0
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.2 + 1.9 * n), squeeze=False, sharex=True)
    for ax, r in zip(axes[:, 0], results):
        s = r.schedule
        ranks = sample_ranks(s.world, max_ranks)
        rep_end = float(r.info.get("replay_step_s", 0.0)) + r.data_stall_s
        for row, rank in enumerate(ranks):
            lo, hi = int(s.rank_mb[rank]), int(s.rank_mb[rank + 1])
            bars: Dict[str, List[tuple]] = {"local": [], "ring": [], "comm": [], "tp": [], "off": []}
            for m in range(lo, hi):
                st = float(r.mb_start[m])
                c, x, o = float(r.mb_compute[m]), float(r.mb_comm[m]), float(r.mb_offload[m])
                tc = float(r.mb_tp_comm[m]) if r.mb_tp_comm.size else 0.0
                bars["ring" if s.mb_ring[m] >= 0 else "local"].append((st, c))
                if x > 0:
                    bars["comm"].append((st + c, x))
                if tc > 0:
                    bars["tp"].append((st + c + x, tc))
                if o > 0:
                    bars["off"].append((st + c + x + tc, o))
            y = (row - 0.4, 0.8)
            ax.broken_barh(bars["local"], y, facecolors="#4c72b0")
            ax.broken_barh(bars["ring"], y, facecolors="#dd8452")
            ax.broken_barh(bars["comm"], y, facecolors="#c44e52")
            ax.broken_barh(bars["tp"], y, facecolors="#55a868")
            ax.broken_barh(bars["off"], y, facecolors="#8172b3")
            if r.data_stall_s > 0:
                ax.broken_barh([(0.0, r.data_stall_s)], y, facecolors="#937860")
            if r.grad_sync_s > 0:
                ax.broken_barh([(rep_end, r.grad_sync_s)], y, facecolors="#8c8c8c")
        ax.set_ylim(-0.6, len(ranks) - 0.4)
        ax.set_ylabel("rank" if r.tp == 1 else f"unit ({r.tp} GPUs)")
        step = len(ranks) // 6 or 1
        ax.set_yticks(range(0, len(ranks), step))
        ax.set_yticklabels([str(int(x)) for x in ranks[::step]], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{r.strategy}: step {r.step_time_s:.3f} s, {r.tokens_per_s:.3g} tokens/s, MFU {r.mfu:.3f}"
                     + (f" ({len(ranks)} of {s.world} ranks shown)" if len(ranks) < s.world else ""), fontsize=9)
        ax.set_xlim(0, tmax * 1.01)
    axes[-1, 0].set_xlabel("time in the step (s)")
    kinds = [("#4c72b0", "local compute"), ("#dd8452", "ring compute"), ("#c44e52", "exposed ring comm")]
    if any(r.tp > 1 for r in results):
        kinds.append(("#55a868", "TP collectives"))
    kinds += [("#8172b3", "exposed offload"), ("#937860", "data stall"), ("#8c8c8c", "gradient sync")]
    handles = [Patch(color=c, label=l) for c, l in kinds]
    fig.legend(handles=handles, loc="upper center", ncol=len(kinds), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, y=0.995, fontsize=10, va="bottom")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
