"""Launchers for the training entry point's tests: real ``torchrun -m bytescale.train`` processes
(or one plain process), a hard timeout, output captured."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[2]


# a short run of the tiny model on the synthetic corpus (the TP and PP entry-point tests)
TINY_RUN = ["--data", "synthetic:byted", "--synthetic-docs", "400", "--synthetic-scale", "0.0005",
            "--capacity", "128", "--tokens-per-batch", "1024", "--warmup-steps", "2", "--lr", "3e-3",
            "--progress=false", "--keep", "0", "--model", "tiny", "--vocab-size", "64"]


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["BYTESCALE_TRAIN_TIMEOUT_S"] = "120"  # a hang fails fast
    return env


def launch(nproc: int, args: Sequence[str], timeout: float = 240.0, cwd: str = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc -m bytescale.train args`` (nproc 0: plain ``python -m``)."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "bytescale.train", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "bytescale.train", *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=cwd or str(REPO), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"{' '.join(res.args)}\nexit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return res


def jsonl(path) -> List[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]



def logged_run(d: Path, name: str, nproc: int, args: Sequence[str], timeout: float = 420.0) -> dict:
    """A successful ``launch`` whose metrics and samples go to ``d/name.jsonl`` and
    ``d/name.samples.jsonl``: returns them (parsed) and the run's stdout."""
    res = ok(launch(nproc, list(args) + ["--metrics", d / f"{name}.jsonl", "--samples-log",
                                         d / f"{name}.samples.jsonl"], timeout=timeout))
    return {"metrics": jsonl(d / f"{name}.jsonl"), "samples": jsonl(d / f"{name}.samples.jsonl"), "out": res.stdout}


def assert_same_steps(ref: dict, got: dict, steps, loss_rtol: float = 1e-5, norm_rtol: float = 1e-4) -> None:
    """``got`` (a :func:`logged_run`) ran exactly ``steps``, each on ``ref``'s global batch with
    ``ref``'s loss and gradient norm (float32 tolerances)."""
    import math

    assert [r["step"] for r in got["metrics"]] == list(steps)
    for r in got["metrics"]:
        a = ref["metrics"][r["step"]]
        assert math.isclose(r["loss"], a["loss"], rel_tol=loss_rtol), (r["step"], r["loss"], a["loss"])
        assert math.isclose(r["grad_norm"], a["grad_norm"], rel_tol=norm_rtol), (r["step"], r["grad_norm"],
                                                                                  a["grad_norm"])
    assert got["samples"] == [s for s in ref["samples"] if s["step"] in steps]
