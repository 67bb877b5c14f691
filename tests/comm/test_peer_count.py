"""The transport's count of distinct point-to-point peers (bytescale.comm.traffic: Traffic.peers).

Each rank runs ring attention (forward and backward) over rings of known members, in the order the
planner's peer budget gives them (intervals of the rank order, hops of at most 2 positions), and
the test computes, independently of the library, each rank's ring neighbours (the previous and the
next member of every ring it is in): the count must equal their number, stay when the per-step
counters are reset, grow only with new neighbours, and clear with reset_peers(). A plan of the
planner itself over 6 ranks is run too: its rings' neighbours are what the transport counts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from bytescale.attention import Layout, shard
from bytescale.comm.traffic import reset_peers, traffic
from dist_utils import run_distributed

HQ, HKV, D = 4, 2, 8
LENS = [37, 5, 2]
# rings of 6 ranks as the peer budget orders them: a, a+2, ..., a+3, a+1
RINGS = [[0, 2, 4, 5, 3, 1], [1, 3, 2], [4, 5], [2, 4, 5, 3]]


def _neighbours(rings, rank):
    out = set()
    for r in rings:
        if rank in r and len(r) > 1:
            i = r.index(rank)
            out |= {r[i - 1], r[(i + 1) % len(r)]}
    return out


def _ring(rank, ranks, lens=LENS):
    n, pos = len(ranks), ranks.index(rank)
    g = torch.Generator().manual_seed(7)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (HQ, HKV, HKV))
    qs, ks, vs = (shard(t, lens, n, pos).requires_grad_() for t in (q, k, v))
    out = Layout.for_rank([], lens, ranks).attention(qs, ks, vs, causal=True)
    out.sum().backward()


def _count(rank, world):
    dist.barrier()
    reset_peers()
    seen = []
    for k, ranks in enumerate(RINGS):
        dist.barrier()
        if rank in ranks:
            _ring(rank, ranks)
        seen.append(traffic(reset=True).peers)  # the per-step reset leaves the peer count
    dist.barrier()
    reset_peers()
    after_reset = traffic().peers
    # the planner's own rings: plan a batch over the 6 ranks (budget 4) and run its rings in order
    from bytescale.planner import plan

    p = plan([600, 300, 250, 90, 40], world_size=world, capacity=160, peer_budget=4)
    rings = []
    for mb in p.micro_batches(rank):  # in the plan's order (deadlock-free)
        if len(mb.ring) > 1:
            _ring(rank, list(mb.ring), [d.length for d in mb.sharded])
    for r in range(world):
        for mb in p.micro_batches(r):
            if len(mb.ring) > 1 and list(mb.ring) not in rings:
                rings.append(list(mb.ring))
    dist.barrier()
    return seen, after_reset, traffic().peers, rings


def test_peer_count_equals_the_ring_neighbours():
    world = 6
    per_rank = run_distributed(_count, world, timeout=240)
    for rank, (seen, after_reset, planned, rings) in enumerate(per_rank):
        for k in range(len(RINGS)):
            assert seen[k] == len(_neighbours(RINGS[:k + 1], rank)), (rank, k, seen)
        assert after_reset == 0
        assert planned == len(_neighbours(rings, rank)) <= 4, (rank, planned, rings)
    assert any(len(r) > 2 for r in per_rank[0][3]), per_rank[0][3]


def test_trainer_metrics_carry_the_peer_count():
    from bytescale.comm.traffic import PURPOSES, Traffic
    from bytescale.train.metrics import traffic_fields, traffic_row

    rows = [traffic_row(Traffic(rows={p: (0, 0, 0) for p in PURPOSES}, ring_wait_s=0.0, peers=k)) for k in (3, 4)]
    fields = traffic_fields(torch.tensor(rows, dtype=torch.float64))
    assert fields["p2p_peers"] == [3, 4]
