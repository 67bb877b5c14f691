"""Every collective of the bytescale world backend against the same collective on torch's gloo.

Both backends live in the same processes: the default group is ``bytescale`` and a ``gloo`` group
over all ranks gives the reference. World sizes 1, 2, 3, 5; odd sizes; several dtypes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

SHAPES = [(1,), (7,), (3, 5), (1031,), (33, 17)]
DTYPES = [torch.float32, torch.float64, torch.int64]


def _data(rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17 * salt + 3)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype.is_floating_point:
        # Gloo and bytescale may sum in different orders.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)
    else:
        assert torch.equal(a, b), what


def _collectives(rank: int, world: int):
    ref = dist.new_group(list(range(world)), backend="gloo")
    checks = 0
    for salt, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in DTYPES):
        x = _data(rank, shape, dtype, salt)
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT]
        for op in ops:
            if op == dist.ReduceOp.PRODUCT and dtype.is_floating_point is False:
                continue
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=op)
            dist.all_reduce(b, op=op, group=ref)
            _assert_same(a, b, f"all_reduce {op} {shape} {dtype}")
            checks += 1
        if dtype.is_floating_point:
            # AVG: gloo has none; reference is SUM / world.
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=dist.ReduceOp.AVG)
            dist.all_reduce(b, group=ref)
            _assert_same(a, b / world, f"all_reduce AVG {shape} {dtype}")
            checks += 1
        # broadcast from every root
        for root in range(world):
            a, b = x.clone(), x.clone()
            dist.broadcast(a, src=root)
            dist.broadcast(b, src=root, group=ref)
            _assert_same(a, b, f"broadcast root {root}")
            checks += 1
        # all_gather (list) and into one tensor
        outs_a = [torch.empty_like(x) for _ in range(world)]
        outs_b = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs_a, x)
        dist.all_gather(outs_b, x, group=ref)
        for j in range(world):
            _assert_same(outs_a[j], outs_b[j], "all_gather")
        flat = torch.empty((world * x.numel(),), dtype=dtype)
        dist.all_gather_into_tensor(flat, x.reshape(-1))
        _assert_same(flat, torch.cat([o.reshape(-1) for o in outs_b]), "all_gather_into_tensor")
        checks += 2
        # reduce_scatter_tensor: input is world blocks
        big = _data(rank, (world * x.numel(),), dtype, salt + 99)
        out = torch.empty((x.numel(),), dtype=dtype)
        dist.reduce_scatter_tensor(out, big)
        summed = big.clone()
        dist.all_reduce(summed, group=ref)
        _assert_same(out, summed.view(world, -1)[rank], "reduce_scatter_tensor")
        # reduce_scatter (list)
        out2 = torch.empty((x.numel(),), dtype=dtype)
        dist.reduce_scatter(out2, list(big.view(world, -1).clone().unbind(0)))
        _assert_same(out2, summed.view(world, -1)[rank], "reduce_scatter")
        if dtype.is_floating_point:
            out3 = torch.empty((x.numel(),), dtype=dtype)
            dist.reduce_scatter_tensor(out3, big, op=dist.ReduceOp.AVG)
            _assert_same(out3, summed.view(world, -1)[rank] / world, "reduce_scatter AVG")
        checks += 3
        # reduce to every root
        for root in range(world):
            a, b = x.clone(), x.clone()
            dist.reduce(a, dst=root)
            dist.reduce(b, dst=root, group=ref)
            if rank == root:
                _assert_same(a, b, f"reduce root {root}")
            checks += 1
        # gather / scatter
        root = world - 1
        g_out = [torch.empty_like(x) for _ in range(world)] if rank == root else None
        dist.gather(x, gather_list=g_out, dst=root)
        if rank == root:
            for j in range(world):
                _assert_same(g_out[j], outs_b[j], "gather")
        s_in = [(_data(j, shape, dtype, salt + 7)) for j in range(world)] if rank == 0 else None
        s_out = torch.empty_like(x)
        dist.scatter(s_out, scatter_list=s_in, src=0)
        _assert_same(s_out, _data(rank, shape, dtype, salt + 7), "scatter")
        checks += 2
    # all_to_all_single, equal and uneven splits
    rows = 3
    inp = torch.arange(world * rows * 2, dtype=torch.float32).view(world * rows, 2) + 100 * rank
    out_a, out_b = torch.empty_like(inp), torch.empty_like(inp)
    dist.all_to_all_single(out_a, inp)
    dist.all_to_all_single(out_b, inp, group=ref)
    _assert_same(out_a, out_b, "all_to_all_single equal")
    in_splits = [(rank + j) % 3 + 1 for j in range(world)]
    out_splits = [(j + rank) % 3 + 1 for j in range(world)]
    inp2 = torch.randn(sum(in_splits), 4, generator=torch.Generator().manual_seed(rank))
    out_a2 = torch.empty(sum(out_splits), 4)
    out_b2 = torch.empty(sum(out_splits), 4)
    dist.all_to_all_single(out_a2, inp2, out_splits, in_splits)
    dist.all_to_all_single(out_b2, inp2, out_splits, in_splits, group=ref)
    _assert_same(out_a2, out_b2, "all_to_all_single uneven")
    # all_to_all (lists)
    ins = [torch.full((j + 1,), float(rank * 10 + j)) for j in range(world)]
    outs = [torch.empty(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for j in range(world):
        assert torch.equal(outs[j], torch.full((rank + 1,), float(j * 10 + rank))), "all_to_all"
    checks += 3
    # send / recv around the world ring, and batch_isend_irecv
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        s = torch.full((5,), float(rank))
        r = torch.empty(5)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, nxt), dist.P2POp(dist.irecv, r, prv)])
        for q in reqs:
            q.wait()
        assert torch.equal(r, torch.full((5,), float(prv))), "batch_isend_irecv"
        if rank % 2 == 0:
            dist.send(s, nxt)
            if prv != nxt or world == 2:
                dist.recv(r, prv)
        else:
            dist.recv(r, prv)
            dist.send(s, nxt)
        checks += 2
    # coalesced all_reduce (DDP-style bucket of several tensors)
    ts = [_data(rank, (n,), torch.float32, n) for n in (3, 10, 1)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for n, t in zip((3, 10, 1), ts):
        ref_t = _data(rank, (n,), torch.float32, n)
        dist.all_reduce(ref_t, group=ref)
        _assert_same(t, ref_t, "coalesced all_reduce")
    # async work + futures
    t = torch.ones(4)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    res = fut.wait()
    assert torch.equal(res[0], torch.full((4,), float(world))), "future value"
    dist.barrier()
    return checks


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_collectives_match_gloo(world):
    checks = run_distributed(_collectives, world, timeout=240)
    assert all(c == checks[0] and c > 0 for c in checks)


def _odd_ring_send_recv(rank: int, world: int):
    # every rank sends to the next and receives from the previous with plain send/recv
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    s = torch.arange(6, dtype=torch.float64) * (rank + 1)
    r = torch.empty(6, dtype=torch.float64)
    if rank == 0:
        dist.send(s, nxt)
        dist.recv(r, prv)
    else:
        dist.recv(r, prv)
        dist.send(s, nxt)
    return r


def test_send_recv_ring_world3():
    out = run_distributed(_odd_ring_send_recv, 3)
    for rank, r in enumerate(out):
        prv = (rank - 1) % 3
        assert torch.equal(r, torch.arange(6, dtype=torch.float64) * (prv + 1))
