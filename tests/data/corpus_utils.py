"""Helpers of the data tests: small real corpora written to disk, forked "ranks" (imported by name,
not through ``conftest``, which names another folder's module when several folders are collected)."""
from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from pathlib import Path
from typing import Any, Callable, List

import numpy as np

WORDS = ["def", "return", "lambda", "naïve", "café", "数据", "loader", "ring", "zig-zag", "😀", "token", "x"]


def make_texts(n: int, seed: int = 0, scale: int = 40) -> List[str]:
    """``n`` documents with heavy-tailed lengths (Pareto) and non-ASCII characters."""
    rng = np.random.default_rng(seed)
    lens = np.minimum((rng.pareto(1.2, n) + 1) * scale, 200 * scale).astype(int)
    return [f"doc{i}: " + " ".join(WORDS[(i + k * 7) % len(WORDS)] for k in range(m)) for i, m in enumerate(lens)]


def write_jsonl(path: Path, texts: List[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t, "meta": len(t)}, ensure_ascii=False) + "\n")
    return path


def _child(conn, fn, args) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_forked(fns: List[Callable], args: List[tuple], timeout: float = 60.0) -> List[Any]:
    """Run ``fns[i](*args[i])`` in forked processes at once; return their results; kill all and
    fail on a timeout or an exception (with the child's traceback)."""
    ctx = mp.get_context("fork")
    procs, conns = [], []
    for fn, a in zip(fns, args):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(w, fn, a))  # not daemonic: it may start a service
        p.start()
        w.close()
        procs.append(p)
        conns.append(r)
    out = []
    try:
        for i, c in enumerate(conns):
            if not c.poll(timeout):
                raise TimeoutError(f"forked process {i} gave no result within {timeout} s")
            status, value = c.recv()
            if status == "error":
                raise RuntimeError(f"forked process {i} failed:\n{value}")
            out.append(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return out
