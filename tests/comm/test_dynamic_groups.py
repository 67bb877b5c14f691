"""Dynamic groups: any ordered subset of ranks, created locally, collectives as P2P algorithms.

Expected values are computed independently in each process from the deterministic per-rank inputs
(no collective is used to check a collective).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import bytescale
from dist_utils import run_distributed


def _x(rank: int, n: int, salt: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + salt)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _check_group(g: bytescale.DynamicGroup, rank: int, salt: int) -> int:
    """Run every collective on g and compare with values computed locally."""
    ranks = list(g.ranks)
    n = len(ranks)
    me = ranks.index(rank)
    checks = 0
    for numel in (1, 5, 4099, 40_000):  # small path and ring path (> 64 KiB) of all_reduce
        x = _x(rank, numel, salt + numel)
        expect = sum(_x(r, numel, salt + numel) for r in ranks)
        y = x.clone()
        dist.all_reduce(y, group=g)
        torch.testing.assert_close(y, expect, rtol=1e-12, atol=1e-12)
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=g)
        assert torch.equal(y, torch.stack([_x(r, numel, salt + numel) for r in ranks]).amax(0))
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.AVG, group=g)
        torch.testing.assert_close(y, expect / n, rtol=1e-12, atol=1e-12)
        checks += 3
    # all_gather_into_tensor, rank-major in GROUP order
    x = _x(rank, 13, salt)
    out = torch.empty(n * 13, dtype=torch.float64)
    dist.all_gather_into_tensor(out, x, group=g)
    assert torch.equal(out, torch.cat([_x(r, 13, salt) for r in ranks]))
    lst = [torch.empty(13, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(lst, x, group=g)
    assert all(torch.equal(lst[j], _x(ranks[j], 13, salt)) for j in range(n))
    # reduce_scatter_tensor, odd block size
    big = _x(rank, n * 11, salt + 1)
    out = torch.empty(11, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, big, group=g)
    ref = sum(_x(r, n * 11, salt + 1) for r in ranks).view(n, 11)[me]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    checks += 3
    # broadcast from each member (src is a GLOBAL rank), large enough to pipeline in chunks
    for root in ranks:
        y = _x(rank, 300_000 if root == ranks[-1] else 17, salt + 2)
        dist.broadcast(y, src=root, group=g)
        assert torch.equal(y, _x(root, y.numel(), salt + 2))
        checks += 1
    # all_to_all_single with uneven splits (rows)
    in_splits = [(me + j) % 3 + 1 for j in range(n)]
    out_splits = [(j + me) % 3 + 1 for j in range(n)]
    inp = torch.cat([torch.full((in_splits[j], 2), float(100 * rank + ranks[j])) for j in range(n)])
    outp = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(outp, inp, out_splits, in_splits, group=g)
    expect = torch.cat([torch.full((out_splits[j], 2), float(100 * ranks[j] + rank)) for j in range(n)])
    assert torch.equal(outp, expect)
    checks += 1
    # ring exchange: receive the previous member's tensor
    r = torch.empty(9, dtype=torch.float64)
    g.ring_exchange(_x(rank, 9, salt + 3), r)
    assert torch.equal(r, _x(g.prev_rank, 9, salt + 3))
    # batch_isend_irecv with global peers (a ring in group order)
    s = _x(rank, 4, salt + 4)
    r = torch.empty(4, dtype=torch.float64)
    if n > 1:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, s, g.next_rank, g), dist.P2POp(dist.irecv, r, g.prev_rank, g)]
        )
        for w in works:
            w.wait()
        assert torch.equal(r, _x(g.prev_rank, 4, salt + 4))
    dist.barrier(group=g)
    checks += 2
    return checks


def _sizes_and_orders(rank: int, world: int):
    """Groups of size 1, 2, 3, 5 in scrambled order; every rank checks the groups it belongs to."""
    rng = random.Random(1234)  # same on every rank
    checks = 0
    for trial, size in enumerate([1, 2, 3, 5, 2, 3, world]):
        size = min(size, world)
        ranks = rng.sample(range(world), size)
        g = bytescale.dynamic_group(ranks)
        if rank in ranks:
            checks += _check_group(g, rank, 100 * trial)
        else:
            assert not g.is_member
    return checks


@pytest.mark.parametrize("world", [1, 2, 5])
def test_random_groups(world):
    run_distributed(_sizes_and_orders, world, timeout=240)


def _disjoint_concurrent(rank: int, world: int):
    """Partition the world into disjoint groups of sizes 1, 2, 3 (world 6) that all run at once,
    async, many steps in a row, repartitioning every step (a micro-batch's dynamic groups)."""
    rng = random.Random(99)
    for step in range(12):
        perm = list(range(world))
        rng.shuffle(perm)
        parts = [perm[:1], perm[1:3], perm[3:6]]
        mine = next(p for p in parts if rank in p)
        g = bytescale.dynamic_group(mine)
        works, tensors = [], []
        for k in range(3):  # several async ops in flight on the same group
            t = _x(rank, 1000 + k, step * 10 + k)
            tensors.append(t)
            works.append(dist.all_reduce(t, group=g, async_op=True))
        r = torch.empty(50, dtype=torch.float64)
        works.append(g.ring_exchange(_x(rank, 50, step), r, async_op=True))
        for w in works:
            w.wait()
        for k, t in enumerate(tensors):
            expect = sum(_x(q, 1000 + k, step * 10 + k) for q in mine)
            torch.testing.assert_close(t, expect, rtol=1e-12, atol=1e-12)
        assert torch.equal(r, _x(g.prev_rank, 50, step))
    return True


def test_disjoint_groups_concurrently():
    run_distributed(_disjoint_concurrent, 6, timeout=240)


def _overlapping_in_order(rank: int, world: int):
    """Groups sharing ranks, used in the same order by every member (the ordering contract)."""
    groups = [[0, 1, 2], [2, 1], [1, 3, 0, 2], [3, 2]]
    for i, ranks in enumerate(groups * 3):
        ranks = [r for r in ranks if r < world]
        g = bytescale.dynamic_group(ranks)
        if rank in ranks:
            t = _x(rank, 70_000, i)
            dist.all_reduce(t, group=g)
            torch.testing.assert_close(t, sum(_x(q, 70_000, i) for q in ranks), rtol=1e-12, atol=1e-12)
    return True


def test_overlapping_groups_in_contract_order():
    run_distributed(_overlapping_in_order, 4)


def _non_member_and_cache(rank: int, world: int):
    g = bytescale.dynamic_group([0, 1])
    assert bytescale.dynamic_group([0, 1]) is g  # cached
    assert bytescale.dynamic_group([1, 0]) is not g  # order matters
    if rank == 2:
        t = torch.ones(3)
        try:
            dist.all_reduce(t, group=g)
        except (RuntimeError, ValueError) as e:
            # our backend's error, or torch's logging wrapper re-raising it as "not part of group"
            msg = str(e)
            assert "[0, 1]" in msg and ("not a member" in msg or "not part of group" in msg), msg
        else:
            raise AssertionError("non-member all_reduce did not raise")
    for bad, msg in (([0, 0], "appears twice"), ([0, world], "outside"), ([], "empty")):
        try:
            bytescale.dynamic_group(bad)
        except (ValueError, RuntimeError) as e:
            assert msg in str(e), str(e)
        else:
            raise AssertionError(f"bad group {bad} accepted")
    return True


def test_non_member_and_validation():
    run_distributed(_non_member_and_cache, 3)


def _new_group_is_dynamic(rank: int, world: int):
    # dist.new_group asked for a dynamic group gives one on the world communicator (the default,
    # a static group with its own communicators, is tested in test_mesh.py)
    from bytescale.comm import GroupOptions

    sub = dist.new_group([0, 2], pg_options=GroupOptions(kind="dynamic"))
    if rank in (0, 2):
        assert type(sub._get_backend(torch.device("cpu"))).__name__ == "DynamicGroupBackend"
    if rank in (0, 2):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((3,), 4.0))
    return True


def test_new_group_uses_world_communicator():
    run_distributed(_new_group_is_dynamic, 3)


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _churn(rank, world, rounds):
    """Create and drop dynamic groups: uncached ones, and cached ones through evictions (a small
    cache over every ordered subset of the world). Resident memory after a warm-up, then after
    `rounds` more of each, and one collective on a group made after the churn."""
    import itertools

    import bytescale.comm as bc

    subsets = [p for k in range(1, world + 1) for p in itertools.permutations(range(world), k)]
    cache_size, bc._CACHE_SIZE = bc._CACHE_SIZE, 8  # every round of the cached loop creates one group and evicts one
    try:
        return _churn_rounds(rank, world, rounds, subsets)
    finally:
        bc._CACHE_SIZE = cache_size  # the process serves later tests (pooled worlds)


def _churn_rounds(rank, world, rounds, subsets):
    import bytescale.comm as bc

    def one_round(i):
        g = bytescale.dynamic_group(subsets[i % len(subsets)], cache=False)
        assert g.ranks == subsets[i % len(subsets)]
        del g
        bytescale.dynamic_group(subsets[(7 * i) % len(subsets)])

    for i in range(rounds // 4):  # warm-up: allocator pools, caches, torch's tables at size
        one_round(i)
    before = _rss_bytes()
    for i in range(rounds):
        one_round(i)
    after = _rss_bytes()
    g = bytescale.dynamic_group(list(range(world))[::-1], cache=False)
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t, group=g)
    return before, after, t, len(bc._uncached), len(dist.distributed_c10d._world.pg_map)


def test_dropped_groups_are_released():
    """bytescale.dynamic_group(ranks, cache=False) and evicted cached groups free their memory when
    dropped: 20,000 rounds (40,000 groups) leave resident memory within a few MiB (it grew by
    about 2.7 KiB per group, 100 MiB here, while torch's tables kept every group)."""
    world, rounds = 4, 20_000
    for rank, (before, after, t, pending, pg_map) in enumerate(
            run_distributed(_churn, world, rounds, timeout=240)):
        assert after - before < 4 * 2**20, (rank, before, after)
        assert torch.equal(t, torch.full((3,), 10.0))
        assert pending <= 200 and pg_map <= 200, (rank, pending, pg_map)
