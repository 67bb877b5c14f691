"""The ring op's group is the rank map dynamic groups use (comm::RankMap): a DynamicGroup or its
ordered ranks go to the op, which checks them the way a dynamic group does, on every rank, before
any message moves (a bad ring is a clear error, never a hang). Real processes, bytescale backend."""
from __future__ import annotations

import torch

from bytescale.attention import reference_varlen_attention
from bytescale.attention import ring_attention, shard
from dist_utils import run_distributed

LENS = [23, 4]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    return tuple(torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))


def _bad_rings(rank, world):
    q, k, v = (shard(x, LENS, 2, 0) for x in _inputs())
    errors = {}
    for name, ranks in {
        "duplicate": [0, 0, 1],
        "outside": [0, world + 2],
        "not_member": [r for r in range(world) if r != rank],
        "negative": [-1, 0],
        "empty": [],
    }.items():
        try:
            ring_attention(q, k, v, LENS, ranks)
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    return errors


def test_bad_rings_raise_on_every_rank_naming_the_ring():
    for rank, errors in enumerate(run_distributed(_bad_rings, 3, timeout=120)):
        assert "appears twice" in errors["duplicate"] and "[0, 0, 1]" in errors["duplicate"]
        assert "outside [0, 3)" in errors["outside"] and "ring [0, 5]" in errors["outside"]
        assert f"rank {rank} is not a member of the ring" in errors["not_member"]
        assert "is not a rank" in errors["negative"]
        assert "empty ring" in errors["empty"]


def _group_vs_ranks(rank, world):
    from bytescale.comm import dynamic_group

    ring = [2, 0, 1]
    n, pos = len(ring), ring.index(rank)
    full = _inputs(seed=3)
    q, k, v = (shard(x, LENS, n, pos).requires_grad_() for x in full)
    by_group = ring_attention(q, k, v, LENS, dynamic_group(ring))
    by_ranks = ring_attention(q, k, v, LENS, ring)
    ref = shard(reference_varlen_attention(*full, LENS), LENS, n, pos)
    return by_group.detach(), by_ranks.detach(), ref


def test_dynamic_group_and_its_ranks_give_the_same_ring():
    for by_group, by_ranks, ref in run_distributed(_group_vs_ranks, 3, timeout=120):
        assert torch.equal(by_group, by_ranks)
        torch.testing.assert_close(by_group, ref, rtol=1e-10, atol=1e-10)


def test_ring_of_one_needs_no_process_group():
    q, k, v = _inputs(seed=4)
    torch.testing.assert_close(ring_attention(q, k, v, LENS, [0]),
                               reference_varlen_attention(q, k, v, LENS), rtol=1e-10, atol=1e-10)
