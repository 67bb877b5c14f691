"""Faults under load: one rank of a real HDP training job dies (or hangs); the others fail with a
clear error in time, never hang, never die by a signal; the job restarts from its last checkpoint on
the uninterrupted run's losses.

A job is ``python -m bytescale.train``'s ``main`` in WORLD real processes (env:// rendezvous, the
``bytescale`` backend over Gloo, process-group timeout ``BYTESCALE_TRAIN_TIMEOUT_S`` =
PG_TIMEOUT_S) training the package's MoE Llama (``mixtral-tiny``: every step has ring
micro-batches, and each ring all-reduces the MoE balance loss' expert counts over its dynamic
group) on a synthetic corpus, with async DCP checkpoints after every step. A chain of jobs shares
one checkpoint directory, as a flaky job restarted again and again would: each job resumes from
the newest complete checkpoint (``--resume``) and one rank (chosen by the seed) is stopped
(tests/train/fault_inject.py) when it enters, 2 or 3 steps after the resume point:

  ring         the ring-attention op of a sharded micro-batch (its ring peers are in the exchange)
  grad_sync    a gradient bucket's all-reduce (HybridDataParallel; a 2-rank job: one survivor)
  dyn_group    a dynamic group's all-reduce (the MoE counts of a sharded document)
  fingerprint  the loader's per-step plan fingerprint all-reduce (2 ranks)
  ring_bwd     the ring's backward (dK/dV exchange), with SIGSTOP: the rank freezes with its
               sockets open, so the survivors can only time out
  checkpoint   the start of a checkpoint save, with SIGSTOP (2 ranks): the survivors' background
               writers wait in DCP's collectives on their Gloo group (Gloo's default: 30 min)
  wallclock    anywhere: the parent SIGKILLs it at a random time after the job's second step

Per stage: the victim died (or froze) at its point; every survivor exits by a Python exception
(status 1, not a signal) within PG_TIMEOUT_S + MARGIN_S of the fault, its error is a RuntimeError
naming the bytescale op, the group and the peer (or the timeout), and every step the job logged
equals the uninterrupted run (loss, gradient norm, LR, global batch). A last job resumes and runs
to the end on the same curve. ``BYTESCALE_FAULT_SEED`` changes the seed (victims, steps, delays).
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from train_launch import REPO, jsonl

pytestmark = [pytest.mark.multiprocess]

STEPS = 18  # each faulty job progresses by at most 2 checkpoints (the wall-clock one, last, a little more)
PG_TIMEOUT_S = 5
MARGIN_S = 20.0  # the survivor's teardown and interpreter exit on a loaded 2-core machine
JOB_TIMEOUT_S = 120.0  # hard limit of one job; stragglers are SIGKILLed and the stage fails
SEED = int(os.environ.get("BYTESCALE_FAULT_SEED", "1"))
TRAIN = ["--data", "synthetic:byted", "--synthetic-docs", "200", "--synthetic-scale", "0.01",
         "--model", "mixtral-tiny", "--capacity", "128", "--tokens-per-batch", "768", "--steps", STEPS,
         "--warmup-steps", "2", "--progress=false"]
CKPT = ["--save-every", "1", "--keep", "2", "--resume"]  # the faulty jobs: a checkpoint after every step
# (point, world size, signal)
STAGES = [("ring", 3, "SIGKILL"), ("grad_sync", 2, "SIGKILL"), ("dyn_group", 3, "SIGKILL"),
          ("fingerprint", 2, "SIGKILL"), ("ring_bwd", 3, "SIGSTOP"), ("checkpoint", 2, "SIGSTOP"),
          ("wallclock", 3, "SIGKILL")]
# a survivor's error: "bytescale <op> on <group> [ranks] ...", naming a peer rank or the timeout
CLEAR = re.compile(r"bytescale [\w ]+ on (world group|dynamic group|group|ring) \[[\d, ]+\]|"
                   r"checkpoint step-\d+: the background save into .* failed")
PEER = re.compile(r"rank \d+|peer|timed out|timeout", re.I)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(d: Path, name: str, world: int, args: List, point: str = "none", victim: int = -1,
         at_step: int = 0, sig: str = "SIGKILL", kill_after_lines: Optional[int] = None,
         kill_delay: float = 0.0) -> Dict:
    """Run one job; returns {procs, exits (wall time of each exit), fault (time of the fault), reports, logs}."""
    report = d / f"{name}.report"
    hook = "none" if point == "wallclock" else point
    spec = json.dumps({"point": hook, "rank": victim, "step": at_step, "signal": sig, "report": str(report)})
    port, procs, logs = _port(), [], []
    for r in range(world):
        env = dict(os.environ)
        env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   BYTESCALE_TRAIN_TIMEOUT_S=str(PG_TIMEOUT_S),
                   PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
        logs.append(d / f"{name}.rank{r}.log")
        procs.append(_Rank(spec, [str(a) for a in args], env, str(logs[-1])))
    metrics = Path(args[args.index("--metrics") + 1])
    exits: List[Optional[float]] = [None] * world
    fault = kill_at = None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while any(e is None for e in exits):
            now = time.monotonic()
            for r, p in enumerate(procs):
                if exits[r] is None and p.poll() is not None:
                    exits[r] = time.time()
            if fault is None and victim >= 0 and (exits[victim] is not None or _stopped(procs[victim].pid)):
                fault = exits[victim] or time.time()  # died (or froze) at its point
                deadline = min(deadline, now + PG_TIMEOUT_S + MARGIN_S + 5)  # then stragglers are hangs
            if kill_after_lines is not None and kill_at is None and metrics.exists() \
                    and len(metrics.read_text().splitlines()) >= kill_after_lines:
                kill_at = now + kill_delay
            if kill_at is not None and now >= kill_at and exits[victim] is None:
                procs[victim].send_signal(signal.SIGKILL)
                kill_at = math.inf
            if sig == "SIGSTOP" and fault is not None and all(e is not None for i, e in enumerate(exits) if i != victim):
                procs[victim].send_signal(signal.SIGKILL)  # the survivors are out: end the frozen rank
            if now > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    reports = []
    for r in range(world):
        f = Path(f"{report}.{r}")
        reports.append(json.loads(f.read_text()) if f.exists() else None)
    return {"procs": procs, "exits": exits, "fault": fault, "reports": reports,
            "logs": [p.read_text(errors="replace") if p.exists() else "" for p in logs]}


class _Rank:
    """One rank's process: :func:`fault_inject.forked` in a process forked from the harness'
    forkserver (torch already imported), its own session; the ``subprocess.Popen`` calls used here."""

    def __init__(self, spec: str, argv: List[str], env: Dict[str, str], log: str):
        import fault_inject
        from dist_utils import start_context

        self.proc = start_context().Process(target=fault_inject.forked, args=(spec, argv, env, log))
        self.proc.start()
        self.pid = self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.exitcode

    def poll(self) -> Optional[int]:
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        self.proc.join()
        return self.proc.exitcode


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _logs(job: Dict) -> str:
    return "\n".join(f"--- rank {i} (exit {p.returncode})\n{job['logs'][i][-4000:]}" for i, p in enumerate(job["procs"]))


def _args(d: Path, name: str, *extra) -> List:
    return TRAIN + ["--metrics", d / f"{name}.jsonl", "--samples-log", d / f"{name}.samples.jsonl", *extra]


def _newest(ck: Path) -> int:
    from bytescale.train.checkpoint import list_checkpoints

    found = list_checkpoints(str(ck))
    return found[-1][0] if found else 0


def _same_curve(ref: Dict, d: Path, name: str) -> List[int]:
    """Every step the job logged equals the uninterrupted run; returns the steps."""
    got = jsonl(d / f"{name}.jsonl") if (d / f"{name}.jsonl").exists() else []
    samples = jsonl(d / f"{name}.samples.jsonl") if (d / f"{name}.samples.jsonl").exists() else []
    for r in got:
        a = ref["metrics"][r["step"]]
        assert math.isclose(r["loss"], a["loss"], rel_tol=1e-5), (name, r["step"], r["loss"], a["loss"])
        assert math.isclose(r["grad_norm"], a["grad_norm"], rel_tol=1e-4), (name, r["step"], r["grad_norm"], a["grad_norm"])
        assert math.isclose(r["lr"], a["lr"], rel_tol=1e-12), (name, r["step"])
    for s in samples:
        assert s == ref["samples"][s["step"]], (name, s["step"])
    return [r["step"] for r in got]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The uninterrupted run, then the chain of faulty jobs and the final resumed one."""
    d = tmp_path_factory.mktemp("faults")
    t0 = time.monotonic()
    ref = _job(d, "ref", 3, _args(d, "ref"))
    for i, p in enumerate(ref["procs"]):
        assert p.returncode == 0, f"the uninterrupted run: rank {i} exited with {p.returncode}\n{_logs(ref)}"
    m = jsonl(d / "ref.jsonl")
    assert [r["step"] for r in m] == list(range(STEPS))
    assert all(r["ring_sizes"] for r in m), [r["ring_sizes"] for r in m]  # the ring points are reached
    out = {"dir": d, "ref": {"metrics": m, "samples": jsonl(d / "ref.samples.jsonl")}, "stages": {}}
    ck = d / "ck"
    rng = random.Random(SEED)
    timing = [f"uninterrupted run {time.monotonic() - t0:.1f} s"]
    for point, world, sig in STAGES:
        t1 = time.monotonic()
        start = _newest(ck)
        at = start + rng.choice([2, 3])
        victim = rng.randrange(world)
        delay = rng.uniform(0.0, 0.5)
        name = f"{point}-s{SEED}"
        job = _job(d, name, world, _args(d, name, "--checkpoint-dir", ck, *CKPT), point=point, victim=victim,
                   at_step=at, sig=sig, kill_after_lines=2 if point == "wallclock" else None, kill_delay=delay)
        job.update(name=name, start=start, at=at, victim=victim, world=world, sig=sig)
        out["stages"][point] = job
        timing.append(f"{name} {time.monotonic() - t1:.1f} s")
    t1 = time.monotonic()
    start = _newest(ck)
    final = _job(d, f"final-s{SEED}", 3, _args(d, f"final-s{SEED}", "--checkpoint-dir", ck, *CKPT))
    final.update(name=f"final-s{SEED}", start=start)
    out["final"] = final
    timing.append(f"final {time.monotonic() - t1:.1f} s")
    print("\n" + ", ".join(timing))
    return out


@pytest.mark.parametrize("point", [s[0] for s in STAGES])
def test_survivors_fail_clearly_in_time_and_the_job_resumes(chain, point):
    """Slow: (the first stage) the module's chain fixture runs the uninterrupted reference job and
    every faulty job, real torchrun-style processes with process-group timeouts, before any stage
    is checked."""
    job = chain["stages"][point]
    procs, victim, name = job["procs"], job["victim"], job["name"]
    what = (f"{name}: rank {victim} of {job['world']} {'frozen' if job['sig'] == 'SIGSTOP' else 'killed'} at "
            f"{point} (resumed at step {job['start']}, fault at step >= {job['at']})")
    assert job["fault"] is not None, f"{what}: the fault point was not reached\n{_logs(job)}"
    if job["sig"] == "SIGKILL":
        assert procs[victim].returncode == -signal.SIGKILL, f"{what}: victim exit {procs[victim].returncode}"
    for i, p in enumerate(procs):
        if i == victim:
            continue
        assert job["exits"][i] is not None, (f"{what}: survivor rank {i} still ran {PG_TIMEOUT_S + MARGIN_S:.0f} s "
                                             f"after the fault (a hang); killed\n{_logs(job)}")
        assert p.returncode == 1, f"{what}: survivor rank {i} exited with {p.returncode}, not 1 (a Python exception)\n{_logs(job)}"
        rep = job["reports"][i]
        assert rep is not None and rep["type"] is not None, f"{what}: rank {i} left no error report\n{_logs(job)}"
        msg = f"{rep['type']}: {rep['message']}"
        assert rep["type"] in ("RuntimeError", "DistBackendError", "DistNetworkError"), f"{what}: rank {i}: {msg}"
        assert CLEAR.search(rep["message"]) and PEER.search(rep["message"]), \
            f"{what}: rank {i}'s error does not name the op, group and peer or timeout: {msg}\n{rep['traceback']}"
        took = job["exits"][i] - job["fault"]
        assert took <= PG_TIMEOUT_S + MARGIN_S, f"{what}: rank {i} took {took:.1f} s to fail: {msg}"
        assert f"bytescale.train: rank {i} failed at step" in job["logs"][i] and "--resume" in job["logs"][i]
        if point == "checkpoint":  # its background writer waited on the frozen rank: a timeout, not 30 min
            # Two orders, both within the timeout: the next step's collective times out first and
            # closing the writer then fails too, or the writer's own timeout surfaces first (the
            # next save waits for it) and is the error the rank reports.
            assert ("the checkpoint writer failed while closing after the error" in job["logs"][i]
                    or re.search(r"checkpoint step-\d+: the background save into .* failed", rep["message"])), \
                job["logs"][i][-3000:]
        print(f"{what}: rank {i} raised after {rep['time'] - job['fault']:.1f} s, exited after {took:.1f} s: {msg[:240]}")
    steps = _same_curve(chain["ref"], chain["dir"], name)
    assert steps == list(range(job["start"], job["start"] + len(steps))), steps
    if point == "checkpoint":  # the save after step `at`
        assert all(s <= job["at"] for s in steps), steps
    elif point != "wallclock":  # the fault came in step `at`, before it was logged
        assert all(s < job["at"] for s in steps), steps


def test_the_restarted_job_finishes_on_the_uninterrupted_curve(chain):
    job = chain["final"]
    for i, p in enumerate(job["procs"]):
        assert p.returncode == 0, f"{job['name']}: rank {i} exited with {p.returncode}\n{_logs(job)}"
    steps = _same_curve(chain["ref"], chain["dir"], job["name"])
    assert job["start"] >= len(STAGES) - 1, f"the faulty jobs made no progress (final job resumed at {job['start']})"
    assert steps == list(range(job["start"], STEPS)), steps
