"""Ring attention benchmark: a "virtual ring" of N = 1, 2, 4, 8 positions run in one process (the
same block + LSE-merge code a real ring runs, minus communication) against monolithic attention on
the same documents, side by side in one run.

    python benchmarks/bench_ring_attention.py            # CPU, fp32, head dim 64, 2K-8K tokens
    python benchmarks/bench_ring_attention.py --cuda     # one GPU, bf16, head dim 128, 8K-128K

Reports forward time of the whole virtual ring (all N positions in sequence, i.e. the total work;
a real ring divides it over N ranks), its ratio to bytescale's monolithic varlen op (N = 1 on the
full sequence) and to torch's scaled_dot_product_attention, and causal-attention TFLOP/s
(2 * 2 * S^2 * Hq * D / 2 FLOPs forward). fwd+bwd is reported for the monolithic ops.
"""
from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.nn.functional as F

import bytescale  # noqa: F401
from bytescale.ring import varlen_attention


def bench(fn, sync, reps):
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    dev = "cuda" if a.cuda else "cpu"
    dtype = torch.bfloat16 if a.cuda else torch.float32
    hq, hkv, d = (32, 8, 128) if a.cuda else (8, 2, 64)
    lengths = [8192, 32768, 131072] if a.cuda else [2048, 4096, 8192]
    sync = torch.cuda.synchronize if a.cuda else (lambda: None)
    print(f"# bench_ring_attention ({datetime.date.today()}, {dev}, {dtype}, Hq={hq} Hkv={hkv} D={d}, "
          f"causal, torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    print("| tokens | N | virtual ring fwd (ms) | vs bytescale monolithic | vs torch SDPA | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    rows = []
    for s in lengths:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(s, hq, d, device=dev, dtype=dtype, generator=g)
        k = torch.randn(s, hkv, d, device=dev, dtype=dtype, generator=g)
        v = torch.randn(s, hkv, d, device=dev, dtype=dtype, generator=g)
        flops = 2 * 2 * s * s * hq * d / 2
        mono = bench(lambda: varlen_attention(q, k, v, [s]), sync, a.reps)
        qs, ks, vs = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        sdpa = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
                     sync, a.reps)
        for n in (1, 2, 4, 8):
            t = bench(lambda: torch.ops.bytescale.virtual_ring_attn_fwd(q, k, v, [s], n, True, 0.0), sync, a.reps)
            rows.append((s, n, t))
            print(f"| {s} | {n} | {t * 1e3:.1f} | {t / mono:.2f} | {t / sdpa:.2f} | {flops / t / 1e12:.3f} |")
        # fwd+bwd of the monolithic ops
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        fb_mono = bench(lambda: varlen_attention(qg, kg, vg, [s]).sum().backward(), sync, a.reps)
        qsg, ksg, vsg = (x.clone().requires_grad_() for x in (qs, ks, vs))
        fb_sdpa = bench(lambda: F.scaled_dot_product_attention(qsg, ksg, vsg, is_causal=True,
                                                               enable_gqa=True).sum().backward(), sync, a.reps)
        print(f"| {s} | mono fwd+bwd | bytescale {fb_mono * 1e3:.1f} ms, SDPA {fb_sdpa * 1e3:.1f} ms "
              f"| {fb_mono / fb_sdpa:.2f}x SDPA | | |")


if __name__ == "__main__":
    main()
