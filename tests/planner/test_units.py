"""HDP units in the plan: the map from unit to global ranks, rings per TP index, bad maps."""
from __future__ import annotations

import pytest

import bytescale
from bytescale.planner import UnitMap
from bytescale.models.parallel import check_tensor_parallel

LENGTHS = [300, 97, 13, 7, 45, 3, 130, 31, 64, 9, 150, 22, 5, 77, 1, 40, 211]


def test_grid_is_tp_innermost():
    u = UnitMap.grid(hdp=3, tp=2)
    assert u.units == ((0, 1), (2, 3), (4, 5))
    assert (u.num_units, u.tp) == (3, 2)
    assert u.locate(5) == (2, 1)
    assert u.ring([2, 0], 1) == (5, 1)
    assert u.hdp_group(0) == (0, 2, 4)
    assert UnitMap.grid(2, 2, first_rank=4).units == ((4, 5), (6, 7))  # a second pipeline stage
    assert UnitMap.identity(3).is_identity and not u.is_identity
    assert UnitMap.from_list(u.to_list()) == u


@pytest.mark.parametrize("units, match", [
    ([], "at least one unit"),
    ([[0, 1], [2]], "unit 1 has 1 ranks"),
    ([[0, 1], [1, 2]], "rank 1 is in unit 0 and in unit 1"),
    ([[0, -1]], "negative rank"),
])
def test_bad_unit_maps_name_the_problem(units, match):
    with pytest.raises(ValueError, match=match):
        UnitMap.from_list(units)


@pytest.mark.parametrize("hdp, tp", [(2, 2), (3, 2), (2, 3)])
def test_every_tp_rank_of_a_unit_runs_the_unit_micro_batches(hdp, tp):
    units = UnitMap.grid(hdp, tp)
    plan = bytescale.plan(LENGTHS, units, capacity=110 if hdp == 3 else 160)
    assert plan.world_size == hdp and plan.units == units
    plain = bytescale.plan(LENGTHS, hdp, capacity=110 if hdp == 3 else 160)
    for u in range(hdp):
        ref = plain.micro_batches(u)
        for t in range(tp):
            rank = units.rank(u, t)
            mine = plan.micro_batches(rank)
            assert [m.documents for m in mine] == [m.documents for m in ref]
            for m, r in zip(mine, ref):
                assert m.rank == rank and m.ring == units.ring(r.ring, t) and m.ring_pos == r.ring_pos
                assert all(x % tp == t for x in m.ring)
            lock = plan.lockstep_micro_batches(rank)
            assert [m.documents for m in lock] == [m.documents for m in plain.lockstep_micro_batches(u)]
    assert any(m.ring for u in range(hdp) for m in plain.micro_batches(u)), "no ring to translate"


def test_plan_for_another_mesh_is_a_clear_error():
    plan = bytescale.plan(LENGTHS, UnitMap.grid(2, 2), capacity=160)
    with pytest.raises(ValueError, match="rank 7 is in no HDP unit"):
        plan.micro_batches(7)
    with pytest.raises(ValueError, match="plan is for 2 HDP units but the unit map has 3"):
        plan.with_units(UnitMap.grid(3, 2))


@pytest.mark.parametrize("heads, kv, tp, match", [
    (4, 2, 8, "TP degree 8 is larger than the 4 attention heads"),
    (6, 2, 4, "TP degree 4 does not divide the 6 attention heads"),
    (12, 4, 6, "TP degree 6 and the 4 KV heads"),
])
def test_tp_that_does_not_fit_the_heads_names_the_values(heads, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(heads, kv, tp)


def test_tp_that_fits():
    check_tensor_parallel(4, 2, 2)   # KV heads sharded
    check_tensor_parallel(4, 1, 4)   # KV head replicated on every rank
    check_tensor_parallel(32, 8, 16)


def test_identity_and_grid_maps_are_shared_per_size_and_equal_to_built_ones():
    """The planner takes ``UnitMap.identity(world)`` on every call: one immutable map per size
    (building 16,384 units took ~12 ms a call), equal to one built unit by unit; bad sizes still
    raise, and are not remembered."""
    assert UnitMap.identity(16384) is UnitMap.identity(16384)
    assert UnitMap.identity(5) == UnitMap(tuple((r,) for r in range(5)))
    assert UnitMap.grid(3, 2, first_rank=6) is UnitMap.grid(3, 2, first_rank=6)
    assert UnitMap.grid(3, 2, first_rank=6).units == ((6, 7), (8, 9), (10, 11))
    assert UnitMap.identity(5).locate(3) == (3, 0)
    for _ in range(2):
        with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
            UnitMap.identity(0)
        with pytest.raises(ValueError, match="negative rank"):
            UnitMap.grid(2, 2, first_rank=-4)
