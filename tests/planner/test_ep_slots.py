"""The expert-parallel slot rule (``Plan.group_lockstep``) and its pricing (``Plan.ep_replay``).

Under expert parallelism every rank of an EP group (a block of consecutive HDP units) joins the
all-to-alls of every micro-batch, so the block's units run the same number of slots; a ring's
members meet in one slot (no cycle between the rings of a slot and the all-to-alls of another);
every real micro-batch runs exactly once, rings in the plan's order. Checked on random batches
against the plan itself; the pricing against independent sums in the two cases that have one (one
block: every slot costs its slowest micro-batch; blocks of one unit without rings: the plain
per-unit sums).
"""
from __future__ import annotations

import numpy as np
import pytest

import bytescale


def _random_plans(n: int = 40):
    rng = np.random.default_rng(5)
    for _ in range(n):
        world = int(rng.choice([2, 4, 6, 8]))
        cap = int(rng.integers(50, 200))
        k = int(rng.integers(1, 14))
        lengths = rng.integers(1, cap * min(world, 3), size=k).tolist()
        yield bytescale.plan(lengths, world, capacity=cap), world


@pytest.mark.parametrize("group", [1, 2, 4])
def test_group_lockstep_is_a_hang_free_schedule_of_the_plan(group):
    checked = 0
    for plan, world in _random_plans():
        if world % group:
            with pytest.raises(ValueError, match=f"group {group} does not divide the {world} HDP units"):
                plan.group_lockstep(group)
            continue
        checked += 1
        slots, counts = plan.group_lockstep(group), plan.group_slots(group)
        raw = plan.raw
        ring_of = np.asarray(raw.mb_ring)
        rank_mb = np.asarray(raw.rank_mb)
        for b in range(0, world, group):
            block = list(range(b, b + group))
            assert len({int(counts[u]) for u in block}) == 1  # the EP group agrees on its slot count
            c = int(counts[b])
            if c:  # trimmed: the block's last slot holds a real micro-batch of the block
                assert (slots[b:b + group, c - 1] >= 0).any()
            assert (slots[b:b + group, c:] < 0).all()
        ring_slot = {}
        for u in range(world):
            mine = [int(m) for m in slots[u, :counts[u]] if m >= 0]
            assert sorted(mine) == list(range(rank_mb[u], rank_mb[u + 1]))  # each micro-batch once
            rings = [int(ring_of[m]) for m in mine if ring_of[m] >= 0]
            planned = [int(ring_of[m]) for m in range(rank_mb[u], rank_mb[u + 1]) if ring_of[m] >= 0]
            assert rings == planned  # rings keep the plan's order
            for k in range(counts[u]):
                m = int(slots[u, k])
                if m >= 0 and ring_of[m] >= 0:
                    assert ring_slot.setdefault(int(ring_of[m]), k) == k  # ring members meet in one slot
            got = plan.lockstep_micro_batches(u, group=group)
            assert len(got) == counts[u] and [m.index for m in got] == list(range(counts[u]))
            assert sum(not m.is_empty for m in got) == rank_mb[u + 1] - rank_mb[u]
    assert checked


def test_ep_replay_one_block_costs_each_slot_its_slowest_micro_batch():
    for plan, world in _random_plans(20):
        d = np.random.default_rng(world).uniform(0.5, 2.0, size=len(plan.raw.mb_cost))
        slots = plan.group_lockstep(world)
        c = int(plan.group_slots(world)[0])
        want = sum(max((d[m] for m in slots[:, k] if m >= 0), default=0.0) for k in range(c))
        assert plan.ep_replay(world, d).step_time == pytest.approx(want, rel=1e-12)
        # (not compared with replay(): lockstep may move local micro-batches past a ring, which
        # can end a step sooner than the plan's own order)


def test_ep_replay_blocks_of_one_unit_without_rings_are_the_plain_sums():
    plan = bytescale.plan([30, 20, 10, 40, 5, 25, 15], 3, capacity=60)
    assert not plan.ring_sizes()
    d = np.arange(1, len(plan.raw.mb_cost) + 1, dtype=np.float64)
    rank_mb = np.asarray(plan.raw.rank_mb)
    sums = [d[rank_mb[u]:rank_mb[u + 1]].sum() for u in range(3)]
    r = plan.ep_replay(1, d)
    assert r.step_time == pytest.approx(max(sums)) == pytest.approx(plan.replay(d).step_time)
    with pytest.raises(ValueError, match="finite durations"):
        plan.ep_replay(1, d[:-1])


def test_lockstep_on_raw_arrays_equals_the_plans_lockstep():
    for plan, world in _random_plans(25):
        r = plan.raw
        sched = bytescale._C.planner.Schedule(world, r.rank_mb, r.mb_ring, r.ring_grp, r.grp_ranks)
        np.testing.assert_array_equal(bytescale._C.planner.lockstep(sched), plan.lockstep())
