"""Offloading under the step's clock through the Python face (csrc/planner/offload_rule.h):
``bytescale.plan(..., offload=True)`` never replays longer than without offloading, the paper's
literal Eq. 3 stays reachable as ``offload_rule="paper-eq3"``, ``Plan.ring_reasons()`` names the
constraint behind every ring, and bad input is a clear error."""
from __future__ import annotations

import numpy as np
import pytest

import bytescale
from bytescale import _C
from bytescale.config import PlannerConfig
from bytescale.planner import Plan

HDP = ("naive", "pow2", "balanced")


def _heavy_tail(rng, n, cap, longest):
    x = rng.uniform(size=n)
    short = rng.integers(1, cap, n)
    mid = rng.integers(cap, 4 * cap, n)
    long_ = (np.sqrt(rng.uniform(size=n)) * longest).astype(np.int64) + 1
    return np.where(x < 0.75, short, np.where(x < 0.95, mid, long_)).astype(np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_offload_never_lengthens_the_step(seed):
    rng = np.random.default_rng(seed)
    world = int(rng.choice([1, 2, 3, 5, 16, 37, 256]))
    cap = int(rng.integers(256, 4096))
    lengths = _heavy_tail(rng, int(rng.integers(5, 300)), cap, cap * world)
    for strategy in HDP:
        without = bytescale.plan(lengths, world_size=world, capacity=cap, strategy=strategy)
        with_ = bytescale.plan(lengths, world_size=world, capacity=cap, strategy=strategy, offload=True,
                               verify=True)
        assert with_.makespan <= without.makespan * (1 + 1e-9), (strategy, world, cap)
        reasons = with_.ring_reasons()
        assert len(reasons) == len(lengths)
        assert {r["reason"] for r in reasons} <= {"local", "memory", "copy-hiding", "step", "shape"}


def test_paper_eq3_is_the_long_ring_the_step_rule_avoids():
    """A 2M-token sequence among 32M tokens of short ones, 1,024 ranks of 8K tokens (LLaMA-7B-like
    default cost model): the literal Eq. 3 shards it over far fewer ranks than 256 and the step
    grows several-fold; the step rule keeps a ring that does not lengthen the step and says so."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[2 << 20], rng.integers(512, 8192, 8000)]).astype(np.int64)
    kw = dict(world_size=1024, capacity=8192, strategy="naive")
    base = bytescale.plan(lengths, **kw)
    eq3 = bytescale.plan(lengths, offload=True, offload_rule="paper-eq3", verify=True, **kw)
    step = bytescale.plan(lengths, offload=True, verify=True, **kw)
    assert eq3.ring_sizes()[0] < 64 and eq3.makespan > 2 * base.makespan
    assert step.makespan <= base.makespan * (1 + 1e-9)
    why = step.ring_reasons()[0]
    assert why["reason"] == "step" and why["ranks"] >= 128
    assert why["floor_memory"] == 256 and why["floor_offload"] == eq3.ring_sizes()[0]
    why = eq3.ring_reasons()[0]
    assert why["reason"] in ("memory", "copy-hiding") and why["ratio"] > 0
    # the same through PlannerConfig
    cfg = PlannerConfig(capacity=8192, strategy="naive", offload=True, offload_rule="paper-eq3")
    assert cfg.plan(lengths, 1024).makespan == pytest.approx(eq3.makespan)


def test_reasons_without_offloading_and_shapes():
    lengths = [5000, 300, 200]
    p = bytescale.plan(lengths, world_size=8, capacity=1000, strategy="pow2")
    r = p.ring_reasons()
    assert [x["reason"] for x in r] == ["shape", "local", "local"]
    assert r[0]["ranks"] == 8 and r[0]["floor_memory"] == 5 and r[0]["ratio"] == 0.0
    p = bytescale.plan(lengths, world_size=8, capacity=1000, strategy="naive")
    assert p.ring_reasons()[0]["reason"] == "memory"
    s = bytescale.plan([1000] * 4, world_size=4, capacity=500, strategy="static")
    assert {x["reason"] for x in s.ring_reasons()} == {"memory"}
    s = bytescale.plan([100] * 4, world_size=4, capacity=500, strategy="static", static_cp=2)
    assert {x["reason"] for x in s.ring_reasons()} == {"shape"}


def test_errors_are_clear():
    with pytest.raises(ValueError, match="offload_rule"):
        bytescale.plan([10], world_size=1, capacity=10, offload=True, offload_rule="eq3")
    with pytest.raises(ValueError, match="offload_rule"):
        PlannerConfig(capacity=10, offload=True, offload_rule="literal")
    p = bytescale.plan([10, 20], world_size=2, capacity=10)
    with pytest.raises(ValueError, match="does not carry its planner options"):
        Plan.from_bytes(p.to_bytes()).ring_reasons()
    opts = _C.planner.PlanOptions()
    opts.world_size, opts.capacity = 2, 10
    with pytest.raises(ValueError, match="sequences"):
        _C.planner.explain_rings(p.raw, [10], opts)
    with pytest.raises(ValueError, match="unknown offload rule"):
        opts.offload_rule = "eq3"
