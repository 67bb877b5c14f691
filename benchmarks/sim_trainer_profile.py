"""A CPU cost profile measured through the trainer's own code path (benchmarks/validate_sim.py).

``bytescale.profile`` times a model on single documents with whatever attention the model has;
``python -m bytescale.train`` runs bytescale's kernels on packed micro-batches inside
``HybridDataParallel.micro_batch``. This module prices what the trainer runs:

* :func:`local_profile`: the package's Llama (the trainer's model, built by the trainer's builder)
  wrapped in ``HybridDataParallel`` (a one-rank process group on the bytescale backend), packed
  micro-batches of several real documents (lengths from the trainer's dataset) and single
  documents longer than the capacity (those the planner shards over rings: without them the
  s^2 term is not identifiable from short documents) under ``Layout.local`` (the varlen op; on
  CPU the ``sdpa`` kernel), timed as ``Trainer.train_step`` does one micro-batch
  (forward with ``layout=``, token-level loss, backward, the loss's ``.cpu()``). Least squares
  (non-negative, relative errors) of ``T = a1 sum(s^2) + b1 tokens + g``: ``g`` is the trainer's fixed cost per
  micro-batch.
* :func:`ring_profile`: ring micro-batches through the same code path, timed in place with ``n``
  processes (the bytescale backend, the CPU ring kernel), as the ``n``-rank run runs them: the
  model's forward and backward under a ring ``Layout``, the agreement check, the K/V and dK/dV
  exchanges and the waits for the peers included. For each ring size d in 2..n the ranks form
  ``n // d`` rings that run at once (a rank left over runs a local micro-batch, so the cores are
  as busy as in training), each case ``reps`` times back to back as a step runs its micro-batches
  (the mean per micro-batch). Least squares (non-negative) of ``T = ar sum(s^2)/d + br tokens + (cs
  + cn documents) d + c0`` per micro-batch on rank 0 (the kernel works block by block: per ring
  step, per document). The simulator prices ring micro-batches with it (``ClusterSpec.ring_*``)
  instead of the local profile, which does not see what a ring adds: the agreement check, the
  exchanges, and the waits for the ring's slowest member.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from scipy.optimize import nnls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fit(cols: List[np.ndarray], y: np.ndarray, relative: bool = False) -> np.ndarray:
    """Non-negative least squares of ``y`` on ``cols``; ``relative``: minimise the relative errors
    (each row weighted by 1 / y), so short and long samples count alike."""
    a = np.stack(cols, 1)
    if relative:
        w = 1.0 / np.maximum(y, 1e-12)
        a, y = a * w[:, None], y * w
    x, _ = nnls(a, y)
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


def _long_docs(lengths: np.ndarray, capacity: int, max_len: int, n: int) -> List[List[int]]:
    """``n`` single documents longer than ``capacity`` (up to ``max_len``, the longest the run can
    see): the documents the planner shards over rings. Timed locally they give the attention
    term's s^2 coefficient, which packed short documents cannot pin down."""
    longest = min(int(max_len), int(lengths.max()) if lengths.size else int(max_len))
    if longest <= capacity:
        return []
    return [[int(x)] for x in np.linspace(capacity + 1, longest, n).round()]


def local_profile(cfg: Any, vocab: int, lengths: np.ndarray, capacity: int, n_mb: int = 24,
                  reps: int = 5, max_len: Optional[int] = None, n_long: int = 8) -> Dict[str, Any]:
    """Whole-model micro-batch time through ``HybridDataParallel.micro_batch`` (module doc): ``n_mb``
    packed micro-batches of short documents plus ``n_long`` single documents longer than the
    capacity (up to ``max_len``), all under ``Layout.local``."""
    import torch.distributed as dist

    import bytescale  # noqa: F401  (registers the backend)
    from bytescale.attention import Layout
    from bytescale.runtime import HybridDataParallel
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
        packs = _packs(lengths, capacity, n_mb, rng)
        if max_len:
            packs += _long_docs(lengths, capacity, max_len, n_long)
        for docs in packs:
            T = sum(docs)
            one = _micro_batch_fn(hdp, vocab, Layout.local(docs), T, torch.cat([torch.arange(s) for s in docs]))
            rows.append((float(sum(s * s for s in docs)), float(T), _median_time(one, reps), docs))
        sampler.__exit__()
    finally:
        dist.destroy_process_group()
    sq, tok, t = (np.array([r[i] for r in rows]) for i in range(3))
    a1, b1, g = _fit([sq, tok, np.ones_like(t)], t, relative=True)
    pred = a1 * sq + b1 * tok + g
    return {"a1": float(a1), "b1": float(b1), "g": float(g), "fit_rel_err": float(np.mean(np.abs(pred / t - 1))),
            "background_runnable": sampler.background,
            "samples": [{"docs": r[3], "seconds": r[2]} for r in rows],
            "heads": int(model.cfg.n_heads), "kv_heads": int(model.cfg.n_kv_heads),
            "head_dim": int(model.cfg.head_dim), "attn_layers": int(model.cfg.n_layers)}


def ring_cases(lengths: np.ndarray, capacity: int, n: int, per_d: int = 7) -> List[Any]:
    """The (ring size d, documents) cases :func:`ring_profile` times with ``n`` processes: for each
    d in 2..n, packed sets of real document lengths up to ``capacity x d`` and three single
    documents of 0.4, 0.7 and 1.0 x ``capacity x d`` (the same list in every process: seeded)."""
    rng = np.random.default_rng(1)
    cases = []
    for d in range(2, n + 1):
        for docs in _packs(lengths, capacity * d, per_d - 3, rng):
            cases.append((d, docs))
        for f in (0.4, 0.7, 1.0):
            cases.append((d, [int(capacity * d * f)]))
    return cases


def _micro_batch_fn(hdp: Any, vocab: int, layout: Any, T: int, positions: torch.Tensor) -> Any:
    """One micro-batch as ``Trainer.train_step`` runs it (forward with ``layout=``, token-level
    loss, backward, the loss's ``.cpu()``) on random tokens."""
    from bytescale.runtime.types import MicroBatch
    from bytescale.planner.types import MicroBatchPlan
    from bytescale.runtime import token_level_loss

    ids = torch.randint(0, vocab, (T,))
    mb = MicroBatch(ids, torch.randint(0, vocab, (T,)), positions, MicroBatchPlan(rank=0, index=0), layout)

    def one() -> None:
        with hdp.micro_batch(mb, last=False):
            logits, aux = hdp(mb.input_ids, mb.position_ids, layout=mb.layout, global_tokens=T, return_aux=True)
            loss = token_level_loss(logits, mb.labels, T)
            (loss if aux is None else loss + aux).backward()
        loss.detach().double().cpu()

    return one


def _ring_worker(rank: int, n: int, port: int, cfg: Any, vocab: int, cases: List[Any], reps: int,
                 q: Any) -> None:
    import torch.distributed as dist

    import bytescale  # noqa: F401  (registers the backend)
    from bytescale.attention import Layout
    from bytescale.attention.zigzag import local_ranges
    from bytescale.runtime import HybridDataParallel
    from bytescale.train.build import build_model

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("bytescale", rank=rank, world_size=n)
    out = []
    try:
        torch.manual_seed(0)
        model, _ = build_model(cfg, vocab, torch.device("cpu"))
        vocab = model.cfg.vocab_size
        hdp = HybridDataParallel(model)
        for d, docs in cases:
            ring_no, pos = divmod(rank, d)
            if ring_no < n // d:
                ring = list(range(ring_no * d, ring_no * d + d))
                layout = Layout(sharded_lens=tuple(docs), ring=tuple(ring), ring_pos=pos)
                positions = torch.cat([torch.arange(a, b) for s in docs for a, b in local_ranges(s, d, pos)])
            else:  # a rank left over keeps its core busy as in training: a local micro-batch of a share
                lens = [max(1, s // d) for s in docs]
                layout = Layout.local(lens)
                positions = torch.cat([torch.arange(s) for s in lens])
            one = _micro_batch_fn(hdp, vocab, layout, int(positions.numel()), positions)
            one()  # warm-up
            dist.barrier()
            t0 = time.perf_counter()  # back to back, as a step runs its micro-batches
            for _ in range(reps):
                one()
            out.append((time.perf_counter() - t0) / reps)
        if rank == 0:
            q.put(out)
    finally:
        dist.destroy_process_group()


def ring_profile(n: int, cfg: Any, vocab: int, lengths: np.ndarray, capacity: int,
                 reps: int = 24) -> Dict[str, Any]:
    """Ring micro-batches as the trainer runs them, measured in place with ``n`` processes (module
    doc): per micro-batch on rank 0, fitted as ``ar sum(s^2)/d + br tokens + (cs + cn documents) d
    + c0`` (``tokens``: the rank's share)."""
    import torch.multiprocessing as mp

    from bytescale.attention.zigzag import local_tokens

    cases = ring_cases(lengths, capacity, n)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    ps = [ctx.Process(target=_ring_worker, args=(r, n, port, cfg, vocab, cases, reps, q)) for r in range(n)]
    for p in ps:
        p.start()
    try:
        times = q.get(timeout=900)
    finally:
        for p in ps:
            p.join(60)
            if p.is_alive():
                p.kill()
    rs = np.array([sum(s * s for s in docs) / d for d, docs in cases], dtype=np.float64)
    rtok = np.array([sum(local_tokens(s, d, 0) for s in docs) for d, docs in cases], dtype=np.float64)
    rd = np.array([d for d, _ in cases], dtype=np.float64)
    rn = np.array([len(docs) * d for d, docs in cases], dtype=np.float64)
    rt = np.array(times)
    cols = [rs, rtok, rd, rn, np.ones_like(rt)]
    ar, br, cs, cn, c0 = _fit(cols, rt)
    pred = np.stack(cols, 1) @ np.array([ar, br, cs, cn, c0])
    return {"ranks": n, "ar": float(ar), "br": float(br), "cs": float(cs), "cn": float(cn), "c0": float(c0),
            "fit_rel_err": float(np.mean(np.abs(pred / rt - 1))),
            "samples": [{"d": d, "docs": docs, "seconds": t} for (d, docs), t in zip(cases, times)]}
