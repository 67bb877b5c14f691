"""Selective activation offloading: step time and peak resident memory at offload ratios 0, 0.25,
0.5, 0.75, 1.0 and with activation checkpointing, on a stack of Llama-style layers, in one run.

    python benchmarks/bench_offload.py                 # CPU: host-to-host copies (the engine's bookkeeping)
    python benchmarks/bench_offload.py --cuda --seq 65536 --dim 4096 --layers 4   # one GPU
    ... --jsonl rows.jsonl     # every row appended as soon as it is measured

Memory ("peak resident"): on CUDA the peak allocated memory of the step
(torch.cuda.max_memory_allocated, parameters included; the JSONL rows add max_memory_reserved: what
the caching allocator holds, the number that runs out first); on CPU the peak of the process's malloc'd
bytes in use (glibc mallinfo2: uordblks + hblkhd, every thread) during the step above its value just
before the step, sampled every 0.2 ms by a thread in a separate pass: the step's own allocations
(activations, gradients, temporaries), not the parameters and not the host pool, which is warm
(allocated in the warm-up step and reused). Host-to-host offloading frees device memory here as on
a GPU (the offloaded tensors' storage), it just moves the bytes to another CPU buffer. The bytes
of saved activations the hooks kept in place are listed too ("kept saved").
Time: median and fastest step (forward + backward, wall clock) of ``reps``, and the median CPU time
of the process (every thread: compute, the copy worker, the hooks' bookkeeping), variants
interleaved rep by rep so that a loaded machine slows them alike.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import threading
import time

import torch
from torch.utils.checkpoint import checkpoint

import bytescale
from bytescale.attention import Layout
from bytescale.models.llama import Block, LlamaConfig


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


class _CpuPeak:
    """Peak of the process's malloc'd bytes in use (all threads) above the value at entry."""

    def __init__(self, period_s: float = 2e-4) -> None:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        self._info = libc.mallinfo2
        self.period = period_s
        self.peak = 0

    def _now(self) -> int:
        m = self._info()
        return m.uordblks + m.hblkhd

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._now() - self._base)
            time.sleep(self.period)

    def __enter__(self) -> "_CpuPeak":
        self._base = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now() - self._base)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--png", default=None)
    ap.add_argument("--jsonl", default=None, help="append every row here as soon as it is measured")
    ap.add_argument("--only", default=None, help="comma-separated ratios to run (0 always runs), e.g. 0.5")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if a.cuda else "cpu")
    dtype = torch.bfloat16 if a.cuda else torch.float32
    cfg = LlamaConfig(vocab_size=256, dim=a.dim, n_layers=a.layers, n_heads=max(1, a.dim // 64),
                      n_kv_heads=max(1, a.dim // 256), ffn_dim=int(a.dim * 8 / 3) // 8 * 8)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(a.layers)).to(dev, dtype)
    x0 = torch.randn(a.seq, a.dim, device=dev, dtype=dtype)
    pos = torch.arange(a.seq, device=dev)

    def step(ratio, ckpt):
        x = x0.clone().requires_grad_()
        ctx = bytescale.offload(ratio, seq_len=a.seq, min_bytes=1 << 16)
        lay = Layout.local([a.seq])
        with ctx:
            h = x
            for b in blocks:
                h = checkpoint(b, h, pos, lay, use_reentrant=False) if ckpt else b(h, pos, lay)
            h.float().square().mean().backward()
        return ctx.stats.kept_bytes, ctx.stats.offloaded_bytes

    variants = [("ratio 0", 0.0, False), ("ratio 0.25", 0.25, False), ("ratio 0.5", 0.5, False),
                ("ratio 0.75", 0.75, False), ("ratio 1.0", 1.0, False), ("checkpointing", 0.0, True)]
    if a.only is not None:
        keep = {float(x) for x in a.only.split(",")} | {0.0}
        variants = [v for v in variants if not v[2] and v[1] in keep]
    for _name, ratio, ckpt in variants:  # warm-up: kernels, allocator, the engine's host pool
        step(ratio, ckpt)
    times = {name: [] for name, _, _ in variants}
    cpu = {name: [] for name, _, _ in variants}
    for _ in range(a.reps):
        for name, ratio, ckpt in variants:
            if a.cuda:
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            step(ratio, ckpt)
            if a.cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    rows = []
    for name, ratio, ckpt in variants:
        if a.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            kept, off = step(ratio, ckpt)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
        else:
            with _CpuPeak() as mem:
                kept, off = step(ratio, ckpt)
            peak, reserved = mem.peak, None
        rows.append((name, statistics.median(times[name]), peak, kept, off, min(times[name]),
                     statistics.median(cpu[name])))
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                f.write(json.dumps(dict(variant=name, ratio=ratio, checkpointing=ckpt, device=str(dev),
                                        seq=a.seq, dim=a.dim, layers=a.layers,
                                        step_median_ms=rows[-1][1] * 1e3, fastest_ms=rows[-1][5] * 1e3,
                                        cpu_ms=rows[-1][6] * 1e3, peak_mib=peak / 2**20,
                                        peak_reserved_mib=reserved / 2**20 if reserved else None,
                                        kept_mib=kept / 2**20, offloaded_mib=off / 2**20)) + "\n")
    base_t, base_m, base_min, base_cpu = rows[0][1], rows[0][2], rows[0][5], rows[0][6]
    print(f"# bench_offload ({datetime.date.today()}, {dev}, {dtype}, seq {a.seq}, dim {a.dim}, "
          f"{a.layers} layers, {a.reps} reps)\n")
    what = "peak allocated" if a.cuda else "peak resident"
    print(f"| variant | step median (ms) | vs ratio 0 | fastest (ms) | vs ratio 0 | CPU time (ms) | vs ratio 0 | "
          f"{what} (MiB) | saved vs ratio 0 | kept saved (MiB) | offloaded (MiB) |\n"
          f"|---|---|---|---|---|---|---|---|---|---|---|")
    for name, t, m, kept, off, tmin, c in rows:
        print(f"| {name} | {t * 1e3:.1f} | {t / base_t:.3f}x | {tmin * 1e3:.1f} | {tmin / base_min:.3f}x | "
              f"{c * 1e3:.1f} | {c / base_cpu:.3f}x | {m / 2**20:.1f} | {1 - m / base_m:+.1%} | "
              f"{kept / 2**20:.1f} | {off / 2**20:.1f} |")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter([r[2] / 2**20 for r in rows], [r[1] * 1e3 for r in rows])
        for name, t, m, *_ in rows:
            ax.annotate(name, (m / 2**20, t * 1e3))
        ax.set_xlabel(f"{what} (MiB)")
        ax.set_ylabel("step time (ms)")
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)


if __name__ == "__main__":
    main()
