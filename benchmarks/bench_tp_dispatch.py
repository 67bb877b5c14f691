"""Tensor parallelism on micro-batches whose lengths all differ (HDP's case): the local plan
(``tensor_parallel(..., compute="local")``: plain tensors, bytescale's TP collectives, the
vocabulary-parallel loss in ``token_level_loss``) against torch's DTensor styles
(``compute="dtensor"`` with ``loss_parallel``), the same model and micro-batches, in one run.

    python benchmarks/bench_tp_dispatch.py                       # TP 2 on CPU, 2 processes
    python benchmarks/bench_tp_dispatch.py --json tp_dispatch.json

DTensor caches its sharding propagation per op by input shapes: a micro-batch of a new length
misses the cache in every op of every layer (a fake-tensor run of the op). Per micro-batch
(forward + backward, wall clock and CPU time of rank 0's thread), medians over:
  * ``new lengths``: every micro-batch a length not seen before (HDP's micro-batches);
  * ``same length``: one length again and again (a padded or fixed-length loader: cache hits).
The two plans alternate micro-batch by micro-batch, so load on the machine hits both alike; both
see the same weights and tokens, and their losses are checked to agree.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time


def _worker(rank: int, world: int, args, port: int, out_q) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    import bytescale
    from bytescale.attention.layout import Layout
    from bytescale.models import Llama, LlamaConfig
    from bytescale.models.parallel import tensor_parallel
    from bytescale.runtime.loss import token_level_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("bytescale", rank=rank, world_size=world)
    mesh = bytescale.init_mesh(tp=world)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_dim=args.ffn)
    models = {}
    for compute in ("local", "dtensor"):
        torch.manual_seed(0)
        models[compute] = tensor_parallel(Llama(cfg), mesh["tp"], sequence_parallel=args.sp, compute=compute)
    rng = random.Random(1)
    new = rng.sample(range(args.min_len, args.max_len), args.micro_batches)
    same = [args.max_len // 2] * args.micro_batches
    rows = []

    def step(compute: str, n: int) -> tuple:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        pos = torch.arange(n)
        t0, c0 = time.perf_counter(), time.thread_time()
        logits = models[compute](ids, pos, layout=Layout.local([n]))
        labels = torch.roll(ids, -1)
        if compute == "local":
            loss = token_level_loss(logits, labels, n)
            loss.backward()
        else:
            with loss_parallel():
                loss = F.cross_entropy(logits, labels, reduction="sum") / n
                loss.backward()
            loss = loss.full_tensor()
        return time.perf_counter() - t0, time.thread_time() - c0, float(loss.detach())

    for compute in models:  # warm-up: one length neither list uses
        step(compute, args.min_len - 1)
    for label, lengths in (("new lengths", new), ("same length", same)):
        for n in lengths:
            r = {}
            for compute in ("local", "dtensor") if n % 2 else ("dtensor", "local"):
                r[compute] = step(compute, n)
            assert abs(r["local"][2] - r["dtensor"][2]) <= 1e-4 * abs(r["dtensor"][2]), (n, r)
            rows.append((label, n, r["local"][:2], r["dtensor"][:2]))
    if rank == 0:
        out_q.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--micro-batches", type=int, default=24)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--json", help="write the rows and the summary here")
    args = ap.parse_args()

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.tp, args, port, q)) for r in range(args.tp)]
    for p in procs:
        p.start()
    import queue

    rows = None
    while rows is None:
        try:
            rows = q.get(timeout=5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                codes = [p.exitcode for p in procs]
                for p in procs:
                    p.kill()
                raise SystemExit(f"bench_tp_dispatch: a rank failed (exit codes {codes}); see its traceback above")
    for p in procs:
        p.join(timeout=120)
    summary = {}
    print(f"TP {args.tp}{' + SP' if args.sp else ''}, Llama dim {args.dim} x {args.layers} layers, "
          f"vocab {args.vocab}, lengths {args.min_len}-{args.max_len}; per micro-batch, rank 0, medians (ms)")
    print(f"{'micro-batches':<14} {'local wall':>11} {'dtensor wall':>13} {'local CPU':>10} {'dtensor CPU':>12} "
          f"{'dtensor / local (CPU)':>22}")
    for label in ("new lengths", "same length"):
        sel = [r for r in rows if r[0] == label]
        lw = statistics.median(r[2][0] for r in sel) * 1e3
        dw = statistics.median(r[3][0] for r in sel) * 1e3
        lc = statistics.median(r[2][1] for r in sel) * 1e3
        dc = statistics.median(r[3][1] for r in sel) * 1e3
        summary[label] = {"local_wall_ms": lw, "dtensor_wall_ms": dw, "local_cpu_ms": lc, "dtensor_cpu_ms": dc,
                          "n": len(sel)}
        print(f"{label:<14} {lw:11.1f} {dw:13.1f} {lc:10.1f} {dc:12.1f} {dc / lc:21.2f}x")
    if args.json:
        import torch

        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "args": vars(args),
                       "load": os.getloadavg(), "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
