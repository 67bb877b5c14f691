"""``bytescale.train --tp 2``: HDP over units of two TP ranks, through the real entry point (its ``main`` in real processes with torchrun's environment: train_launch.py),
and checkpoints that reshard across TP degrees.

A: 4 ranks as HDP 2 x TP 2, 6 steps, a checkpoint every 2 steps (the uninterrupted run).
B: 3 ranks as HDP 3 x TP 1 continue from A's step 2 and stop at step 4 (DCP reshards the TP-sharded
   parameters and optimizer state into replicated ones; the planner plans 3 units instead of 2).
C: 4 ranks as HDP 2 x TP 2 continue from B's step 4 to the end (and back).
F: 4 ranks as HDP 2 x TP 2 with FSDP2 over the HDP dimension, from scratch.
Every step of B, C and F sees A's global batch and A's loss and gradient norm (float32: 1e-5).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from train_launch import TINY_RUN, assert_same_steps, logged_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1800)]

STEPS = 6
COMMON = TINY_RUN + ["--steps", STEPS]


def _run(d: Path, name: str, nproc: int, *extra, torchrun: bool = False) -> dict:
    return logged_run(d, name, nproc, COMMON + list(extra), torchrun=torchrun)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    out = {"A": _run(d, "A", 4, "--tp", "2", "--checkpoint-dir", d / "ckA", "--save-every", "2")}
    out["B"] = _run(d, "B", 3, "--checkpoint-dir", d / "ckB", "--save-every", "2", "--stop-after", "4",
                    "--resume-from", d / "ckA" / "step-00000002")
    out["C"] = _run(d, "C", 4, "--tp", "2", "--checkpoint-dir", d / "ckC",
                    "--resume-from", d / "ckB" / "step-00000004")
    out["F"] = _run(d, "F", 4, "--tp", "2", "--fsdp")
    return out




def test_tp2_trains_and_plans_units(runs):
    """Slow: the module's fixture launches the real entry point (torchrun, 4 processes) for the
    TP runs this module's tests compare."""
    a = runs["A"]
    assert "4 ranks on cpu (hdp 2 x tp 2)" in a["out"]
    m = a["metrics"]
    assert m[-1]["loss"] < m[0]["loss"]
    # balanced names the plan it returns: its own, or pow2's when that replays shorter
    assert all(r["plan"].startswith(("plan[balanced] units=2 x tp=2", "plan[pow2] units=2 x tp=2")) for r in m), \
        [r["plan"] for r in m]
    assert any(r["ring_sizes"] for r in m), "no document was sharded over a ring of units"


def test_resume_tp2_to_tp1_and_back_on_the_same_batches_and_losses(runs):
    assert_same_steps(runs["A"], runs["B"], range(2, 4))
    assert "hdp 2 x tp 2; now 3, hdp 3 x tp 1" in runs["B"]["out"]
    assert_same_steps(runs["A"], runs["C"], range(4, STEPS))
    assert "hdp 3 x tp 1; now 4, hdp 2 x tp 2" in runs["C"]["out"]


def test_tp2_with_fsdp2_over_hdp_matches(runs):
    assert_same_steps(runs["A"], runs["F"], range(STEPS))
    assert "FSDP2" in runs["F"]["out"]
