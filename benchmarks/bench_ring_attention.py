"""Ring attention benchmark: a "virtual ring" of N = 1, 2, 4, 8 positions run in one process (the
very block steps a real ring runs -- flash attention per step on CUDA, bytescale's gather /
scatter-add / LSE-merge kernels -- minus the communication) against monolithic attention on the
same documents, side by side in one run.

    python benchmarks/bench_ring_attention.py            # CPU, fp32, head dim 64, 2K-8K tokens,
                                                         # the tiled and the default (sdpa) kernel
    python benchmarks/bench_ring_attention.py --cuda --png benchmarks/ring_attention.png
                                                         # one GPU, bf16, head dim 128, 8K-128K

    python benchmarks/bench_ring_attention.py --cuda --packed --jsonl ring_packed.jsonl
                                                         # packed variable lengths, cuDNN vs flash

``--packed``: micro-batches of packed documents of varied lengths (seeded), a new mix each time,
as HDP training sees them: per kernel choice (flash, cudnn), the first call of each micro-batch
(including whatever per-shape setup the kernel pays, e.g. cuDNN graph builds) and the steady
time of the same micro-batch repeated, plus the process's resident host memory after each
kernel (cuDNN's graph cache lives on the host). ``--jsonl`` appends every row as soon as it is
measured (a timeout loses nothing).

The virtual ring's time is the TOTAL work of all N ranks (a real ring divides it over N ranks
and overlaps the K/V exchange with it); its ratio to monolithic attention on the full sequence
is the ring's compute efficiency (1.0 = no overhead from splitting into blocks). TFLOP/s count
causal attention: forward 2 * 2 * S^2 * Hq * D / 2, backward 2.5x that. On CUDA the monolithic
references are torch's SDPA with the flash and the cuDNN backends; the LSE-merge kernel's
bandwidth is reported against a device-to-device copy measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.nn.functional as F

import bytescale  # noqa: F401
from bytescale.attention import shard_order, varlen_attention, virtual_ring_attention


def timer(cuda: bool):
    if not cuda:
        def run(fn, reps):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return sorted(ts)[len(ts) // 2]
        return run

    def run(fn, reps):
        fn()
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return sorted(ts)[len(ts) // 2]
    return run


def sdpa_fn(q, k, v, backend, bwd):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "cpu": SDPBackend.MATH}[backend]
    hq, hkv = q.shape[1], k.shape[1]
    # (1, H, S, D); GQA by repeating K/V heads (not every backend takes enable_gqa)
    qs = q.transpose(0, 1)[None].detach().requires_grad_(bwd)
    ks = k.repeat_interleave(hq // hkv, 1).transpose(0, 1)[None].detach().requires_grad_(bwd)
    vs = v.repeat_interleave(hq // hkv, 1).transpose(0, 1)[None].detach().requires_grad_(bwd)
    dout = torch.randn_like(qs)

    def f():
        with sdpa_kernel([be]):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            if bwd:
                torch.autograd.grad(o, (qs, ks, vs), dout)
    return f


def ring_fn(q, k, v, s, n, bwd, kernel):
    qs, ks, vs = (shard_order(x, [s], n).detach().requires_grad_(bwd) for x in (q, k, v))
    dout = torch.randn_like(qs)

    def f():
        import bytescale._C as C

        before = C.attention.kernel_choice()
        C.attention.set_kernel_choice(kernel)
        try:
            o = virtual_ring_attention(qs, ks, vs, [s], n)
            if bwd:
                torch.autograd.grad(o, (qs, ks, vs), dout)
        finally:
            C.attention.set_kernel_choice(before)
    return f


def merge_bandwidth(run, reps):
    import bytescale._C as C

    t, h, d = 131072, 32, 128
    out = torch.randn(t, h, d, device="cuda")
    lse = torch.randn(h, t, device="cuda")
    ob = torch.randn(t, h, d, device="cuda").bfloat16()
    lb = torch.randn(h, t, device="cuda")
    nbytes = out.numel() * (4 + 2 + 4) + lse.numel() * 4 * 3  # read out, out_b; write out; lse x3
    tm = run(lambda: C.attention.merge_lse_(out, lse, ob, lb), reps)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(big)
    tc = run(lambda: dst.copy_(big), reps)
    return nbytes / tm / 1e12, 2 * big.numel() / tc / 1e12


def rss_mib() -> float:
    """Resident host memory of this process (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class RowLog:
    """Appends each row to a JSON-lines file as soon as it is measured (``--jsonl``)."""

    def __init__(self, path):
        self.path = path
        if path:
            open(path, "a").close()

    def __call__(self, row):
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def packed_lengths(rng, total, lo=512, hi=16384):
    """Document lengths of one packed micro-batch: varied, summing to ``total``."""
    out, left = [], total
    while left > 0:
        n = int(min(left, rng.integers(lo, hi)))
        out.append(n)
        left -= n
    return out


def run_packed(a, log):
    """Packed variable lengths: first call vs steady time per kernel, host memory (see module doc)."""
    import numpy as np

    import bytescale._C as C

    cuda = a.cuda
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv, d = (32, 8, 128) if cuda else (8, 2, 64)
    total = a.packed_tokens or (65536 if cuda else 4096)
    kernels = ["flash", "cudnn"] if cuda else ["tiled", "sdpa"]
    print(f"# bench_ring_attention --packed ({datetime.date.today()}, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}, {dtype}, Hq={hq} Hkv={hkv} D={d}, "
          f"{total} tokens per micro-batch, ring of {a.packed_ring}, torch {torch.__version__})\n")
    print("| kernel | micro-batch | documents | first call (ms) | steady (ms) | host RSS (MiB) |\n|---|---|---|---|---|---|")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for kn in kernels:
        rng = np.random.default_rng(0)  # the same mixes for every kernel
        before = C.attention.kernel_choice()
        C.attention.set_kernel_choice(kn)
        try:
            for i in range(a.packed_batches):
                lens = packed_lengths(rng, total, hi=a.packed_max_doc)
                g = torch.Generator(device=dev).manual_seed(i)
                mk = lambda h: torch.randn(total, h, d, device=dev, dtype=dtype, generator=g)  # noqa: E731
                q, k, v = (shard_order(x, lens, a.packed_ring).requires_grad_() for x in (mk(hq), mk(hkv), mk(hkv)))
                dout = torch.randn_like(q)

                def f():
                    o = virtual_ring_attention(q, k, v, lens, a.packed_ring)
                    torch.autograd.grad(o, (q, k, v), dout)
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                first = time.perf_counter() - t0
                steady = timer(cuda)(f, a.reps)
                row = dict(mode="packed", kernel=kn, micro_batch=i, documents=len(lens), tokens=total,
                           ring=a.packed_ring, first_ms=first * 1e3, steady_ms=steady * 1e3, rss_mib=rss_mib())
                log(row)
                print(f"| {kn} | {i} | {len(lens)} | {first * 1e3:.1f} | {steady * 1e3:.1f} | {row['rss_mib']:.0f} |",
                      flush=True)
        finally:
            C.attention.set_kernel_choice(before)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="*")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--png", help="plot efficiency vs N here")
    ap.add_argument("--jsonl", help="append every row here as soon as it is measured")
    ap.add_argument("--packed", action="store_true", help="packed variable lengths (see module doc)")
    ap.add_argument("--packed-tokens", type=int, default=0, help="tokens per packed micro-batch")
    ap.add_argument("--packed-batches", type=int, default=6, help="packed micro-batches per kernel")
    ap.add_argument("--packed-ring", type=int, default=4, help="virtual ring size of the packed runs")
    ap.add_argument("--packed-max-doc", type=int, default=16384, help="longest packed document")
    a = ap.parse_args(argv)
    log = RowLog(a.jsonl)
    if a.packed:
        run_packed(a, log)
        return
    cuda = a.cuda
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv, d = (32, 8, 128) if cuda else (8, 2, 64)
    lengths = a.lengths or ([8192, 32768, 131072] if cuda else [2048, 4096, 8192])
    run = timer(cuda)
    # CPU: torch's SDPA with its fused CPU flash kernel (FLASH_ATTENTION backend), what the "sdpa"
    # ring kernel calls per segment; the tiled kernel beside the default choice
    refs = ["flash", "cudnn"] if cuda else ["flash"]
    dev_name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# bench_ring_attention ({datetime.date.today()}, {dev_name}, {dtype}, Hq={hq} Hkv={hkv} "
          f"D={d}, causal, one document, torch {torch.__version__})\n")
    kernels = ["flash", "auto"] if cuda else ["tiled", "auto"]
    rows = []
    print("| tokens | pass | N | " + " | ".join(f"ring [{kn}] (ms)" for kn in kernels) +
          " | TFLOP/s (best ring) | " + " | ".join(f"SDPA {r} (ms)" for r in refs) + " | " +
          " | ".join(f"eff. ring [{kn}] vs SDPA {r}" for kn in kernels for r in refs) + " |")
    ncol = 3 + len(kernels) + 1 + len(refs) + len(kernels) * len(refs)
    print("|" + "---|" * ncol)
    for s in lengths:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(s, hq, d, device=dev, dtype=dtype, generator=g)
        k = torch.randn(s, hkv, d, device=dev, dtype=dtype, generator=g)
        v = torch.randn(s, hkv, d, device=dev, dtype=dtype, generator=g)
        fwd_flops = 2 * 2 * s * s * hq * d / 2
        for bwd in (False, True):
            ref_t = {}
            for r in refs:
                try:
                    ref_t[r] = run(sdpa_fn(q, k, v, r, bwd), a.reps)
                except RuntimeError as e:  # backend not available for these shapes
                    print(f"<!-- SDPA {r} unavailable: {str(e).splitlines()[0]} -->")
                    ref_t[r] = float("nan")
            flops = fwd_flops * (3.5 if bwd else 1.0)
            for n in (1, 2, 4, 8):
                t = {kn: run(ring_fn(q, k, v, s, n, bwd, kn), a.reps) for kn in kernels}
                best = min(t.values())
                row = dict(tokens=s, bwd=bwd, n=n, tflops=flops / best / 1e12,
                           **{f"ring_{kn}_ms": t[kn] * 1e3 for kn in kernels},
                           **{f"sdpa_{r}_ms": ref_t[r] * 1e3 for r in refs},
                           **{f"eff_{kn}_{r}": ref_t[r] / t[kn] for kn in kernels for r in refs})
                rows.append(row)
                log(row)
                print(f"| {s} | {'fwd+bwd' if bwd else 'fwd'} | {n} | " +
                      " | ".join(f"{t[kn] * 1e3:.2f}" for kn in kernels) + f" | {row['tflops']:.3g} | " +
                      " | ".join(f"{ref_t[r] * 1e3:.2f}" for r in refs) + " | " +
                      " | ".join(f"{row[f'eff_{kn}_{r}']:.2f}" for kn in kernels for r in refs) + " |")
        if not cuda:
            mono = run(lambda: varlen_attention(q, k, v, [s]), a.reps)
            print(f"| {s} | fwd | bytescale monolithic varlen | {mono * 1e3:.2f} | | | |")
    if cuda:
        mb, cb = merge_bandwidth(run, a.reps)
        print(f"\nLSE-merge kernel (131072 x 32 x 128, bf16 block into fp32): {mb:.2f} TB/s; "
              f"device-to-device copy (1 GiB, read + write): {cb:.2f} TB/s; ratio {mb / cb:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        for ax, bwd in zip(axes, (False, True)):
            for s in lengths:
                pts = [r for r in rows if r["tokens"] == s and r["bwd"] == bwd]
                for kn in kernels:
                    ax.plot([r["n"] for r in pts], [r[f"eff_{kn}_{refs[-1]}"] for r in pts],
                            "o-" if kn == "auto" else "x--", label=f"{s // 1024}K, ring [{kn}]")
            ax.axhline(0.9, color="gray", ls="--", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("ring size N (virtual ring, one GPU)")
            ax.set_title(f"{'fwd+bwd' if bwd else 'fwd'}: SDPA {refs[-1]} time / ring time")
            ax.legend(fontsize=7)
        axes[0].set_ylabel("efficiency")
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
