"""The multi-process harness itself (tests/dist_utils.py): pooled worlds are reused, a body finds the
process as a new one would, and a world broken by one test (a rank that raised, died or hung) never
serves the next one, which gives its own verdict."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dist_utils
from dist_utils import run_distributed

WORLD = 3


def _identity(rank: int, world_size: int) -> dict:
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return {"pid": os.getpid(), "sum": float(t), "dtype": str(torch.get_default_dtype()),
            "knob": os.environ.get("BYTESCALE_HARNESS_PROBE"), "grad": torch.is_grad_enabled(),
            "rand": float(torch.rand(1)), "backend": dist.get_backend()}


def _dirty(rank: int, world_size: int) -> int:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["BYTESCALE_HARNESS_PROBE"] = "left behind"
    torch.manual_seed(1234 + rank)
    return os.getpid()


def _raise_on_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    t = torch.ones(1)
    dist.all_reduce(t)  # the others block here: the harness must end them


def _die_on_2(rank: int, world_size: int) -> None:
    if rank == 2:
        os._exit(3)
    dist.barrier()


def _hang_on_0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(120)


def _pids() -> set:
    return {pid for size, pids in dist_utils.pooled_worlds() if size == WORLD for pid in pids}


@pytest.mark.skipif(os.environ.get("BYTESCALE_TEST_POOL") == "0", reason="pooling is off (BYTESCALE_TEST_POOL=0)")
def test_a_world_is_reused_and_each_body_finds_a_new_process_state():
    first = run_distributed(_identity, WORLD)
    assert [r["sum"] for r in first] == [6.0] * WORLD
    pids = {r["pid"] for r in first}
    assert pids <= _pids()
    run_distributed(_dirty, WORLD)
    again = run_distributed(_identity, WORLD)
    assert {r["pid"] for r in again} == pids  # the same processes...
    for a, b in zip(first, again):  # ...restored as new ones
        assert b["dtype"] == "torch.float32" and b["knob"] is None and b["grad"] is True
        assert b["rand"] == a["rand"]  # the default generator starts where a new process's does
        assert b["backend"] == "bytescale"


@pytest.mark.parametrize("breaker, error", [(_raise_on_1, mp.ProcessRaisedException),
                                            (_die_on_2, mp.ProcessExitedException),
                                            (_hang_on_0, TimeoutError)],
                         ids=["raises", "dies", "hangs"])
def test_a_broken_world_never_serves_the_next_test(breaker, error):
    before = run_distributed(_identity, WORLD)
    t0 = time.monotonic()
    with pytest.raises(error) as info:
        run_distributed(breaker, WORLD, timeout=8 if dist_utils._pooling() else 60)  # a warm world starts at once
    assert time.monotonic() - t0 < 90  # the others were ended, not waited for (the hang: its limit)
    if error is mp.ProcessRaisedException:
        assert "rank 1 refuses" in str(info.value) and "Process 1" in str(info.value)
    if error is mp.ProcessExitedException:
        assert "exit code 3" in str(info.value)
    after = run_distributed(_identity, WORLD)  # its own verdict: a new, healthy world
    assert [r["sum"] for r in after] == [6.0] * WORLD
    assert not {r["pid"] for r in after} & {r["pid"] for r in before}

