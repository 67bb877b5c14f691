"""Launchers for the training entry point's tests: ``bytescale.train``'s ``main`` in a world of real
processes (env:// rendezvous as under torchrun), or under ``torchrun`` itself; a hard timeout, output
captured.

The resume tests' uninterrupted run goes through ``torchrun -m bytescale.train`` (``torchrun=True``),
the entry point as users start it (tests/comm/test_init_modes.py and the SFT example's test run
torchrun too). The other runs call ``main`` in ranks forked from the test harness' forkserver
(torch already imported: tests/dist_utils.py), with the environment torchrun would set
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the same code path from
``init_process_group`` on, without paying an interpreter and a torch import per rank and run.
"""
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main_in_rank(rank: int, world: int, nproc: int, argv: List[str], port: int, out_dir: str, cwd: str) -> int:
    """One rank of a world run: torchrun's environment, stdout/stderr to files, ``main``'s status."""
    os.chdir(cwd)
    os.environ.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), BYTESCALE_TRAIN_TIMEOUT_S="120")
    if nproc:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = os.open(os.path.join(out_dir, f"out.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(os.path.join(out_dir, f"err.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    from bytescale.train.__main__ import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse (--help, a bad option)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback on stderr, status 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _world_launch(nproc: int, args: Sequence[str], timeout: float, cwd: str) -> subprocess.CompletedProcess:
    import tempfile

    from dist_utils import run_distributed

    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="bytescale-train-") as out_dir:
        codes = run_distributed(_main_in_rank, max(nproc, 1), nproc, argv, _free_port(), out_dir, cwd,
                                init=False, fresh=True, timeout=timeout)
        read = lambda name: "".join(Path(out_dir, f"{name}.{r}").read_text(errors="replace")  # noqa: E731
                                    for r in range(max(nproc, 1)))
        stdout, stderr = read("out"), read("err")
    code = next((c for c in codes if c), 0)
    return subprocess.CompletedProcess(["bytescale.train (world of %d)" % max(nproc, 1), *argv], code, stdout, stderr)


def launch(nproc: int, args: Sequence[str], timeout: float = 240.0, cwd: str = None,
           torchrun: bool = False) -> subprocess.CompletedProcess:
    """``bytescale.train``'s ``main`` with ``args`` on ``nproc`` ranks (0: one process without
    torchrun's environment, as ``python -m bytescale.train``); ``torchrun=True``: the real
    ``torchrun --nproc_per_node nproc -m bytescale.train args`` (``python -m`` for 0)."""
    if not torchrun:
        return _world_launch(nproc, args, timeout, cwd or str(REPO))
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



def logged_run(d: Path, name: str, nproc: int, args: Sequence[str], timeout: float = 420.0,
               torchrun: bool = False) -> dict:
    """A successful ``launch`` whose metrics and samples go to ``d/name.jsonl`` and
    ``d/name.samples.jsonl``: returns them (parsed) and the run's stdout."""
    res = ok(launch(nproc, list(args) + ["--metrics", d / f"{name}.jsonl", "--samples-log",
                                         d / f"{name}.samples.jsonl"], timeout=timeout, torchrun=torchrun))
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
