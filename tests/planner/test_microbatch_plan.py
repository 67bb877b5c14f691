"""The micro-batch contract: built from the plan's arrays, consistent with the plan and the zig-zag
layout, serialisable, and validated."""
from __future__ import annotations

import numpy as np
import pytest

from bytescale.attention import zigzag
from bytescale.planner import DocRef, MicroBatchPlan, Plan, plan

LENGTHS = [211, 97, 13, 7, 45, 3, 130, 31, 64, 9, 150, 22, 5, 77, 1, 40, 333]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_micro_batch_plans_cover_the_batch_once(world):
    p = plan(LENGTHS, world_size=world, capacity=max(90, -(-max(LENGTHS) // world)))
    ids = [100 + 7 * i for i in range(len(LENGTHS))]
    held = np.zeros(len(LENGTHS), dtype=np.int64)
    rings = {}
    for r in range(world):
        mbs = p.micro_batches(r, ids)
        assert [m.index for m in mbs] == list(range(len(mbs)))
        for m in mbs:
            assert m.rank == r and m.num_tokens == m.layout().num_tokens
            for d in m.documents:
                assert d.sample_id == ids[d.batch_pos] and d.length == LENGTHS[d.batch_pos]
            for d, a, b in m.token_ranges():
                held[d.batch_pos] += b - a
            if m.is_ring:
                assert m.ring[m.ring_pos] == r and m.ring_id >= 0
                rings.setdefault(m.ring_id, set()).add((m.ring, m.sharded[0].batch_pos, m.ring_pos))
                assert m.num_tokens == zigzag.local_tokens(m.sharded[0].length, len(m.ring), m.ring_pos)
    assert held.tolist() == LENGTHS  # every token of every document exactly once
    for members in rings.values():  # every member of a ring agrees on it, positions 0..n-1
        assert len({(g, bp) for g, bp, _ in members}) == 1
        assert sorted(pos for _, _, pos in members) == list(range(len(next(iter(members))[0])))


def test_round_trip_through_bytes_and_deserialised_plan():
    p = plan(LENGTHS, world_size=3, capacity=120)
    q = Plan.from_bytes(p.to_bytes())  # lengths recovered from the segments
    assert q.lengths.tolist() == LENGTHS
    for r in range(3):
        a, b = p.micro_batches(r, range(len(LENGTHS))), q.micro_batches(r, range(len(LENGTHS)))
        assert a == b
        for m in a:
            assert MicroBatchPlan.from_bytes(m.to_bytes()) == m


def test_bind_and_validation():
    m = MicroBatchPlan(rank=2, index=0, sharded=(DocRef(1, -1, 50),), ring=(4, 2), ring_pos=1, ring_id=0)
    assert m.bind([7, 9]).sharded[0].sample_id == 9
    with pytest.raises(ValueError, match="not at position"):
        MicroBatchPlan(rank=3, index=0, sharded=(DocRef(1, -1, 50),), ring=(4, 2), ring_pos=1)
    with pytest.raises(ValueError, match="no ring"):
        MicroBatchPlan(rank=0, index=0, sharded=(DocRef(1, -1, 50),))
    with pytest.raises(ValueError, match="offload_ratio"):
        MicroBatchPlan(rank=0, index=0, offload_ratio=1.5)
    with pytest.raises(ValueError, match="format"):
        MicroBatchPlan.from_bytes(b'{"rank": 0}')
    with pytest.raises(ValueError, match="not a serialised"):
        MicroBatchPlan.from_bytes(b"\xff\x00")


def test_python_zigzag_matches_the_cpp_planner():
    """bytescale.attention.zigzag (Python) and csrc/common/zigzag.h (the planner's seg_tokens)."""
    for world in (2, 3, 5, 7):
        lengths = list(range(5, 4 * world + 1, 2))  # all longer than the capacity: all sharded
        p = plan(lengths, world_size=world, capacity=4, strategy="naive")
        raw = p.raw
        assert min(raw.seg_ring_size) > 1
        for k in range(len(raw.seg_seq)):
            s, n, pos = int(lengths[raw.seg_seq[k]]), int(raw.seg_ring_size[k]), int(raw.seg_ring_pos[k])
            assert raw.seg_tokens[k] == zigzag.local_tokens(s, n, pos)


@pytest.mark.parametrize("strategy", ["naive", "balanced", "pow2", "static"])
@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_ring_is_last_on_all_matches_every_members_last_micro_batch(strategy, world):
    """What HybridDataParallel reads to decide whether gradient sync may overlap the last backward
    (issue 21, finding 1): a ring micro-batch whose every member runs it last. Checked against
    the members' micro-batch lists, over random batches; the naive strategy produces rings that
    are last on one member but not on another (the deadlock shape on one NCCL stream). The static
    DP x CP baseline's CP groups run the same micro-batches: its last ring ends every member."""
    rng = np.random.default_rng(world)
    seen = {True: 0, False: 0}
    for _ in range(40):
        # static: a CP degree dividing the world (2, else the world), sequences it can hold
        cp = (2 if world % 2 == 0 else world) if strategy == "static" else None
        hi = 100 * cp if cp else 400
        lengths = rng.integers(1, hi, size=int(rng.integers(3, 20))).tolist()
        try:
            kw = {"static_cp": cp} if cp else {}
            p = plan(lengths, world_size=world, capacity=100, strategy=strategy, **kw)
        except ValueError:
            continue
        mbs = [p.micro_batches(r) for r in range(world)]
        for r in range(world):
            for m in mbs[r]:
                want = m.is_ring and all(mbs[x] and mbs[x][-1].ring_id == m.ring_id for x in m.ring)
                assert m.ring_is_last_on_all == want, (lengths, r, m)
                if m.is_ring and m.index == len(mbs[r]) - 1:
                    seen[want] += 1
        for r in range(world):  # lockstep slots: members meet in one slot, the last ends them all
            for m in p.lockstep_micro_batches(r):
                if m.is_ring:
                    assert m.ring_is_last_on_all == (m.index == p.lockstep().shape[1] - 1)
    if strategy == "static":
        assert seen[True] > 0 and seen[False] == 0, seen
    elif world >= 3:  # (at 2 ranks these batches never end a rank on a ring)
        assert seen[True] > 0
        if strategy != "balanced":
            assert seen[False] > 0, "no plan with a ring that is last on one member only"


def test_ring_is_last_on_all_survives_bytes_and_is_type_checked():
    m = MicroBatchPlan(rank=1, index=0, sharded=(DocRef(0, 5, 40),), ring=(0, 1), ring_pos=1, ring_id=0,
                       ring_is_last_on_all=True)
    assert MicroBatchPlan.from_bytes(m.to_bytes()) == m
    bad = m.to_bytes().replace(b'"ring_is_last_on_all":true', b'"ring_is_last_on_all":1')
    with pytest.raises(ValueError, match="ring_is_last_on_all"):
        MicroBatchPlan.from_bytes(bad)
