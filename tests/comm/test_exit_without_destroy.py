"""A process that exits without destroy_process_group while operations are in flight never
aborts ("terminate called without an active exception", SIGABRT): the threads that may drop the
last reference to an op's tensors or Work (Gloo's, bytescale's worker and waiters; on CUDA the
NCCL watchdog) hold only Python-free shallow copies (csrc/common/handoff.h), made where the
front end takes the op (csrc/comm/front_end.cpp). Before, 4 of 10 exits aborted on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "exit_worker.py")
RUNS, WORLD = 10, 2  # 20 process exits


@pytest.mark.timeout(600)
def test_exit_without_destroy_never_aborts():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, WORKER, str(RUNS), str(WORLD)], capture_output=True,
                          text=True, env=env, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == RUNS * WORLD, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in rows:  # every rank got as far as the exit
        assert "exiting" in r["out"], r
    bad = [r for r in rows if r["status"] != 0 or "terminate called" in r["err"]]
    assert not bad, f"{len(bad)} of {len(rows)} ranks aborted or hung at exit: {bad[:2]}"
