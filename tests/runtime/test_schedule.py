"""The step schedule (bytescale/runtime/schedule.py), single process, over many real plans.

For world sizes 1, 2, 3, 5, 8, strategies and seeded batches: a flat schedule is the plan's order,
each forward then its backward; a lockstep schedule gives every member of a block the same number
of entries, runs every one of the rank's micro-batches exactly once, keeps a ring's members in one
slot, and agrees with ``Plan.lockstep_micro_batches`` (the planner's own view of the slots); a 1F1B
schedule is the stage's 1F1B order of the plan's slots, and padded it runs every slot of the block
with each micro-batch at its plan slot. ``schedule_kind`` picks the kind from the mesh and model.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import bytescale
from bytescale.runtime.schedule import (FLAT, LOCKSTEP, ONE_F_ONE_B, ScheduleKind, build_schedule,
                                        pipeline_order, schedule_kind)


def _plans(pp: int = 1):
    rng = random.Random(7 + pp)
    strategies = ("pp-balance", "pp-lockstep", "balanced") if pp > 1 else ("balanced", "naive", "pow2", "static")
    for world in (1, 2, 3, 5, 8):
        for strategy in strategies:
            if strategy == "static" and world in (3, 5):
                continue
            for _ in range(3):
                lengths = [rng.choice([1, 7, 30, 90, 150, 260, 333]) for _ in range(rng.randint(1, 14))]
                lengths = [n for n in lengths if n <= 160 * world] or [5]
                yield world, bytescale.plan(lengths, world, capacity=160, strategy=strategy, pp=pp)


def _check_ops(sched):
    fwd = [j for k, j in sched.ops if k == "F"]
    bwd = [j for k, j in sched.ops if k == "B"]
    assert sorted(fwd) == sorted(bwd) == list(range(len(sched)))
    done = set()
    for k, j in sched.ops:  # a backward after its forward
        assert (k == "F") != (j in done) or k == "F" and j not in done
        done.add(j)


def test_flat_is_the_plans_order():
    for world, plan in _plans():
        for r in range(world):
            s = build_schedule(plan, r, ScheduleKind(FLAT))
            assert s.entries == tuple(plan.micro_batches(r))
            assert s.ops == tuple(op for j in range(len(s)) for op in (("F", j), ("B", j)))
            assert s.padding == 0


@pytest.mark.parametrize("group", [0, 1, 2])
def test_lockstep_blocks_run_the_same_slots(group):
    for world, plan in _plans():
        if group and world % group:
            with pytest.raises(ValueError, match="does not divide"):
                build_schedule(plan, 0, ScheduleKind(LOCKSTEP, group=group))
            continue
        scheds = [build_schedule(plan, r, ScheduleKind(LOCKSTEP, group=group)) for r in range(world)]
        block = group or world
        for b in range(0, world, block):
            assert len({len(scheds[r]) for r in range(b, b + block)}) == 1
        for r, s in enumerate(scheds):
            _check_ops(s)
            mine = plan.micro_batches(r)
            assert sorted(i for i in s.source if i >= 0) == list(range(len(mine)))
            for e, i in zip(s.entries, s.source):
                assert (i < 0) == e.is_empty and e.slot == s.entries.index(e)
                if i >= 0:
                    assert e.documents == mine[i].documents
            # the planner's own view of the slots
            want = plan.lockstep_micro_batches(r, group=group)
            assert [m.documents for m in want] == [m.documents for m in s.entries]
            assert [m.ring_is_last_on_all for m in want] == [m.ring_is_last_on_all for m in s.entries]
        for r, s in enumerate(scheds):  # a ring's members hold it in one slot
            for e in s.entries:
                for q in e.ring:
                    assert any(x.ring_id == e.ring_id and x.slot == e.slot for x in scheds[q].entries)


@pytest.mark.parametrize("pp", [2, 3])
def test_1f1b_is_the_stage_order_of_the_plans_slots(pp):
    for world, plan in _plans(pp):
        for stage in range(pp):
            for r in range(world):
                slots = plan.micro_batch_slots(r)
                s = build_schedule(plan, r, ScheduleKind(ONE_F_ONE_B, stages=pp, stage=stage))
                assert [e.slot for e in s.entries] == slots
                assert list(s.ops) == pipeline_order(slots, pp, stage)
                _check_ops(s)
            for group in (0, 1):
                kind = ScheduleKind(ONE_F_ONE_B, group=group, stages=pp, stage=stage, padded=True)
                scheds = [build_schedule(plan, r, kind) for r in range(world)]
                if not group:
                    assert len({len(x) for x in scheds}) == 1
                for r, s in enumerate(scheds):
                    assert [e.slot for e in s.entries] == list(range(len(s)))
                    assert [s.entries[k].slot for k in range(len(s)) if s.source[k] >= 0] == plan.micro_batch_slots(r)
                    assert list(s.ops) == pipeline_order(list(range(len(s))), pp, stage)
                    _check_ops(s)


def test_a_plan_for_another_depth_and_bad_kinds_are_refused():
    plan = bytescale.plan([30, 90, 7], 2, capacity=160, strategy="pp-balance", pp=2)
    with pytest.raises(ValueError, match="3"):
        build_schedule(plan, 0, ScheduleKind(ONE_F_ONE_B, stages=3, stage=0))
    with pytest.raises(ValueError, match="kind must be one of"):
        ScheduleKind("gpipe")
    with pytest.raises(ValueError, match="needs pp > 1"):
        ScheduleKind(ONE_F_ONE_B)
    with pytest.raises(ValueError, match="needs the step's plan"):
        build_schedule(None, 0, ScheduleKind(LOCKSTEP), micro_batches=())


def test_schedule_kind_is_decided_from_the_mesh_and_the_model():
    def mesh(pp=1, ep=1, stage=0):
        return SimpleNamespace(pp=pp, ep=ep, stage=stage)

    def model(fsdp=False, ep_size=None):
        return SimpleNamespace(fsdp=fsdp, module=SimpleNamespace(ep_size=ep_size))

    assert schedule_kind(mesh(), model()) == ScheduleKind(FLAT)
    assert schedule_kind(None, model()) == ScheduleKind(FLAT)
    assert schedule_kind(mesh(), model(fsdp=True)) == ScheduleKind(LOCKSTEP, group=0)
    assert schedule_kind(mesh(ep=2), model(ep_size=2)) == ScheduleKind(LOCKSTEP, group=2)
    assert schedule_kind(mesh(ep=2), model(fsdp=True, ep_size=2)) == ScheduleKind(LOCKSTEP, group=0)
    assert schedule_kind(mesh(pp=2, stage=1), model()) == ScheduleKind(ONE_F_ONE_B, stages=2, stage=1)
    assert schedule_kind(mesh(pp=2, ep=2), model(ep_size=2)) == \
        ScheduleKind(ONE_F_ONE_B, group=2, stages=2, padded=True)
    assert schedule_kind(mesh(pp=3, stage=2), model(fsdp=True, ep_size=2)) == \
        ScheduleKind(ONE_F_ONE_B, group=0, stages=3, stage=2, padded=True)
