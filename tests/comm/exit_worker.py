"""Jobs that exit WITHOUT destroy_process_group while operations are in flight
(tests/comm/test_exit_without_destroy.py runs it).

`python exit_worker.py RUNS WORLD` imports torch and bytescale once, then for each run forks WORLD
processes (a fresh FileStore each run); every rank issues world and dynamic-group collectives,
posted sends and receives and one receive that never matches, drops some Work handles, keeps
others, and leaves the interpreter (a real finalization: SystemExit from the top) while
bytescale's and Gloo's threads still hold the ops' tensors. Prints one JSON line per rank:
run, rank, exit status (negative: killed by that signal), and its stderr's tail."""
from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import bytescale


def rank_main(store_path: str, rank: int, world: int, seed: int) -> None:
    dist.init_process_group("bytescale", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    rng = random.Random(seed * 31 + rank)
    peer, src = (rank + 1) % world, (rank - 1) % world
    group = bytescale.dynamic_group(list(range(world))[::-1], cache=False)
    works = []
    for _ in range(3):
        works.append(dist.all_reduce(torch.randn(1 << 16), async_op=True))
        works.append(dist.all_reduce(torch.randn(1 << 15), group=group, async_op=True))
        works.append(dist.isend(torch.randn(1 << 14), peer))
        works.append(dist.irecv(torch.empty(1 << 14), src))
        if rng.random() < 0.5:
            works[-1].wait()
    if rank == 0:
        works.append(dist.irecv(torch.empty(8), src, tag=7))  # never sent: in flight at exit
    time.sleep(rng.random() * 0.05)
    keep = works[::2]  # the others' last references go now, the kept ones at finalization
    del works
    print(f"rank {rank}: exiting with {len(keep)} works held", flush=True)
    # no destroy_process_group


def _run(seed: int, world: int, tmp: str, limit_s: float) -> list:
    store = os.path.join(tmp, f"store{seed}")
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the rank: its own output files, then a real interpreter exit
            for fd, name in ((1, "out"), (2, "err")):
                f = os.open(os.path.join(tmp, f"{name}{seed}_{rank}"), os.O_WRONLY | os.O_CREAT, 0o600)
                os.dup2(f, fd)
            rank_main(store, rank, world, seed)
            raise SystemExit(0)
        pids.append(pid)
    out, deadline = [], time.monotonic() + limit_s
    for rank, pid in enumerate(pids):
        status = None
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
            elif time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                status = "hung"
            else:
                time.sleep(0.02)
        read = lambda name: open(os.path.join(tmp, f"{name}{seed}_{rank}")).read()
        out.append({"run": seed, "rank": rank, "status": status, "out": read("out")[-200:],
                    "err": read("err")[-1500:]})
    return out


if __name__ == "__main__":
    runs, world = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    # not a `with` block: a forked rank unwinds through this code on its way out
    tmp = tempfile.mkdtemp(prefix="bytescale-exit-")
    parent = os.getpid()
    for seed in range(runs):
        for row in _run(seed, world, tmp, 60.0):
            print(json.dumps(row), flush=True)
    if os.getpid() == parent:
        shutil.rmtree(tmp, ignore_errors=True)
