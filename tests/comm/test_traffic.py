"""The transport's traffic counters (bytescale.comm.traffic) against the bytes a ring must move.

Each rank runs ring attention (forward and backward) over rings of known members, document lengths
and head shapes; the test computes, independently of the library, how many tokens each ring
position holds (the zig-zag definition: 2N chunks with bounds floor(j*s/2N), position i holds chunks
i and 2N-1-i) and from that the bytes every rank must send and receive: K/V blocks in N-1 forward
and N-1 backward steps, dK/dV accumulators in N backward steps. Collectives count their payload
under the caller's purpose. A rank that makes its ring partners wait shows up in their wait time.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from bytescale.attention import Layout, shard
from bytescale.comm.traffic import PURPOSES, traffic, traffic_scope
from dist_utils import run_distributed

HQ, HKV, D = 4, 2, 8
LENS = [37, 5, 2]  # divisible by nothing; the short ones leave chunks empty for N >= 2


def _tokens(lens, n, pos):
    """Tokens of `lens` held by ring position `pos` of `n` (zig-zag, computed here)."""
    total = 0
    for s in lens:
        for j in (pos, 2 * n - 1 - pos):
            total += (j + 1) * s // (2 * n) - j * s // (2 * n)
    return total


def _expected(ranks, rank, lens, elt, acc_elt):
    n, i = len(ranks), ranks.index(rank)
    tok = [_tokens(lens, n, p) for p in range(n)]
    kv = lambda p: 2 * tok[p % n] * HKV * D * elt  # noqa: E731  (K and V in one message)
    fwd_sent = sum(kv(i - s) for s in range(n - 1))
    fwd_recv = sum(kv(i - s - 1) for s in range(n - 1))
    dkv = 2 * sum(tok) * HKV * D * acc_elt  # every block's accumulator passes through every rank
    return {"ring_kv_fwd": (fwd_sent, fwd_recv, n - 1), "ring_kv_bwd": (fwd_sent, fwd_recv, n - 1),
            "ring_dkv_bwd": (dkv, dkv, n)}


def _ring(rank, ranks, dtype, sleep_before_backward=0.0):
    n, pos = len(ranks), ranks.index(rank)
    g = torch.Generator().manual_seed(7)
    T = sum(LENS)
    q, k, v = (torch.randn(T, h, D, generator=g, dtype=dtype) for h in (HQ, HKV, HKV))
    qs, ks, vs = (shard(t, LENS, n, pos).requires_grad_() for t in (q, k, v))
    out = Layout.for_rank([], LENS, ranks).attention(qs, ks, vs, causal=True)
    if sleep_before_backward:
        time.sleep(sleep_before_backward)
    out.sum().backward()


def _count(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    results = []
    for ranks in (list(range(world)), list(reversed(range(world))), [world - 1, 0]):
        dist.barrier()
        traffic(reset=True)
        if rank in ranks and len(set(ranks)) == len(ranks):
            _ring(rank, ranks, dtype)
        snap = traffic(reset=True)
        results.append((ranks, {p: snap.rows[p] for p in PURPOSES}))
    # collectives: payload under the caller's purpose
    x = torch.ones(1000, dtype=torch.float32)
    with traffic_scope("grad_sync"):
        dist.all_reduce(x)
    dist.all_reduce(torch.ones(3, dtype=torch.float64))
    snap = traffic(reset=True)
    return results, snap.rows["grad_sync"], snap.rows["other"]


@pytest.mark.nccl_order
@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "float64"), (5, "float32")])
def test_ring_bytes_equal_what_the_ring_must_move(world, dtype):
    per_rank = run_distributed(_count, world, dtype, timeout=240)
    elt = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    for rank, (results, grad, other) in enumerate(per_rank):
        for ranks, rows in results:
            if rank not in ranks or len(set(ranks)) != len(ranks):
                assert all(rows[p] == (0, 0, 0) for p in ("ring_kv_fwd", "ring_kv_bwd", "ring_dkv_bwd"))
                continue
            want = _expected(ranks, rank, LENS, elt, elt)  # fp32 and fp64 accumulate in their own dtype
            for p, w in want.items():
                assert rows[p] == w, (world, ranks, rank, p, rows[p], w)
            assert rows["grad_sync"] == (0, 0, 0)
        assert grad == (4000, 4000, 1)
        assert other[0] >= 24 and other[2] >= 1  # the un-scoped all-reduce (and the barriers) land here


def _wait(rank, world):
    traffic(reset=True)
    # rank 0 holds the backward back: its partners block in the ring's first exchange meanwhile
    _ring(rank, list(range(world)), torch.float32, sleep_before_backward=1.0 if rank == 0 else 0.0)
    return traffic(reset=True).ring_wait_s


def test_ring_wait_counts_time_blocked_on_a_partner():
    waits = run_distributed(_wait, 3, timeout=240)
    assert all(w >= 0.5 for w in waits[1:]), waits
    assert all(w >= 0 for w in waits)
