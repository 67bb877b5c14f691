"""bytescale.parallel_dims: the parallel sizes stated once (grid, coordinates, unit maps) and the one
compatibility matrix, which the mesh, ParallelConfig and the trainer's options all use."""
from __future__ import annotations

import itertools

import pytest

from bytescale.config import ParallelConfig
from bytescale.parallel_dims import REFUSED, ParallelDims, check_composition
from bytescale.planner import UnitMap


@pytest.mark.parametrize("world, pp, tp", [(1, 1, 1), (5, 1, 1), (6, 2, 3), (12, 3, 2), (8, 2, 2)])
def test_grid_coords_and_units_agree_with_the_layout(world, pp, tp):
    d = ParallelDims(world, pp=pp, tp=tp)
    assert d.hdp == world // (pp * tp)
    flat = [r for stage in d.grid for unit in stage for r in unit]
    assert flat == list(range(world))  # TP innermost, then HDP, then stages
    for r in range(world):
        p, h, t = d.coords(r)
        assert d.grid[p][h][t] == r
    for p in range(pp):
        assert d.units(p) == UnitMap(d.grid[p])


def test_every_refused_pair_is_refused_everywhere_with_the_same_words():
    for (a, b), why in REFUSED.items():
        kw = {"pp": 2 if "pp" in (a, b) else 1, "tp": 2 if "sp" in (a, b) else 1, "ep": 2 if "ep" in (a, b) else 1,
              "fsdp": "fsdp" in (a, b), "sp": "sp" in (a, b)}
        with pytest.raises(ValueError, match="is not supported: " + why.split(" (")[0]):
            check_composition(**kw)
        with pytest.raises(ValueError, match="is not supported"):
            ParallelDims(8, **kw)
        with pytest.raises(ValueError, match="ParallelConfig: .* is not supported"):
            ParallelConfig(pp=kw["pp"], tp=kw["tp"], ep=kw["ep"], fsdp=kw["fsdp"], sequence_parallel=kw["sp"])


def test_every_other_combination_composes():
    """Brute force over the features: exactly the pairs in REFUSED are refused."""
    for pp, tp, ep, fsdp, sp in itertools.product((1, 2), (1, 2), (1, 2), (False, True), (False, True)):
        if sp and tp == 1:
            continue
        on = {"pp": pp > 1, "tp": tp > 1, "ep": ep > 1, "fsdp": fsdp, "sp": sp}
        refused = any(on[a] and on[b] for a, b in REFUSED)
        try:
            dims = ParallelConfig(pp=pp, tp=tp, ep=ep, fsdp=fsdp, sequence_parallel=sp).dims(16)
        except ValueError:
            assert refused, (pp, tp, ep, fsdp, sp)
        else:
            assert not refused and dims.world == 16 and dims.hdp == 16 // (pp * tp)


@pytest.mark.parametrize("kw, match", [
    (dict(world=3, tp=2), "world of 3 ranks is not divisible by pp=1 x tp=2 = 2"),
    (dict(world=12, tp=2, ep=4), "ep=4 does not divide the 6 HDP units"),
    (dict(world=4, tp=0), "tp must be an integer >= 1, got 0"),
    (dict(world=4, pp=True), "pp must be an integer >= 1, got True"),
    (dict(world=0), "world must be an integer >= 1"),
    (dict(world=4, sp=True), r"sequence parallelism \(sp\) needs tp > 1"),
])
def test_bad_sizes_name_the_values(kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kw)


def test_coordinates_outside_the_world_are_clear_errors():
    d = ParallelDims(4, pp=2)
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        d.coords(4)
    with pytest.raises(ValueError, match="stage 2 is outside the 2 pipeline stages"):
        d.units(2)


def test_a_plan_from_dims_is_the_plan_of_its_units_and_carries_them():
    """``plan(lengths, dims)`` plans one stage's units at the dims' depth: the same plan as from the
    unit map and pp stated by hand, and it carries the dims."""
    from bytescale.planner import plan

    lengths = [900, 17, 333, 2048, 5, 640, 77, 1200]
    for world, pp, tp, strategy in [(5, 1, 1, "balanced"), (12, 2, 3, "pp-balance"), (8, 1, 2, "naive")]:
        d = ParallelDims(world, pp=pp, tp=tp)
        got = plan(lengths, d, capacity=1100, strategy=strategy)
        ref = plan(lengths, d.units(0) if tp > 1 else d.hdp, capacity=1100, strategy=strategy, pp=pp)
        assert bytes(got.to_bytes()) == bytes(ref.to_bytes()) and got.units == ref.units
        assert got.dims is d and ref.dims is None
    with pytest.raises(ValueError, match="pp=3 contradicts the ParallelDims' pp=2"):
        plan(lengths, ParallelDims(4, pp=2), capacity=512, pp=3)
