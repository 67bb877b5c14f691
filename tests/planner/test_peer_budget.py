"""The planner's peer budget from Python (issue 35): the option's plumbing and errors, the bound on
global ranks of TP units, and the simulator's pricing of ring hops from the actual member order.
(The byte-identical budget-0 plans and the bound over many steps at 1,024 and 16,384 ranks are
GoogleTests: tests/cpp/test_planner_peers.cpp.)"""
from __future__ import annotations

import numpy as np
import pytest

from bytescale.config import PlannerConfig
from bytescale.planner import UnitMap, plan
from bytescale.sim.distributions import draw_batch
from bytescale.sim.strategies import Schedule


def _neighbours(p, ranks):
    out = {r: set() for r in ranks}
    for r in ranks:
        for mb in p.micro_batches(r):
            ring = list(mb.ring)
            if len(ring) > 1:
                i = ring.index(r)
                out[r] |= {ring[i - 1], ring[(i + 1) % len(ring)]}
    return out


def test_default_budget_is_four_and_zero_is_unbounded():
    assert PlannerConfig(capacity=1024).peer_budget == 4
    seen4, seen0 = {r: set() for r in range(64)}, {r: set() for r in range(64)}
    for seed in range(6):
        lens = draw_batch("byted", 64 * 4096, seed=seed)
        p4 = plan(lens, 64, 4096, verify=True)
        p0 = plan(lens, 64, 4096, peer_budget=0, verify=True)
        assert p4.lower_bound == p0.lower_bound
        for r, s in _neighbours(p4, range(64)).items():
            seen4[r] |= s
            assert all(abs(x - r) <= 2 for x in s), (r, s)
        for r, s in _neighbours(p0, range(64)).items():
            seen0[r] |= s
    assert max(len(s) for s in seen4.values()) <= 4
    assert max(len(s) for s in seen0.values()) > 4  # what the budget is for


@pytest.mark.parametrize("bad", [-1, 1, 2, 3, True, 4.0])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ValueError, match="peer_budget"):
        plan([100, 5000], 16, 1024, peer_budget=bad)
    with pytest.raises(ValueError, match="peer_budget"):
        PlannerConfig(capacity=1024, peer_budget=bad)


def test_config_passes_the_budget():
    lens = draw_batch("github", 32 * 4096, seed=1)
    a = PlannerConfig(capacity=4096, peer_budget=0).plan(lens, 32)
    b = plan(lens, 32, 4096, peer_budget=0)
    assert a.to_bytes() == b.to_bytes()
    c = PlannerConfig(capacity=4096).plan(lens, 32)
    assert c.to_bytes() == plan(lens, 32, 4096).to_bytes()


@pytest.mark.parametrize("strategy", ["balanced", "naive", "pow2", "static"])
def test_tp_units_global_neighbours_are_same_tp_index_of_neighbouring_units(strategy):
    units = UnitMap.grid(hdp=16, tp=2)
    ranks = units.ranks
    for seed in range(3):
        lens = draw_batch("byted", 16 * 4096, seed=10 + seed)
        p = plan(lens, units, 4096, strategy=strategy, verify=True)
        for g, s in _neighbours(p, ranks).items():
            u, t = units.locate(g)
            allowed = {units.rank(v, t) for v in (u - 2, u - 1, u + 1, u + 2) if 0 <= v < 16}
            assert s <= allowed, (strategy, g, s, allowed)


def test_sim_prices_ring_hops_from_the_member_order():
    # two rings of 4 ranks with 2 GPUs per node: [0, 2, 3, 1] (the budget's order over nodes 0-1:
    # hops 0->2, 3->1 cross, 2->3 and 1->0 do not) and [4, 5] (inside node 2)
    s = Schedule.from_arrays("x", 6, rank_mb=np.zeros(7, np.int64), mb_ring=np.zeros(0, np.int64),
                 ring_grp=np.array([0, 4, 6], np.int64), grp_ranks=np.array([0, 2, 3, 1, 4, 5], np.int32),
                 mb_tokens=np.zeros(0), mb_attn=np.zeros(0), mb_ring_size=np.zeros(0, np.int64),
                 mb_offload=np.zeros(0), mb_docs=np.zeros(0, np.int64), loader="local")
    assert s.ring_node_hops(2).tolist() == [2, 0]
    assert s.ring_crosses_nodes(2).tolist() == [True, False]
    assert s.ring_node_hops(4).tolist() == [0, 0]  # ranks 0-3 on node 0; 4, 5 on node 1
    assert s.ring_node_hops(1).tolist() == [4, 2]  # every hop leaves its node
