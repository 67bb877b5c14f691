"""Cost of ring attention's agreement check (csrc/attention/ring_agreement.h): a real ring of
``--world`` processes on the bytescale backend (CPU, Gloo), timing the forward of
``ring_attention`` with the check on and off, interleaved (on, off, on, off, ...) so that load on
the machine hits both alike; the median of ``--reps`` calls per size.

    python benchmarks/bench_ring_check.py --world 2 3 --tokens 64 1024 4096

``tokens`` is the sequence length of the one document the ring shards (each rank holds 1/N of it);
the smallest size shows the check's latency almost alone.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, sizes, reps, heads, dim, tmp, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import bytescale  # noqa: F401  (registers the backend)
    from bytescale.attention import ring_attention, set_ring_checks, shard

    dist.init_process_group("bytescale", store=dist.FileStore(os.path.join(tmp, "store"), world),
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    ring = list(range(world))
    rows = []
    for s in sizes:
        g = torch.Generator().manual_seed(s)
        q, k, v = (shard(torch.randn(s, heads, dim, generator=g), [s], world, rank) for _ in range(3))
        times = {True: [], False: []}
        for i in range(2 * reps + 2):
            on = i % 2 == 0
            set_ring_checks(on)
            dist.barrier()
            t0 = time.perf_counter()
            ring_attention(q, k, v, [s], ring)
            dt = time.perf_counter() - t0
            if i >= 2:  # the first pair warms up
                times[on].append(dt)
        rows.append({"world": world, "tokens": s, "tokens_per_rank": q.shape[0],
                     "on_ms": statistics.median(times[True]) * 1e3,
                     "off_ms": statistics.median(times[False]) * 1e3})
    set_ring_checks(True)
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = []
    for w in a.world:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.pt")
            mp.spawn(_worker, args=(w, a.tokens, a.reps, a.heads, a.dim, tmp, out), nprocs=w)
            rows += torch.load(out)
    print(f"{'N':>3} {'tokens':>7} {'per rank':>8} {'check on ms':>12} {'off ms':>9} {'diff ms':>8} {'rel':>7}")
    for r in rows:
        d = r["on_ms"] - r["off_ms"]
        print(f"{r['world']:>3} {r['tokens']:>7} {r['tokens_per_rank']:>8} {r['on_ms']:>12.3f} "
              f"{r['off_ms']:>9.3f} {d:>8.3f} {d / r['off_ms']:>+7.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
