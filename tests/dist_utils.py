"""Multi-process test harness: real processes, real torch.distributed, a hard timeout.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises the default
process group (``bytescale`` unless told otherwise) over a FileStore, runs ``fn(rank, world_size,
*args)`` in each and returns the list of per-rank return values (anything torch.save can write).
If any rank raises, the others are terminated and the error (with the rank's traceback) is raised
in the test. If the job outlives ``timeout`` seconds, every process is killed and the test fails
with a TimeoutError: a hang never hangs the suite.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0


def _worker(rank: int, fn, world_size: int, args, backend: str, tmpdir: str, pg_timeout_s: float,
            init: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import bytescale  # noqa: F401  (registers the backend)

    if init:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmpdir, f"result_{rank}.pt"))
    finally:
        if init and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # pragma: no cover - teardown after a failure
                traceback.print_exc()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "bytescale",
    timeout: float = DEFAULT_TIMEOUT_S,
    pg_timeout: float = 60.0,
    init: bool = True,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; see module doc."""
    with tempfile.TemporaryDirectory(prefix="bytescale-test-") as tmpdir:
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, args, backend, tmpdir, pg_timeout, init),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"distributed job {getattr(fn, '__name__', fn)} (world size {world_size}) "
                        f"did not finish within {timeout:.0f} s"
                    )
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
        results = []
        for r in range(world_size):
            path = os.path.join(tmpdir, f"result_{r}.pt")
            # A rank that deliberately exited early (os._exit(0)) leaves no result: None.
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return results


def capture_error(fn: Callable[[], Any]):
    """Run ``fn``; return (exception type name or None, message, seconds taken)."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result under test
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "no error", time.monotonic() - t0


def train_on_whole_documents(ds, loader, model, opt) -> tuple:
    """The single-process reference of the multi-process training tests: every step of ``loader``
    trained on its whole documents (no sharding, no rings) with ``model`` (a bytescale Llama, its
    MoE balance loss included) and ``opt``. Returns the per-step losses and the steps' sample ids."""
    import torch

    from bytescale.attention import Layout
    from bytescale.data import IGNORE_INDEX
    from bytescale.runtime import token_level_loss

    losses, batches = [], []
    for step in loader:
        ids = list(step.sample_ids)
        docs = [ds.tokens(i, 0, ds.length(i)) for i in ids]
        labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        logits, aux = model(torch.cat(docs), pos, layout=Layout.local([len(d) for d in docs]),
                            global_tokens=step.global_tokens, return_aux=True)
        loss = token_level_loss(logits, labels, step.global_loss_tokens)
        (loss + aux).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        batches.append(ids)
    return losses, batches
