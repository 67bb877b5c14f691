"""The operations Gloo has beyond the plain collectives, on the bytescale backend, multi-process:
all_gather_coalesced, recv from any source, monitored_barrier, sparse all_reduce, sequence numbers
(all_gather_object on subgroups), each against an independent reference (what every rank holds,
computed locally; dense float64 sums for sparse tensors)."""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import bytescale
from dist_utils import capture_error as _capture, run_distributed


def _sparse(rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    dense = torch.randn(7, 3, generator=g, dtype=torch.float64)
    dense[torch.rand(7, generator=g) < 0.5] = 0  # rows absent on some ranks
    return dense.to_sparse(1)  # 1 sparse dim, 1 dense dim (values are rows)


def _parity(rank: int, world: int):
    out = {}
    # all_gather_coalesced: outputs[j][k] gets rank j's inputs[k], tensors of different shapes.
    inputs = [torch.full((k + 1, 2), float(rank * 10 + k)) for k in range(3)]
    outputs = [[torch.empty(k + 1, 2) for k in range(3)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    out["coalesced"] = all(
        torch.equal(outputs[j][k], torch.full((k + 1, 2), float(j * 10 + k)))
        for j in range(world) for k in range(3)
    )
    # sparse all_reduce: the coalesced sum, equal to the dense float64 sum.
    t = _sparse(rank, 1)
    dist.all_reduce(t)
    ref = sum(_sparse(r, 1).to_dense() for r in range(world))
    out["sparse_is_sparse"] = t.is_sparse and t.is_coalesced()
    out["sparse_err"] = (t.to_dense() - ref).abs().max().item()
    # recv from any source: rank 0 receives one message from every other rank, in any order.
    if rank == 0:
        seen = {}
        for _ in range(world - 1):
            buf = torch.empty(2)
            src = dist.recv(buf)
            seen[src] = buf.tolist()
        out["anysource"] = seen
    else:
        time.sleep(0.05 * (world - rank))  # vary the arrival order
        dist.send(torch.full((2,), float(rank)), dst=0)
    # monitored_barrier: everyone arrives (both modes), on the world and on a subgroup.
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    sub = dist.new_group(list(range(world)))
    dist.monitored_barrier(sub, timeout=datetime.timedelta(seconds=30))
    # sequence numbers: equal on every member, one more per collective.
    seq0 = sub._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(1), group=sub)
    out["seq_step"] = sub._get_sequence_number_for_group() - seq0
    seqs = [None] * world
    dist.all_gather_object(seqs, (sub._get_sequence_number_for_group(),
                                  dist.group.WORLD._get_sequence_number_for_group()))
    out["seq_agree"] = len(set(seqs)) == 1
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank}, group=sub)
    out["objects"] = [o["rank"] for o in objs]
    # the name c10d reports (DDP's logging data "backend_name"), not "custom"
    out["names"] = (dist.group.WORLD.name(), sub.name(), bytescale.dynamic_group([0]).name())
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_gloo_parity_ops_match_references(world):
    for rank, out in enumerate(run_distributed(_parity, world)):
        assert out["coalesced"], rank
        assert out["sparse_is_sparse"] and out["sparse_err"] < 1e-12, out
        if rank == 0:
            assert out["anysource"] == {r: [float(r)] * 2 for r in range(1, world)}, out
        assert out["seq_step"] == 1 and out["seq_agree"], out
        assert out["objects"] == list(range(world))
        assert out["names"] == ("bytescale",) * 3, out["names"]


def _recv_from_any_source_work(rank: int, world: int):
    if rank == 0:
        buf = torch.empty(3)
        work = dist.irecv(buf)  # src=None: from any rank
        work.wait()
        return work._source_rank(), buf.tolist()
    if rank == 2:
        dist.send(torch.arange(3.0), dst=0, tag=0)
    return None


def test_irecv_from_any_source_names_the_sender():
    res = run_distributed(_recv_from_any_source_work, 3)
    assert res[0] == (2, [0.0, 1.0, 2.0])


def _monitored_failures(rank: int, world: int):
    out = {}
    t = datetime.timedelta(seconds=1)
    # rank 1 does not arrive: rank 0 names it; rank 2 learns that rank 0 failed.
    if rank != 1:
        out["first"] = _capture(lambda: dist.monitored_barrier(timeout=t))
    # ranks 1 and 2 do not arrive: with wait_all_ranks rank 0 names both.
    if rank == 0:
        out["all"] = _capture(lambda: dist.monitored_barrier(timeout=t, wait_all_ranks=True))
        out["zero"] = _capture(
            lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=0)))
    # a dynamic group [2, 0]: its first member (rank 2) reports rank 0.
    g = bytescale.dynamic_group([2, 0])
    if rank == 2:
        out["group"] = _capture(lambda: dist.monitored_barrier(g, timeout=t))
    return out


def test_monitored_barrier_names_the_ranks_that_did_not_arrive():
    res = run_distributed(_monitored_failures, 3, pg_timeout=6.0, timeout=120)
    kind, msg, took = res[0]["first"]
    assert "Rank 1 failed to pass monitoredBarrier in 1000 ms" in msg and took < 5, (msg, took)
    kind, msg, took = res[0]["all"]
    assert "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms" in msg and took < 5, (msg, took)
    kind, msg, _ = res[0]["zero"]
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in msg, msg
    # rank 2 arrived, rank 0 never released it: an error naming rank 0, after the group timeout.
    kind, msg, took = res[2]["first"]
    assert kind == "DistBackendError" and "Rank 2 successfully reached monitoredBarrier" in msg, msg
    assert "from rank 0" in msg and took < 30, (msg, took)
    kind, msg, took = res[2]["group"]
    assert "Rank 0 failed to pass monitoredBarrier" in msg and "dynamic group [2, 0]" in msg, msg


def _sparse_errors(rank: int, world: int):
    out = {}
    out["max"] = _capture(lambda: dist.all_reduce(_sparse(rank, 2), op=dist.ReduceOp.MAX))
    shape = torch.zeros(4 + rank, 3).to_sparse()
    out["shape"] = _capture(lambda: dist.all_reduce(shape))
    g = bytescale.dynamic_group(list(range(world)))
    out["anysource_group"] = _capture(lambda: dist.recv(torch.empty(2), group=g))
    t = _sparse(rank, 3)
    dist.all_reduce(t, group=g)  # still usable, on a dynamic group too
    out["after"] = (t.to_dense() - sum(_sparse(r, 3).to_dense() for r in range(world))).abs().max().item()
    return out


def test_sparse_all_reduce_and_anysource_errors_are_clear():
    for out in run_distributed(_sparse_errors, 3):
        assert "only ReduceOp.SUM" in out["max"][1], out["max"]
        assert "disagree on the sparse tensor" in out["shape"][1], out["shape"]
        assert "world group only" in out["anysource_group"][1], out["anysource_group"]
        assert out["after"] < 1e-12
