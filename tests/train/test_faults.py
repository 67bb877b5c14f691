"""Faults under load: one rank of a real HDP training job dies; the others fail clearly and in time,
and the job restarts from its last checkpoint on the uninterrupted run's losses.

Every case starts a real 3-rank job (``python -m bytescale.train``'s ``main`` in 3 processes over
the ``bytescale`` backend, Gloo transport, process-group timeout ``PG_TIMEOUT_S``) training the
package's MoE Llama (``mixtral-tiny``: every step has ring micro-batches, and each ring
all-reduces the MoE balance loss' expert counts over its dynamic group) on a synthetic corpus,
with async DCP checkpoints every 2 steps. One rank (chosen by the seed) is SIGKILLed
(tests/train/fault_inject.py) at step >= 4 when it enters:

  ring        the ring-attention op of a sharded micro-batch (its ring peers are in the exchange)
  grad_sync   a gradient bucket's all-reduce (HybridDataParallel)
  fingerprint the loader's per-step plan fingerprint all-reduce
  dyn_group   a dynamic group's all-reduce (the MoE counts of a sharded document)
  wallclock   none: the parent SIGKILLs it at a random time after step 2 was logged

Checked for every survivor: it exits by a Python exception (exit status 1, not a signal), within
PG_TIMEOUT_S + MARGIN_S of the victim's death, and the exception is a RuntimeError whose message
names what failed (the op, a peer or the timeout). Then the job is restarted with ``--resume`` on
3 ranks: it continues from the newest complete checkpoint, and its losses (and gradient norms,
learning rates, global batches) equal the uninterrupted run's for every step after it.

``BYTESCALE_FAULT_SEED`` changes the seed (which rank dies, at which step; the wall-clock delay).
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from train_launch import REPO, jsonl

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD = 3
STEPS = 6
PG_TIMEOUT_S = 5
MARGIN_S = 25.0  # a survivor's teardown and interpreter exit on a loaded 2-core machine
JOB_TIMEOUT_S = 150.0  # hard limit of one job: stragglers are killed and the test fails
SEED = int(os.environ.get("BYTESCALE_FAULT_SEED", "1"))
CHILD = Path(__file__).resolve().parent / "fault_inject.py"
TRAIN = ["--data", "synthetic:byted", "--synthetic-docs", "200", "--synthetic-scale", "0.01",
         "--model", "mixtral-tiny", "--capacity", "128", "--tokens-per-batch", "768", "--steps", STEPS,
         "--warmup-steps", "2", "--progress=false", "--save-every", "2", "--keep", "0"]
POINTS = ["ring", "grad_sync", "fingerprint", "dyn_group", "wallclock"]
# what a survivor's error must say: the failed operation, a peer or the timeout
CLEAR = ("timed out", "timeout", "peer", "rank", "connection", "closed", "all_reduce", "allreduce",
         "ring", "exchange", "recv", "send", "broadcast", "gather")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Rank:
    proc: subprocess.Popen
    out: Path
    exit_time: Optional[float] = None

    def log(self) -> str:
        return self.out.read_text(errors="replace")[-5000:] if self.out.exists() else ""


def _job(d: Path, name: str, args: List, point: str = "none", victim: int = -1, at_step: int = 0,
         kill_after_step: Optional[int] = None, kill_delay: float = 0.0) -> Dict:
    """Run one job of WORLD ranks; returns {ranks, death (victim's death time), reports}."""
    report = d / f"{name}.report"
    spec = json.dumps({"point": "none" if point == "wallclock" else point, "rank": victim, "step": at_step,
                       "report": str(report)})
    port = _port()
    ranks = []
    for r in range(WORLD):
        env = dict(os.environ)
        env.update(RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   BYTESCALE_TRAIN_TIMEOUT_S=str(PG_TIMEOUT_S),
                   PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
        out = d / f"{name}.rank{r}.log"
        with open(out, "w") as f:
            p = subprocess.Popen([sys.executable, str(CHILD), spec, *map(str, args)], stdout=f,
                                 stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True)
        ranks.append(Rank(p, out))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    metrics = Path(args[args.index("--metrics") + 1])
    kill_at = None
    try:
        while any(r.exit_time is None for r in ranks):
            now = time.monotonic()
            for r in ranks:
                if r.exit_time is None and r.proc.poll() is not None:
                    r.exit_time = time.time()
            if kill_after_step is not None and kill_at is None and metrics.exists():
                if len(metrics.read_text().splitlines()) > kill_after_step:
                    kill_at = now + kill_delay
            if kill_at is not None and now >= kill_at and ranks[victim].exit_time is None:
                ranks[victim].proc.send_signal(signal.SIGKILL)
                kill_at = math.inf
            if now > deadline:
                live = [i for i, r in enumerate(ranks) if r.exit_time is None]
                logs = "\n".join(f"--- rank {i}\n{ranks[i].log()}" for i in range(WORLD))
                raise AssertionError(f"{name}: ranks {live} still running {JOB_TIMEOUT_S:.0f} s after the start "
                                     f"(a hang)\n{logs}")
            time.sleep(0.05)
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
    reports = {}
    for r in range(WORLD):
        f = Path(f"{report}.{r}")
        reports[r] = json.loads(f.read_text()) if f.exists() else None
    return {"ranks": ranks, "reports": reports}


def _args(d: Path, name: str, *extra) -> List:
    return TRAIN + ["--metrics", d / f"{name}.jsonl", "--samples-log", d / f"{name}.samples.jsonl", *extra]


def _ok(job: Dict, name: str) -> None:
    for i, r in enumerate(job["ranks"]):
        assert r.proc.returncode == 0, f"{name}: rank {i} exited with {r.proc.returncode}\n{r.log()}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    d = tmp_path_factory.mktemp("faults")
    job = _job(d, "ref", _args(d, "ref", "--checkpoint-dir", d / "ck-ref"))
    _ok(job, "ref")
    m = jsonl(d / "ref.jsonl")
    assert [r["step"] for r in m] == list(range(STEPS))
    # the cases need a ring at every step >= 4 (ring attention and the MoE counts' dynamic group)
    assert all(r["ring_sizes"] for r in m[4:]), [r["ring_sizes"] for r in m]
    return {"dir": d, "metrics": m, "samples": jsonl(d / "ref.samples.jsonl")}


@pytest.mark.parametrize("point", POINTS)
def test_rank_killed_survivors_fail_clearly_and_the_job_resumes(reference, point):
    d = reference["dir"]
    rng = random.Random(f"{SEED}-{point}")
    victim = rng.randrange(WORLD)
    at_step = rng.choice([4, 5])
    name = f"{point}-s{SEED}"
    ck = d / f"ck-{name}"
    wall = point == "wallclock"
    job = _job(d, name, _args(d, name, "--checkpoint-dir", ck), point=point, victim=victim, at_step=at_step,
               kill_after_step=3 if wall else None, kill_delay=rng.uniform(0.0, 0.6))
    ranks, reports = job["ranks"], job["reports"]
    what = f"{name}: rank {victim} killed at {point} (step >= {at_step})"
    logs = "\n".join(f"--- rank {i} (exit {r.proc.returncode})\n{r.log()}" for i, r in enumerate(ranks))
    assert ranks[victim].proc.returncode == -signal.SIGKILL, f"{what}: the kill point was not reached\n{logs}"
    death = ranks[victim].exit_time
    for i, r in enumerate(ranks):
        if i == victim:
            continue
        rc = r.proc.returncode
        assert rc == 1, f"{what}: survivor rank {i} exited with {rc} (expected 1: a Python exception)\n{logs}"
        rep = reports[i]
        assert rep is not None and rep["type"] is not None, f"{what}: rank {i} left no error report\n{logs}"
        msg = f"{rep['type']}: {rep['message']}"
        assert rep["type"] in ("RuntimeError", "DistBackendError", "DistError", "DistNetworkError",
                               "DistStoreError", "CheckpointError"), f"{what}: rank {i} raised {msg}\n{logs}"
        assert any(w in rep["message"].lower() for w in CLEAR), f"{what}: rank {i}'s error is unclear: {msg}"
        took = r.exit_time - death
        assert took <= PG_TIMEOUT_S + MARGIN_S, f"{what}: rank {i} took {took:.1f} s to fail: {msg}\n{logs}"
        where = [ln.strip() for ln in rep["traceback"].splitlines() if ln.strip().startswith("File ")][-3:]
        print(f"{what}: rank {i} failed after {took:.1f} s (raised {rep['time'] - death:.1f} s after the "
              f"death): {msg[:300]}\n    at {where}")
    # restart from the newest complete checkpoint: the rest of the uninterrupted run's curve
    resumed = f"{name}-resumed"
    job = _job(d, resumed, _args(d, resumed, "--checkpoint-dir", ck, "--resume"))
    _ok(job, resumed)
    got = jsonl(d / f"{resumed}.jsonl")
    first = got[0]["step"] if got else STEPS
    assert first >= 2 or wall, f"{what}: no checkpoint to resume from (resumed at step {first})"
    assert [r["step"] for r in got] == list(range(first, STEPS))
    for r in got:
        a = reference["metrics"][r["step"]]
        assert math.isclose(r["loss"], a["loss"], rel_tol=1e-5), (r["step"], r["loss"], a["loss"])
        assert math.isclose(r["grad_norm"], a["grad_norm"], rel_tol=1e-4), (r["step"], r["grad_norm"], a["grad_norm"])
        assert math.isclose(r["lr"], a["lr"], rel_tol=1e-12)
    assert jsonl(d / f"{resumed}.samples.jsonl") == reference["samples"][first:]
    print(f"{what}: resumed at step {first}, losses equal the uninterrupted run's")
