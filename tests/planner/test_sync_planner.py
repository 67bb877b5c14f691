"""The sync-aware planner from Python: the replay against an independent event simulation, idle
times, FSDP2 lockstep slots against an independent reference, balanced vs pow2 under the replay,
serialisation, and bad input (issue 10 item 5, issue 16)."""
from __future__ import annotations

import json
import math
from typing import Dict, List, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytescale import _C
from bytescale.planner import CostModel, Plan, Replay, plan

CAP = 128


def _lists(p: Plan) -> List[List[Tuple[int, int]]]:
    """Per rank: (micro-batch index, ring id or -1), in execution order."""
    raw = p.raw
    rank_mb, mb_ring = np.asarray(raw.rank_mb), np.asarray(raw.mb_ring)
    return [[(m, int(mb_ring[m])) for m in range(rank_mb[r], rank_mb[r + 1])]
            for r in range(p.world_size)]


def _reference_replay(p: Plan, durations: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Event simulation written independently of the C++ one: repeatedly run whatever can run."""
    lists = _lists(p)
    ring_grp, grp = np.asarray(p.raw.ring_grp), np.asarray(p.raw.grp_ranks)
    members = {k: set(grp[ring_grp[k]:ring_grp[k + 1]].tolist()) for k in range(len(ring_grp) - 1)}
    head = [0] * p.world_size
    clock = [0.0] * p.world_size
    start = np.zeros(len(durations))
    end = np.zeros(len(durations))
    progressed = True
    while progressed:
        progressed = False
        for r in range(p.world_size):
            while head[r] < len(lists[r]):
                m, ring = lists[r][head[r]]
                if ring < 0:
                    start[m], end[m] = clock[r], clock[r] + durations[m]
                    clock[r] = end[m]
                    head[r] += 1
                    progressed = True
                    continue
                at_head = {q: lists[q][head[q]][0] for q in members[ring]
                           if head[q] < len(lists[q]) and lists[q][head[q]][1] == ring}
                if len(at_head) < len(members[ring]):
                    break
                s = max(clock[q] for q in members[ring])
                e = s + max(durations[mm] for mm in at_head.values())
                for q, mm in at_head.items():
                    start[mm], end[mm] = s, e
                    clock[q] = e
                    head[q] += 1
                progressed = True
    assert all(head[r] == len(lists[r]) for r in range(p.world_size)), "reference deadlocked"
    return start, end, np.asarray(clock)


def _reference_lockstep(p: Plan) -> np.ndarray:
    """The loader's lockstep rule, written independently: rings in the earliest slot after every
    member's previous ring, locals in the remaining slots in order, padding with -1."""
    lists = _lists(p)
    ring_order = sorted({ring for lst in lists for _, ring in lst if ring >= 0})
    next_free = [0] * p.world_size
    slot: Dict[int, int] = {}
    for ring in ring_order:  # ring ids increase along every list, so id order is a valid order
        holders = [(r, m) for r in range(p.world_size) for m, g in lists[r] if g == ring]
        k = max(next_free[r] for r, _ in holders)
        for r, m in holders:
            slot[m] = k
            next_free[r] = k + 1
    rows = []
    for r in range(p.world_size):
        taken = {slot[m] for m, g in lists[r] if g >= 0}
        k = 0
        for m, g in lists[r]:
            if g >= 0:
                continue
            while k in taken:
                k += 1
            slot[m] = k
            k += 1
        rows.append({slot[m]: m for m, _ in lists[r]})
    total = max((max(row) + 1 for row in rows if row), default=0)
    return np.array([[row.get(k, -1) for k in range(total)] for row in rows],
                    dtype=np.int64).reshape(p.world_size, total)


_batches = st.lists(st.one_of(st.integers(1, CAP), st.integers(1, 5 * CAP)), max_size=50)


@settings(max_examples=120, deadline=None)
@given(lengths=_batches, world=st.integers(1, 9), strategy=st.sampled_from(["balanced", "naive", "pow2"]),
       hetero=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_replay_matches_an_independent_simulation(lengths, world, strategy, hetero, seed):
    speed = [1.0 + (r % 3) * 0.5 for r in range(world)] if hetero else None
    try:
        p = plan(lengths, world_size=world, capacity=CAP, strategy=strategy, speed=speed, verify=True)
    except ValueError as e:
        assert "ranks" in str(e)
        return
    # the plan's own prediction is its replay with the cost model's durations
    rep = p.replay()
    assert isinstance(rep, Replay)
    assert rep.step_time == pytest.approx(p.makespan, rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(rep.rank_finish, p.rank_finish, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(p.idle(), p.makespan - p.busy, rtol=1e-9, atol=1e-12)
    if world:
        assert p.idle(world - 1) == pytest.approx(float(p.idle()[world - 1]))
    assert p.makespan >= p.max_busy * (1 - 1e-12)
    assert p.makespan >= p.lower_bound * (1 - 1e-9)
    # any durations: the C++ replay equals the reference simulation
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.0, 2.0, size=p.raw.num_micro_batches)
    rep = p.replay(d)
    start, end, finish = _reference_replay(p, d)
    np.testing.assert_allclose(rep.start, start, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rep.end, end, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rep.rank_finish, finish, rtol=1e-12, atol=1e-12)
    assert rep.step_time == pytest.approx(finish.max() if world else 0.0, abs=1e-12)
    np.testing.assert_allclose(rep.rank_idle, rep.step_time - rep.rank_busy, atol=1e-12)
    # lockstep slots: the reference rule
    np.testing.assert_array_equal(p.lockstep(), _reference_lockstep(p))


def test_replay_of_a_crossed_order_raises_naming_the_deadlock():
    # rank 0 runs ring 0 then ring 1, rank 1 ring 1 then ring 0: neither can start
    with pytest.raises(ValueError, match="deadlock.*rank 0 waits in ring 0"):
        _C.planner.replay(_C.planner.Schedule(2, np.array([0, 2, 4]), np.array([0, 1, 1, 0]), np.array([0, 2, 4]),
                                              np.array([0, 1, 0, 1], dtype=np.int32)), np.ones(4))
    r = _C.planner.replay(_C.planner.Schedule(2, np.array([0, 2, 4]), np.array([0, 1, 0, 1]), np.array([0, 2, 4]),
                                              np.array([0, 1, 0, 1], dtype=np.int32)), np.array([1.0, 2, 3, 1]))
    assert r.step_time == 3 + 2  # ring 0 lasts max(1, 3), ring 1 max(2, 1)
    p = plan([300, 20, 20], world_size=3, capacity=CAP)
    with pytest.raises(ValueError, match="durations"):
        p.replay([1.0])
    with pytest.raises(ValueError, match="duration of micro-batch 0 is nan"):
        p.replay(np.full(p.raw.num_micro_batches, np.nan))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40 * CAP), min_size=1, max_size=120), world=st.integers(2, 40),
       cap_shift=st.integers(0, 3))
def test_balanced_never_worse_than_pow2_under_the_replay(lengths, world, cap_shift):
    cap = CAP << cap_shift
    try:
        pow2 = plan(lengths, world_size=world, capacity=cap, strategy="pow2")
    except ValueError:
        return
    bal = plan(lengths, world_size=world, capacity=cap, strategy="balanced", verify=True)
    assert bal.makespan <= pow2.makespan * (1 + 1e-9)
    assert bal.bound_ratio >= 1 - 1e-9


def test_interleaved_order_and_serialisation():
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(1, CAP, 400), rng.integers(CAP, 12 * CAP, 30)])
    p = plan(lengths, world_size=16, capacity=CAP, verify=True)
    q = Plan.from_bytes(p.to_bytes())
    assert q.to_bytes() == p.to_bytes()
    assert q.makespan == p.makespan and q.lower_bound == p.lower_bound
    np.testing.assert_array_equal(q.idle(), p.idle())
    assert plan(lengths, world_size=16, capacity=CAP).to_bytes() == p.to_bytes()  # deterministic
    # the order is the execution order: mb_ring ids increase along each rank's list
    for lst in _lists(p):
        rings = [g for _, g in lst if g >= 0]
        assert rings == sorted(rings)
    blob = bytearray(p.to_bytes())
    blob[4] = 1  # version 1 (the per-micro-batch group layout) is no longer read
    with pytest.raises(ValueError, match="version 1, expected 2"):
        Plan.from_bytes(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupt_plan_bytes_raise_value_error(data):
    p = plan([300, 20, 20, 700, 5], world_size=6, capacity=CAP)
    blob = bytearray(p.to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        q = Plan.from_bytes(bytes(blob[:cut]))
    except ValueError:
        return
    try:  # structurally sound: the replay either works or names the problem
        q.replay()
        q.lockstep()
        [q.micro_batches(r) for r in range(q.world_size)]
    except ValueError:
        pass


@pytest.mark.parametrize("bad,shown", [
    (1.5, "1.5"), (2.5, "2.5"), (True, "True"), (math.nan, "nan"), (-3, "-3"), (0, "0"),
    (math.inf, "inf"), ("12", "'12'"), (None, "None"), (np.float64(7.25), "7.25"), (2**41, str(2**41)),
])
def test_lengths_must_be_integers_at_least_one(bad, shown):
    lengths = [10, 20, bad, 30]
    with pytest.raises(ValueError, match=rf"sequence 2 has length {shown}"):
        plan(lengths, world_size=2, capacity=CAP)


def test_length_arrays_are_checked_before_conversion():
    with pytest.raises(ValueError, match=r"sequence 1 has length 1.5"):
        plan(np.array([3.0, 1.5]), world_size=2, capacity=CAP)
    with pytest.raises(ValueError, match=r"sequence 0 has length"):
        plan(np.array([True, False]), world_size=2, capacity=CAP)
    with pytest.raises(ValueError, match=r"sequence 2 has length 0"):
        plan(np.array([4, 5, 0], dtype=np.uint8), world_size=2, capacity=CAP)
    # integral floats and any integer dtype are fine and give the same plan
    a = plan(np.array([3.0, 40.0, 200.0]), world_size=2, capacity=CAP)
    b = plan(np.array([3, 40, 200], dtype=np.int32), world_size=2, capacity=CAP)
    c = plan((x for x in [3, 40, 200]), world_size=2, capacity=CAP)
    assert a.to_bytes() == b.to_bytes() == c.to_bytes()
    with pytest.raises(ValueError, match="integer array"):  # the raw binding never truncates
        _C.planner.make_plan(np.array([1.5]), _C.planner.PlanOptions())


@pytest.mark.parametrize("kwargs,msg", [
    (dict(world_size=0), "world_size must be an integer >= 1, got 0"),
    (dict(world_size=2.5), "world_size must be an integer >= 1, got 2.5"),
    (dict(world_size=True), "world_size must be an integer >= 1, got True"),
    (dict(capacity=0), "capacity must be an integer >= 1, got 0"),
    (dict(capacity=64.0), "capacity must be an integer >= 1, got 64.0"),
    (dict(speed=[1.0, math.nan]), r"speed\[1\] = nan"),
    (dict(memory=[1.0, -2.0]), r"memory\[1\] = -2"),
])
def test_bad_options_name_field_and_value(kwargs, msg):
    args = dict(world_size=2, capacity=CAP)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        plan([10, 20], **args)


@pytest.mark.parametrize("field", ["a1", "b1", "g", "a2", "b2", "bw_d2h", "bw_h2d", "ring_bw",
                                   "ring_latency", "kv_bytes_per_token"])
@pytest.mark.parametrize("value,shown", [(math.nan, "nan"), (-1.0, "-1"), (math.inf, "inf")])
def test_bad_cost_coefficients_name_field_and_value(field, value, shown):
    cost = CostModel()
    setattr(cost, field, value)
    with pytest.raises(ValueError, match=rf"cost model: {field} = {shown} must be"):
        plan([10, 20], world_size=2, capacity=CAP, cost=cost)
    # the same through a JSON profile (json writes NaN / Infinity)
    with pytest.raises(ValueError, match=rf"{field}"):
        plan([10, 20], world_size=2, capacity=CAP, cost={field: value})


def test_profile_layers_must_be_an_integer():
    for v in (0, 2.5, 1e30):
        with pytest.raises(ValueError, match="layers"):
            CostModel.from_json(json.dumps({"layers": v}))
