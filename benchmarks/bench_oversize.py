"""What finding the documents no plan can hold costs before the first step (issue 41).

    python benchmarks/bench_oversize.py [--docs 100000000] [--reps 3]

A corpus index of ``--docs`` document lengths (int64, heavy-tailed: Pareto(1.1) x 300 tokens,
capped at 4M; what a token store's index gives ``HDPLoader``) is checked against the limit of a
plan over 64 units at capacity 16384 (1M tokens; ~0.01% of documents are longer) by the loader's
own code path: the planner's limit (``bytescale.planner.longest_document``), the one numpy pass
(``lengths > limit``), the view the loader then builds (``DocumentView``: split into pieces or
skip), and a whole ``HDPLoader`` construction over the index. Best of ``--reps``; peak RSS of the
process at the end.
"""
from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from bytescale.config import PlannerConfig
from bytescale.data import DocumentView
from bytescale.planner import longest_document


class _Index:
    """Stands for a token store: its ``lengths`` (the index) and nothing read per document."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)


def _best(fn, reps):
    out, best = None, float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--units", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=16384)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = np.minimum((rng.pareto(1.1, a.docs) + 1) * 300, 1 << 22).astype(np.int64)
    index = _Index(lengths)
    cfg = PlannerConfig(a.capacity)
    limit, t_limit = _best(lambda: longest_document(cfg, a.units), a.reps)
    over, t_pass = _best(lambda: np.flatnonzero(lengths > limit), a.reps)
    print(f"{a.docs:,} documents, {int(lengths.sum()):,} tokens; limit {limit:,} tokens "
          f"({a.units} units x {a.capacity}); {len(over):,} longer")
    print(f"| step | time |\n|---|---|\n| planner limit (longest_document) | {t_limit * 1e3:.3f} ms |\n"
          f"| one pass: lengths > limit | {t_pass * 1e3:.1f} ms |")
    for mode in ("split", "skip"):
        view, t_view = _best(lambda: DocumentView(index, limit, oversize=mode, lengths=lengths), a.reps)
        print(f"| view, oversize={mode} ({len(view):,} ids) | {t_view * 1e3:.1f} ms |")
        del view
    from bytescale.config import LoaderConfig
    from bytescale.data import HDPLoader

    for mode in ("split", "skip"):
        make = lambda: HDPLoader(index, cfg, LoaderConfig(1 << 22, oversize=mode, prefetch=False, check_plan=False),
                                 rank=0, world_size=a.units)
        _, t_loader = _best(make, a.reps)
        print(f"| HDPLoader(store, ...) construction, oversize={mode} (all of it: limit, pass, view, the "
              f"sampler's first shuffle) | {t_loader * 1e3:.1f} ms |")
    perm, t_perm = _best(lambda: np.random.default_rng(0).permutation(len(lengths)), a.reps)
    print(f"| of which the sampler's shuffle of {len(perm):,} ids (before this issue too) | {t_perm * 1e3:.1f} ms |")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
