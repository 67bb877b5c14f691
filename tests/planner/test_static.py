"""The static DP x CP baseline as a strategy of the C++ planner (issue 22): the same Plan type as
every strategy, micro-batches identical to the former Python baseline (re-implemented here as an
independent reference), lockstep padding, the entry points (PlannerConfig, static_cp_degree) and
bad input."""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytescale import PlannerConfig
from bytescale.planner import DocRef, MicroBatchPlan, Plan, plan, static_cp_degree


def _reference(lengths: Sequence[int], world: int, capacity: int, cp: Optional[int] = None
               ) -> List[List[MicroBatchPlan]]:
    """The former Python baseline (bytescale/data/baselines.py before issue 22): per rank, its
    micro-batches. ring_id is the one global ring order (the old code numbered rings per replica)."""
    deg = cp
    if deg is None:
        deg = 1
        while deg * capacity < max(lengths):
            deg *= 2
    bins: List[List[int]] = []
    loads: List[int] = []
    for sid in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[sid] <= deg * capacity:
                bins[b].append(sid)
                loads[b] += lengths[sid]
                break
        else:
            bins.append([sid])
            loads.append(lengths[sid])
    replicas = world // deg
    out: List[List[MicroBatchPlan]] = [[] for _ in range(world)]
    for b, members in enumerate(bins):
        rep = b % replicas
        ring = tuple(range(rep * deg, (rep + 1) * deg))
        docs = tuple(DocRef(s, -1, int(lengths[s])) for s in members)
        for pos, rank in enumerate(ring):
            i = len(out[rank])
            out[rank].append(MicroBatchPlan(rank, i, local=docs) if deg == 1 else
                             MicroBatchPlan(rank, i, sharded=docs, ring=ring, ring_pos=pos, ring_id=b))
    return out


def _strip(mbs: List[MicroBatchPlan]) -> list:
    """What the assignment is: documents, ring, position, order (not the planner's time)."""
    return [(m.index, m.local, m.sharded, m.ring, m.ring_pos, m.ring_id, m.offload_ratio) for m in mbs]


MESHES = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 2), (5, 1), (5, 5), (6, 2), (6, 3), (8, 4), (9, 3)]


@settings(max_examples=150, deadline=None)
@given(mesh=st.sampled_from(MESHES), capacity=st.integers(1, 300), data=st.data())
def test_micro_batches_match_the_former_python_baseline(mesh, capacity, data):
    world, cp = mesh
    lengths = data.draw(st.lists(st.integers(1, cp * capacity), min_size=1, max_size=40))
    # peer_budget=0: the former baseline lists a replica's ranks ascending (the budget's order is
    # a, a+2, ..., a+3, a+1; tests/planner/test_peer_budget.py)
    p = plan(lengths, world, capacity, strategy="static", static_cp=cp, verify=True, peer_budget=0)
    assert isinstance(p, Plan) and p.strategy == "static"
    ref = _reference(lengths, world, capacity, cp)
    for r in range(world):
        assert _strip(p.micro_batches(r)) == _strip(ref[r]), r
    # FSDP2 lockstep: the rank's micro-batches in order, then empty padding slots to the largest count
    total = max(len(x) for x in ref)
    for r in range(world):
        mine = p.lockstep_micro_batches(r)
        assert len(mine) == total
        assert _strip(mine[:len(ref[r])]) == _strip(ref[r])
        assert all(m.is_empty and m.index == k for k, m in enumerate(mine) if k >= len(ref[r]))
    # the planner's prediction exists for the baseline too, and the plan crosses processes
    assert p.makespan >= p.lower_bound * (1 - 1e-9) and np.isfinite(p.imbalance)
    q = Plan.from_bytes(p.to_bytes())
    assert all(_strip(q.micro_batches(r)) == _strip(p.micro_batches(r)) for r in range(world))


def test_planner_config_is_the_cpp_strategy_with_the_degree_sized_for_the_longest():
    lengths = [700, 90, 300, 260, 40, 515, 8, 1000]  # longest 1000 at capacity 300: cp 4
    cfg = PlannerConfig(300, strategy="static", peer_budget=0)  # the baseline's ascending rings
    p = cfg.plan(lengths, 8)
    assert isinstance(p, Plan) and p.strategy == "static"
    assert set(p.ring_sizes().values()) == {4} and len(p.ring_sizes()) == len(lengths)
    ref = _reference(lengths, 8, 300)
    assert all(_strip(p.micro_batches(r)) == _strip(ref[r]) for r in range(8))
    # ranks 4..7 form replica 1; sample ids bind by position
    mbs = p.micro_batches(5, sample_ids=[10 * i for i in range(len(lengths))])
    assert all(m.ring == (4, 5, 6, 7) and m.ring_pos == 1 for m in mbs)
    assert all(d.sample_id == 10 * d.batch_pos for m in mbs for d in m.documents)
    # cp 1: local micro-batches only (the pure DP baseline)
    p1 = PlannerConfig(1000, strategy="static").plan(lengths, 3)
    assert p1.ring_sizes() == {} and p1.raw.num_rings == 0
    # an explicit degree (3 on 3 ranks: not a power of two)
    p3 = PlannerConfig(400, strategy="static", static_cp=3).plan(lengths, 3)
    assert set(p3.ring_sizes().values()) == {3}


def test_static_cp_degree():
    assert static_cp_degree(0, 10, 1) == 1
    assert static_cp_degree(10, 10, 1) == 1
    assert static_cp_degree(11, 10, 2) == 2
    assert static_cp_degree(33, 10, 6) == 4
    with pytest.raises(ValueError, match=r"longest sequence \(33 tokens\) needs CP degree 4 at capacity 10, "
                                         r"more than the world size 3"):
        static_cp_degree(33, 10, 3)
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        static_cp_degree(33, 0, 3)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="static_cp = 4 does not divide world_size 6"):
        plan([100], 6, 100, strategy="static", static_cp=4)
    with pytest.raises(ValueError, match="CP degree 4 does not divide world size 6"):
        plan([350], 6, 100, strategy="static")
    with pytest.raises(ValueError, match="sequence 1 of 250 tokens does not fit CP degree 2 at capacity 100"):
        plan([10, 250], 4, 100, strategy="static", static_cp=2)
    with pytest.raises(ValueError, match="does not offload"):
        plan([10], 4, 100, strategy="static", offload=True)
    with pytest.raises(ValueError, match="applies to strategy 'static' only"):
        plan([10], 4, 100, strategy="balanced", static_cp=2)
    with pytest.raises(ValueError, match="static_cp must be an integer >= 1"):
        plan([10], 4, 100, strategy="static", static_cp=0)
    with pytest.raises(ValueError, match="does not offload"):
        PlannerConfig(100, strategy="static", offload=True)
    with pytest.raises(ValueError, match="static_cp must be an integer >= 1"):
        PlannerConfig(100, strategy="static", static_cp=-2)
    with pytest.raises(ValueError, match="applies to strategy='static' only"):
        PlannerConfig(100, static_cp=2)
