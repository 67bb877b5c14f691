"""A CPU cost profile measured through the trainer's own code path (benchmarks/validate_sim.py).

``bytescale.profile`` times a model on single documents with whatever attention the model has;
``python -m bytescale.train`` runs bytescale's kernels on packed micro-batches inside
``HybridDataParallel.micro_batch``. This module prices what the trainer runs:

* :func:`local_profile`: the package's Llama (the trainer's model, built by the trainer's builder)
  wrapped in ``HybridDataParallel`` (a one-rank process group on the bytescale backend), packed
  micro-batches of several real documents (lengths from the trainer's dataset) under
  ``Layout.local`` (the varlen kernel), timed as ``Trainer.train_step`` does one micro-batch
  (forward with ``layout=``, token-level loss, backward, the loss's ``.cpu()``). Least squares
  (non-negative) of ``T = a1 sum(s^2) + b1 tokens + g``: ``g`` is the trainer's fixed cost per
  micro-batch.
* :func:`ring_profile`: the CPU ring kernel's per-rank cost, from ``virtual_ring_attention`` (the
  very block steps a d-rank ring runs, in one process, no communication) forward + backward on the
  trainer's head shapes, divided by d, fitted as ``ar sum(s^2)/d + cs d + c0``; beside it the
  varlen kernel on the same documents, ``av sum(s^2) + c0v``. The simulator's ring micro-batch
  then costs ``ring_a1 = a1 + max(0, ar - av) x attention layers`` per ``s^2/d`` and ``ring_step_s = cs x
  attention layers`` per block step.
* :func:`ring_exchange_latency`: the per-ring-step wait with ``n`` processes on this machine's
  cores: ``n`` processes in a ring (bytescale backend) alternate a fixed compute block with a
  send to the next / receive from the previous rank; per step, the wall time minus the compute
  block (timed alone in one process, times the oversubscription max(1, n / cores)).
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from scipy.optimize import nnls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fit(cols: List[np.ndarray], y: np.ndarray) -> np.ndarray:
    x, _ = nnls(np.stack(cols, 1), y)
    return x


class RunnableSampler:
    """Samples the kernel's count of runnable tasks (/proc/loadavg, 4th field) in a thread while a
    profile is measured: the background load ``B`` (runnable tasks besides the measuring one) that
    the profile's single process shared the cores with. None where /proc/loadavg is absent."""

    def __init__(self, period_s: float = 0.1) -> None:
        import threading

        self.samples: List[int] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                with open("/proc/loadavg") as f:
                    self.samples.append(int(f.read().split()[3].split("/")[0]))
            except (OSError, ValueError, IndexError):
                return

    def __enter__(self) -> "RunnableSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()

    def runnable(self, own: int) -> Optional[float]:
        """Median runnable tasks besides ``own`` of ours (the sampler thread counts itself: it is
        running while it reads; pass 2 while a profile measures, 1 while a subprocess trains)."""
        return max(0.0, float(np.median(self.samples)) - own) if self.samples else None

    @property
    def background(self) -> Optional[float]:
        """Runnable tasks besides the measuring thread and the sampler."""
        return self.runnable(2)


def oversubscription(n: int, cores: int, background: float = 0.0, runnable: Optional[float] = None) -> float:
    """How much slower each of ``n`` busy processes computes than the profile's single process did
    (fair share of ``cores``): the profile shared them with ``background`` other runnable tasks,
    the run with ``runnable`` tasks in all (measured while it ran: ours and others'; default ``n +
    background``): ``max(1, R / C) / max(1, (1 + B) / C)``; on a quiet machine ``max(1, n / C)``."""
    r = n + background if runnable is None else max(float(n), runnable)
    return max(1.0, r / cores) / max(1.0, (1.0 + background) / cores)


def _median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _packs(lengths: np.ndarray, capacity: int, n: int, rng: np.random.Generator) -> List[List[int]]:
    """``n`` packed micro-batches of real document lengths: greedy packing up to a random fill
    (a quarter to all of ``capacity``), as the planner packs short documents."""
    short = lengths[(lengths > 0) & (lengths <= capacity)]
    out = []
    for i in range(n):
        fill = int(capacity * (0.25 + 0.75 * (i % 8) / 7))
        docs: List[int] = []
        while True:
            s = int(rng.choice(short))
            if sum(docs) + s > fill:
                break
            docs.append(s)
        out.append(docs or [min(fill, int(short.max()))])
    return out


def local_profile(cfg: Any, vocab: int, lengths: np.ndarray, capacity: int, n_mb: int = 24,
                  reps: int = 5) -> Dict[str, Any]:
    """Whole-model micro-batch time through ``HybridDataParallel.micro_batch`` (module doc)."""
    import torch.distributed as dist

    import bytescale  # noqa: F401  (registers the backend)
    from bytescale.attention import Layout
    from bytescale.data.types import MicroBatch
    from bytescale.planner.types import MicroBatchPlan
    from bytescale.runtime import HybridDataParallel, token_level_loss
    from bytescale.train.build import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("bytescale", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, _ = build_model(cfg, vocab, torch.device("cpu"))
        vocab = model.cfg.vocab_size
        hdp = HybridDataParallel(model)
        rng = np.random.default_rng(0)
        rows = []
        sampler = RunnableSampler()
        sampler.__enter__()
        for docs in _packs(lengths, capacity, n_mb, rng):
            T = sum(docs)
            ids = torch.randint(0, vocab, (T,))
            labels = torch.randint(0, vocab, (T,))
            pos = torch.cat([torch.arange(s) for s in docs])
            mb = MicroBatch(ids, labels, pos, MicroBatchPlan(rank=0, index=0), Layout.local(docs))

            def one() -> None:
                with hdp.micro_batch(mb, last=False):
                    logits, aux = hdp(mb.input_ids, mb.position_ids, layout=mb.layout, global_tokens=T,
                                      return_aux=True)
                    loss = token_level_loss(logits, mb.labels, T)
                    (loss if aux is None else loss + aux).backward()
                loss.detach().double().cpu()

            rows.append((float(sum(s * s for s in docs)), float(T), _median_time(one, reps), docs))
        sampler.__exit__()
    finally:
        dist.destroy_process_group()
    sq, tok, t = (np.array([r[i] for r in rows]) for i in range(3))
    a1, b1, g = _fit([sq, tok, np.ones_like(t)], t)
    pred = a1 * sq + b1 * tok + g
    return {"a1": float(a1), "b1": float(b1), "g": float(g), "fit_rel_err": float(np.mean(np.abs(pred / t - 1))),
            "background_runnable": sampler.background,
            "samples": [{"docs": r[3], "seconds": r[2]} for r in rows],
            "heads": int(model.cfg.n_heads), "kv_heads": int(model.cfg.n_kv_heads),
            "head_dim": int(model.cfg.head_dim), "attn_layers": int(model.cfg.n_layers)}


def ring_profile(heads: int, kv_heads: int, head_dim: int, attn_layers: int, lengths: np.ndarray,
                 capacity: int, ds: Sequence[int] = (2, 3, 4), reps: int = 3) -> Dict[str, Any]:
    """Per-rank CPU ring kernel cost vs the varlen kernel on the same documents (module doc)."""
    from bytescale.attention import shard
    from bytescale.attention.ops import varlen_attention, virtual_ring_attention

    rng = np.random.default_rng(1)
    ring_rows, var_rows = [], []
    for d in ds:
        for docs in _packs(lengths, capacity * d, 6, rng):
            T = sum(docs)
            q = torch.randn(T, heads, head_dim, requires_grad=True)
            k = torch.randn(T, kv_heads, head_dim, requires_grad=True)
            v = torch.randn(T, kv_heads, head_dim, requires_grad=True)
            qs, ks, vs = (torch.cat([shard(x, docs, d, p) for p in range(d)]).detach().requires_grad_()
                          for x in (q, k, v))
            sq = float(sum(s * s for s in docs))

            def ring() -> None:
                virtual_ring_attention(qs, ks, vs, docs, d).sum().backward()

            def var() -> None:
                varlen_attention(q, k, v, docs).sum().backward()

            ring_rows.append((sq / d, float(d), _median_time(ring, reps) / d))
            var_rows.append((sq, _median_time(var, reps)))
    rs, rd, rt = (np.array([r[i] for r in ring_rows]) for i in range(3))
    ar, cs, c0 = _fit([rs, rd, np.ones_like(rt)], rt)
    vs_, vt = (np.array([r[i] for r in var_rows]) for i in range(2))
    av, c0v = _fit([vs_, np.ones_like(vt)], vt)
    return {"ar": float(ar), "cs": float(cs), "c0": float(c0), "av": float(av), "c0v": float(c0v),
            "ring_a1_extra": float(max(0.0, ar - av) * attn_layers), "ring_step_s": float(cs * attn_layers),
            "ring_fit_rel_err": float(np.mean(np.abs((ar * rs + cs * rd + c0) / rt - 1))),
            "ring_samples": [list(r) for r in ring_rows], "varlen_samples": [list(r) for r in var_rows]}


def _spin(n: int) -> None:
    a = torch.randn(96, 96)
    for _ in range(n):
        a = torch.tanh(a @ a)


def _exchange_worker(rank: int, world: int, port: int, nbytes: int, steps: int, spin: int, q: Any) -> None:
    import torch.distributed as dist

    import bytescale  # noqa: F401

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("bytescale", rank=rank, world_size=world)
    buf, out = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for it in range(steps + 3):
        if it == 3:
            dist.barrier()
            t0 = time.perf_counter()
        _spin(spin)
        reqs = [dist.isend(buf, nxt), dist.irecv(out, prv)]
        for r in reqs:
            r.wait()
    el = (time.perf_counter() - t0) / steps
    if rank == 0:
        q.put(el)
    dist.destroy_process_group()


def ring_exchange_latency(n: int, nbytes: int, steps: int = 60, spin: int = 20,
                          background: float = 0.0) -> Dict[str, float]:
    """Per-step wait of an ``n``-process ring exchange interleaved with compute (module doc)."""
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    solo = _median_time(lambda: _spin(spin), 9)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    ps = [ctx.Process(target=_exchange_worker, args=(r, n, port, nbytes, steps, spin, q)) for r in range(n)]
    for p in ps:
        p.start()
    per_step = q.get(timeout=120)
    for p in ps:
        p.join(60)
    slow = oversubscription(n, os.cpu_count() or 1, background)
    return {"ranks": n, "per_step_s": per_step, "compute_solo_s": solo, "oversubscription": slow,
            "wait_s": max(0.0, per_step - slow * solo)}
