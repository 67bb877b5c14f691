"""The step model's lockstep forms in C++ (csrc/planner/lockstep.cpp, replay.cpp; bound once in
csrc/bindings/step_model.cpp for plans and for raw schedules) against the Python ports they replaced,
kept here verbatim as the reference (``_ref_*``, from bytescale/planner/lockstep.py before the move):
the same slots, counts and EP replays, bit for bit, on plans of every strategy at many world sizes
and EP groups, on the simulator's schedules, and on random hand-built schedules.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List

import numpy as np
import pytest

import bytescale
from bytescale import _C
from bytescale.planner import Replay

# ---- the reference: the former Python ports ----------------------------------------------------


def _ref_group_slots(slots: np.ndarray, unit: int, group: int) -> int:
    if not group:
        return slots.shape[1]
    b = unit // group * group
    used = np.nonzero((slots[b:b + group] >= 0).any(axis=0))[0]
    return int(used[-1]) + 1 if used.size else 0


def _ref_schedule_lockstep(world, rank_mb, mb_ring, ring_grp, grp_ranks) -> np.ndarray:
    mb_ring = np.ascontiguousarray(mb_ring, dtype=np.int64)
    rank_mb = np.ascontiguousarray(rank_mb, dtype=np.int64)
    unit = (mb_ring >= 0).astype(np.float64)
    sched = _C.planner.Schedule(world, rank_mb, mb_ring, np.ascontiguousarray(ring_grp, dtype=np.int64),
                                np.ascontiguousarray(grp_ranks, dtype=np.int32))
    rep = _C.planner.replay(sched, unit)  # the flat replay the port called (replay_schedule then)
    ring_start = np.rint(np.asarray(rep.mb_start)).astype(np.int64)
    slot_of = np.full(len(mb_ring), -1, dtype=np.int64)
    total = 0
    for r in range(world):
        lo, hi = int(rank_mb[r]), int(rank_mb[r + 1])
        taken = {int(ring_start[m]) for m in range(lo, hi) if mb_ring[m] >= 0}
        for m in range(lo, hi):
            if mb_ring[m] >= 0:
                slot_of[m] = ring_start[m]
        k = 0
        for m in range(lo, hi):
            if mb_ring[m] >= 0:
                continue
            while k in taken:
                k += 1
            slot_of[m] = k
            k += 1
        total = max([total, k] + [t + 1 for t in taken])
    out = np.full((world, total), -1, dtype=np.int64)
    for r in range(world):
        for m in range(int(rank_mb[r]), int(rank_mb[r + 1])):
            out[r, slot_of[m]] = m
    return out


def _ref_sort_local_slots(slots: np.ndarray, mb_ring: np.ndarray, cost: np.ndarray) -> np.ndarray:
    out = np.array(slots, dtype=np.int64, copy=True)
    for row in out:
        pos = [k for k, m in enumerate(row) if m >= 0 and mb_ring[m] < 0]
        mbs = sorted((int(row[k]) for k in pos), key=lambda m: (-float(cost[m]), m))
        row[pos] = mbs
    return out


def _ref_ep_slot_replay(slots, group, rank_mb, mb_ring, durations) -> Replay:
    d = np.asarray(durations, dtype=np.float64)
    n_units = slots.shape[0]
    if group < 1 or n_units % group:
        raise ValueError(f"ep_slot_replay: group {group} does not divide the {n_units} HDP units")
    if d.shape != (len(mb_ring),) or not np.all(np.isfinite(d)) or np.any(d < 0):
        raise ValueError(f"ep_slot_replay: need {len(mb_ring)} finite durations >= 0")
    counts = [_ref_group_slots(slots, u, group) for u in range(n_units)]
    unit_of = np.repeat(np.arange(n_units), np.diff(np.asarray(rank_mb)))
    ready, busy = np.zeros(n_units), np.zeros(n_units)
    start, end = np.zeros(len(d)), np.zeros(len(d))
    for k in range(slots.shape[1]):
        parent = list(range(n_units // group))

        def find(b: int) -> int:
            while parent[b] != b:
                parent[b] = parent[parent[b]]
                b = parent[b]
            return b

        members: Dict[int, List[int]] = {}
        for u in range(n_units):
            m = int(slots[u, k])
            if m >= 0 and k < counts[u] and mb_ring[m] >= 0:
                members.setdefault(int(mb_ring[m]), []).append(u)
        for us in members.values():
            for u in us[1:]:
                parent[find(u // group)] = find(us[0] // group)
        comp: Dict[int, List[int]] = {}
        for u in range(n_units):
            if k < counts[u]:
                comp.setdefault(find(u // group), []).append(u)
        for us in comp.values():
            t0 = max(ready[u] for u in us)
            mbs = [int(slots[u, k]) for u in us if slots[u, k] >= 0]
            t1 = t0 + max((d[m] for m in mbs), default=0.0)
            for m in mbs:
                start[m], end[m] = t0, t1
                busy[unit_of[m]] += d[m]
            for u in us:
                ready[u] = t1
    step = float(ready.max()) if n_units else 0.0
    return Replay(start, end, ready, busy, step - busy, step)


# ---- inputs --------------------------------------------------------------------------------------

STRATEGIES = ("naive", "balanced", "pow2", "static", "pp-balance", "pp-lockstep")
WORLDS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def _plans(seed: int, n_per_world: int):
    rng = np.random.default_rng(seed)
    for world in WORLDS:
        for i in range(n_per_world):
            strategy = STRATEGIES[(i + world) % len(STRATEGIES)]
            cap = int(rng.integers(64, 400))
            k = int(rng.integers(1, 40))
            lengths = rng.integers(1, cap * min(world, 4), size=k)
            lengths[rng.random(k) < 0.6] //= 8
            lengths = np.maximum(lengths, 1)
            for attempt in range(2):  # then shorter documents (static: CP degree 1, which divides any world)
                try:
                    p = bytescale.plan(lengths.tolist(), world, capacity=cap, strategy=strategy,
                                       offload=bool(i % 2) and strategy != "static", pp=1 + (i % 3 == 2))
                except ValueError:
                    lengths = np.minimum(lengths, cap)
                    continue
                yield p, world
                break


def _random_schedule(rng: np.random.Generator, world: int):
    """A deadlock-free raw schedule: rings over random member sets in a global order, locals anywhere."""
    lists: List[List[int]] = [[] for _ in range(world)]
    groups = []
    for rid in range(int(rng.integers(0, 3 * world + 1))):
        size = int(rng.integers(2, world + 1)) if world > 1 else 1
        if size < 2:
            break
        members = sorted(rng.choice(world, size=size, replace=False).tolist())
        groups.append(members)
        for r in members:
            lists[r].append(len(groups) - 1)
    for r in range(world):
        for _ in range(int(rng.integers(0, 5))):
            lists[r].insert(int(rng.integers(0, len(lists[r]) + 1)), -1)
    rank_mb = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
    mb_ring = np.asarray([i for x in lists for i in x], dtype=np.int64)
    ring_grp = np.concatenate([[0], np.cumsum([len(g) for g in groups])]).astype(np.int64)
    grp = np.asarray([r for g in groups for r in g], dtype=np.int32)
    return rank_mb, mb_ring, ring_grp, grp


def _durations(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random, with ties and zeros (the sort's tie rule and empty slots matter)."""
    d = rng.uniform(0.1, 3.0, size=n)
    d[rng.random(n) < 0.3] = 1.5
    d[rng.random(n) < 0.1] = 0.0
    return d


def _groups(world: int) -> List[int]:
    return [g for g in range(1, world + 1) if world % g == 0]


def _check_schedule(world, rank_mb, mb_ring, ring_grp, grp, rng, plan=None) -> int:
    """Every C++ form equals the reference on one schedule (raw arrays; and the plan when given)."""
    sched = _C.planner.Schedule(world, rank_mb, mb_ring, ring_grp, grp)
    ref = _ref_schedule_lockstep(world, rank_mb, mb_ring, ring_grp, grp)
    np.testing.assert_array_equal(_C.planner.lockstep(sched), ref)
    if plan is not None:
        np.testing.assert_array_equal(_C.planner.lockstep(plan.raw), ref)
    checks = 0
    for cost_kind in ("plan", "random"):
        if cost_kind == "plan" and plan is None:
            continue
        cost = np.asarray(plan.raw.mb_cost) if cost_kind == "plan" else _durations(rng, len(mb_ring))
        sorted_ref = _ref_sort_local_slots(ref, mb_ring, cost)
        for g in _groups(world):
            got = _C.planner.group_lockstep(sched, g, cost)
            np.testing.assert_array_equal(got, sorted_ref)
            if cost_kind == "plan":
                np.testing.assert_array_equal(plan.group_lockstep(g), sorted_ref)
                np.testing.assert_array_equal(_C.planner.group_lockstep(plan.raw, g), sorted_ref)
            for gs in (0, g, g + 1):  # g + 1: a last block shorter than the group
                want = [_ref_group_slots(sorted_ref, u, gs) for u in range(world)]
                np.testing.assert_array_equal(_C.planner.group_slots(sorted_ref, gs), want)
            if cost_kind == "plan":
                np.testing.assert_array_equal(plan.group_slots(g),
                                              [_ref_group_slots(sorted_ref, u, g) for u in range(world)])
            for dur in (cost, _durations(rng, len(mb_ring))):
                want = _ref_ep_slot_replay(sorted_ref, g, rank_mb, mb_ring, dur)
                got = Replay._wrap(_C.planner.ep_replay(sched, g, dur, cost))
                for f in ("start", "end", "rank_finish", "rank_busy", "rank_idle"):
                    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
                assert got.step_time == want.step_time
                if cost_kind == "plan":
                    mine = plan.ep_replay(g, None if dur is cost else dur)
                    for f in ("start", "end", "rank_finish", "rank_busy", "rank_idle"):
                        np.testing.assert_array_equal(getattr(mine, f), getattr(want, f), err_msg=f)
                    assert mine.step_time == want.step_time
                checks += 1
    return checks


def test_plans_of_every_strategy_and_world_size_match_the_python_ports():
    rng = np.random.default_rng(3)
    checks = planned = 0
    for p, world in _plans(1, 8):
        r = p.raw
        planned += 1
        checks += _check_schedule(world, np.asarray(r.rank_mb), np.asarray(r.mb_ring), np.asarray(r.ring_grp),
                                  np.asarray(r.grp_ranks), rng, plan=p)
    assert planned > 50 and checks > 300, (planned, checks)


def test_random_hand_built_schedules_match_the_python_ports():
    rng = np.random.default_rng(17)
    checks = 0
    for world in WORLDS:
        for _ in range(12):
            checks += _check_schedule(world, *_random_schedule(rng, world), rng)
    assert checks > 300


def test_the_simulators_schedules_match_the_python_ports():
    from bytescale.sim.model import cost_model, model_shape
    from bytescale.sim.cluster import cluster
    from bytescale.sim.strategies import LOCKSTEP_STRATEGIES, STRATEGIES as SIM, build_schedule

    rng = np.random.default_rng(29)
    checks = 0
    shape = model_shape("llama-7b")
    for world in (2, 3, 8, 12):
        cl = cluster("h100-nvlink-ib400", world, 8)
        cm = cost_model(shape, cl)
        lengths = np.minimum(rng.lognormal(8.0, 1.5, size=60).astype(np.int64) + 1, 8192 * world // 2)
        plans: dict = {}
        for name in list(SIM) + list(LOCKSTEP_STRATEGIES):
            try:
                s = build_schedule(name, lengths, world, 8192, cm, plans)
            except ValueError:  # static: its CP degree does not divide the world
                continue
            checks += _check_schedule(world, s.rank_mb, s.mb_ring, s.ring_grp, s.grp_ranks, rng)
    assert checks > 100


def test_lockstep_micro_batches_match_the_python_ports():
    for p, world in _plans(7, 2):
        if p.pipelined:
            continue
        for g in [0] + _groups(world):
            slots = _ref_sort_local_slots(p.lockstep(), np.asarray(p.raw.mb_ring), np.asarray(p.raw.mb_cost)) \
                if g else p.lockstep()
            count = [_ref_group_slots(slots, u, g) for u in range(world)]
            base = np.asarray(p.raw.rank_mb)
            for u in range(world):
                mine = p.micro_batches(u)
                want = []
                for k, m in enumerate(slots[u].tolist()):
                    if k >= count[u]:
                        continue
                    if m < 0:
                        want.append(bytescale.planner.MicroBatchPlan(u, k))
                        continue
                    mb = mine[m - int(base[u])]
                    last = bool(mb.ring) and all(k == count[r] - 1 for r in mb.ring)
                    want.append(replace(mb, index=k, ring_is_last_on_all=last))
                assert p.lockstep_micro_batches(u, group=g) == want


def test_errors_name_the_problem():
    p = bytescale.plan([30, 20, 10, 40, 5, 25, 15], 3, capacity=60)
    with pytest.raises(ValueError, match="group 2 does not divide the 3 HDP units"):
        p.group_lockstep(2)
    with pytest.raises(ValueError, match="group 2 does not divide the 3 HDP units"):
        p.ep_replay(2)
    with pytest.raises(ValueError, match="finite durations"):
        p.ep_replay(1, np.full(len(p.raw.mb_cost), np.nan))
    sched = _C.planner.Schedule(p.raw)  # a plan's own arrays: its costs are the defaults
    assert _C.planner.replay(sched).step_time == p.replay().step_time
    raw = _C.planner.Schedule(3, p.raw.rank_mb, p.raw.mb_ring, p.raw.ring_grp, p.raw.grp_ranks)
    with pytest.raises(ValueError, match="give durations"):
        _C.planner.replay(raw)
    with pytest.raises(ValueError, match="give cost"):
        _C.planner.group_lockstep(raw, 1)
    with pytest.raises(ValueError, match="rank_mb needs world_size"):
        _C.planner.Schedule(2, p.raw.rank_mb, p.raw.mb_ring, p.raw.ring_grp, p.raw.grp_ranks)
    with pytest.raises(ValueError, match="outside"):
        _C.planner.Schedule(3, p.raw.rank_mb, np.full(len(p.raw.mb_ring), 7), p.raw.ring_grp, p.raw.grp_ranks)
    with pytest.raises(ValueError, match="no pipeline slots"):
        _C.planner.pipeline_replay(raw, np.zeros(len(p.raw.mb_ring)), np.zeros(len(p.raw.mb_ring)),
                                   np.zeros(len(p.raw.mb_ring)))
