"""Communication benchmark: dynamic-group creation and collective overhead, side by side in one run.

    python benchmarks/bench_comm.py [--world 4] [--reps 20] [--png benchmarks/comm.png]

CPU (default): ``world`` processes; the default group is ``bytescale``, and a ``gloo`` group over
the same ranks is the native reference, timed interleaved in the same processes.
  * group creation: ``bytescale.dynamic_group`` (uncached and cached) vs ``dist.new_group`` with
    gloo (a new Gloo context) and with bytescale (torch's bookkeeping + a dynamic group backend);
  * all_reduce / all_gather_into_tensor / reduce_scatter_tensor over sizes 4 KiB .. 16 MiB on the
    world group (bytescale: Gloo natives for all_reduce/all_gather, bytescale's ring for
    reduce_scatter), and all_reduce on a dynamic group of all ranks (bytescale's ring) vs gloo.
Ratios are bytescale time / gloo time (1.00 = parity; lower is better), with bytescale's cross-rank
consistency check on (the default) and off. Each sample times a loop of 10 (<= 64 KiB) or 3 ops
between barriers; the three variants are sampled interleaved; medians over ``reps`` samples.
(Barrier time is included in every variant alike.)
GPU (``--cuda``, one process): the NCCL transport against torch's nccl backend at world size 1.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]


def _median_time(fn, reps: int, sync) -> float:
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _worker(rank: int, world: int, reps: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    import bytescale
    from bytescale import _C

    store = dist.FileStore(store_path, world)
    dist.init_process_group("bytescale", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(list(range(world)), backend="gloo")
    barrier = lambda: dist.barrier(group=gloo)  # noqa: E731
    rows = []

    # --- group creation ---------------------------------------------------------------------
    n = 200
    barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        bytescale.dynamic_group(list(range(world)), cache=False)
    dyn = (time.perf_counter() - t0) / n
    bytescale.dynamic_group(list(range(world)))
    t0 = time.perf_counter()
    for _ in range(n):
        bytescale.dynamic_group(list(range(world)))
    cached = (time.perf_counter() - t0) / n
    k = 5
    barrier()
    t0 = time.perf_counter()
    for _ in range(k):
        dist.new_group(list(range(world)), backend="gloo")
    ng_gloo = (time.perf_counter() - t0) / k
    barrier()
    t0 = time.perf_counter()
    for _ in range(k):
        dist.new_group(list(range(world)))
    ng_bs = (time.perf_counter() - t0) / k
    rows.append(("create", "dynamic_group (uncached)", dyn))
    rows.append(("create", "dynamic_group (cached)", cached))
    rows.append(("create", "new_group(backend=gloo)", ng_gloo))
    rows.append(("create", "new_group(backend=bytescale)", ng_bs))

    # --- collectives ------------------------------------------------------------------------
    dyn_all = bytescale.dynamic_group(list(range(world)))
    for size in SIZES:
        numel = size // 4
        x = torch.randn(numel)
        big = torch.randn(numel * world)
        out = torch.empty(numel * world)
        small = torch.empty(numel)
        cases = {
            "all_reduce": (lambda g: dist.all_reduce(x, group=g)),
            "all_gather_into_tensor": (lambda g: dist.all_gather_into_tensor(out, x, group=g)),
            "reduce_scatter_tensor": (lambda g: dist.reduce_scatter_tensor(small, big, group=g)),
        }
        cases["all_reduce (dynamic group ring)"] = lambda g: dist.all_reduce(
            x, group=dyn_all if g is None else g)
        inner = 10 if size <= (64 << 10) else 3
        for name, fn in cases.items():
            fn(None), fn(gloo)  # warm up
            samples = {"checked": [], "unchecked": [], "gloo": []}
            for _ in range(reps):  # interleaved, so drift and noise hit all three alike
                for mode in ("checked", "unchecked", "gloo"):
                    _C.comm.set_collective_checks(mode != "unchecked")
                    g = gloo if mode == "gloo" else None
                    barrier()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fn(g)
                    barrier()
                    samples[mode].append((time.perf_counter() - t0) / inner)
            _C.comm.set_collective_checks(True)
            tb, tu, tg = (statistics.median(samples[m]) for m in ("checked", "unchecked", "gloo"))
            rows.append((name, size, tb, tu, tg))
    if rank == 0:
        torch.save(rows, out_path)
    dist.destroy_process_group()


def _fmt_size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def run_cpu(world: int, reps: int, png: str | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(_worker, args=(world, reps, os.path.join(d, "store"), out), nprocs=world)
        rows = torch.load(out, weights_only=False)
    print(f"# bench_comm: CPU, {world} processes, medians of {reps} (torch {torch.__version__}, "
          f"{datetime.date.today()})\n")
    print("| group creation | time per group |\n|---|---|")
    for r in rows:
        if r[0] == "create":
            print(f"| {r[1]} | {r[2] * 1e6:.1f} us |")
    print("\n| collective | size | bytescale (checked) | bytescale (checks off) | gloo | ratio checked "
          "| ratio checks off |\n|---|---|---|---|---|---|---|")
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r[0] == "create":
            continue
        name, size, tb, tu, tg = r
        print(f"| {name} | {_fmt_size(size)} | {tb * 1e3:.3f} ms | {tu * 1e3:.3f} ms | "
              f"{tg * 1e3:.3f} ms | {tb / tg:.2f} | {tu / tg:.2f} |")
        series.setdefault(name, []).append((size, tu / tg))
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bytescale time / gloo time (checks off)")
        ax.set_title(f"bytescale vs gloo, {world} CPU processes")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        print(f"\nplot: {png}")


def run_cuda(reps: int, jsonl: str = None) -> None:
    """World size 1 on one GPU: bytescale's NCCL path vs torch's nccl backend (separate inits)."""
    import json

    import bytescale  # noqa: F401

    res = {}
    for backend in ("nccl", "bytescale"):
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        sync = torch.cuda.synchronize
        for size in SIZES:
            x = torch.randn(size // 4, device="cuda")
            dist.all_reduce(x)
            res[(backend, size)] = _median_time(lambda: dist.all_reduce(x), reps, sync)
            if jsonl:
                with open(jsonl, "a") as f:
                    f.write(json.dumps(dict(op="all_reduce", backend=backend, bytes=size,
                                            seconds=res[(backend, size)])) + "\n")
        dist.destroy_process_group()
    print("| all_reduce (1 GPU) | size | bytescale | nccl | ratio |\n|---|---|---|---|---|")
    for size in SIZES:
        tb, tn = res[("bytescale", size)], res[("nccl", size)]
        print(f"| all_reduce | {_fmt_size(size)} | {tb * 1e6:.1f} us | {tn * 1e6:.1f} us | {tb / tn:.2f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--png", default=None)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--jsonl", default=None, help="(--cuda) append every row here as soon as it is measured")
    a = p.parse_args(argv)
    if a.cuda:
        run_cuda(a.reps, a.jsonl)
    else:
        run_cpu(a.world, a.reps, a.png)


if __name__ == "__main__":
    sys.exit(main())
