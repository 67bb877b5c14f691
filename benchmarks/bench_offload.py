"""Selective activation offloading: step time and activation memory at offload ratios 0, 0.25, 0.5,
0.75, 1.0 and with activation checkpointing, on a stack of Llama-style layers, in one run.

    python benchmarks/bench_offload.py                 # CPU: host-to-host copies (the engine's bookkeeping)
    python benchmarks/bench_offload.py --cuda --seq 65536 --dim 4096 --layers 4   # one GPU
    ... --jsonl rows.jsonl     # every row appended as soon as it is measured

Memory: on CUDA the peak allocated and reserved memory of the step (torch.cuda.max_memory_allocated,
max_memory_reserved: what the caching allocator holds, the number that runs out first); on CPU
the bytes of saved activations (parameters excluded) that stayed resident, since
host-to-host offloading frees no memory there. Time: median step (forward + backward) of ``reps``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

import bytescale
from bytescale.attention import Layout
from bytescale.models.llama import Block, LlamaConfig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--png", default=None)
    ap.add_argument("--jsonl", default=None, help="append every row here as soon as it is measured")
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

    rows = []
    for name, ratio, ckpt in [("ratio 0", 0.0, False), ("ratio 0.25", 0.25, False), ("ratio 0.5", 0.5, False),
                              ("ratio 0.75", 0.75, False), ("ratio 1.0", 1.0, False), ("checkpointing", 0.0, True)]:
        step(ratio, ckpt)
        ts, mem, reserved = [], [], []
        for _ in range(a.reps):
            if a.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            kept, _off = step(ratio, ckpt)
            if a.cuda:
                torch.cuda.synchronize()
                mem.append(torch.cuda.max_memory_allocated())
                reserved.append(torch.cuda.max_memory_reserved())
            else:
                mem.append(kept)
            ts.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(ts), max(mem)))
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                f.write(json.dumps(dict(variant=name, seq=a.seq, dim=a.dim, layers=a.layers, step_ms=rows[-1][1] * 1e3,
                                        peak_allocated_mib=max(mem) / 2**20,
                                        peak_reserved_mib=max(reserved) / 2**20 if reserved else None)) + "\n")
    base_t, base_m = rows[0][1], rows[0][2]
    print(f"# bench_offload ({datetime.date.today()}, {dev}, {dtype}, seq {a.seq}, dim {a.dim}, "
          f"{a.layers} layers)\n")
    what = "peak allocated" if a.cuda else "resident saved activations"
    print(f"| variant | step (ms) | vs ratio 0 | {what} (MiB) | saved vs ratio 0 |\n|---|---|---|---|---|")
    for name, t, m in rows:
        print(f"| {name} | {t * 1e3:.1f} | {t / base_t:.2f}x | {m / 2**20:.1f} | {1 - m / base_m:+.0%} |")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter([m / 2**20 for _, _, m in rows], [t * 1e3 for _, t, _ in rows])
        for name, t, m in rows:
            ax.annotate(name, (m / 2**20, t * 1e3))
        ax.set_xlabel(f"{what} (MiB)")
        ax.set_ylabel("step time (ms)")
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)


if __name__ == "__main__":
    main()
