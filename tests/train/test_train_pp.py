"""``bytescale.train --pp 2``: pipelines of HDP units through the real entry point (its ``main`` in real processes with torchrun's environment: train_launch.py), and
checkpoints that resume across HDP degrees at a fixed pipeline depth.

R: 2 ranks, HDP 2 without pipelines (the reference of the same global batches).
A: 4 ranks as PP 2 x HDP 2 with PP-Balance, 6 steps, a checkpoint every 2 steps.
B: 2 ranks as PP 2 x HDP 1 continue from A's step 2 and stop at step 4 (each stage's parameters and
   optimizer state resharded by DCP; the planner plans one pipeline instead of two).
C: 6 ranks as PP 2 x HDP 3 continue from B's step 4 to the end.
Every step of A equals R (the same loss and gradient norm: pipelines change nothing but where the
work runs; float32: 1e-5), and every step of B and C equals A. A checkpoint saved with 2 stages is
refused at another depth with a clear error.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from train_launch import TINY_RUN, assert_same_steps, launch, logged_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1800)]

STEPS = 6
COMMON = TINY_RUN + ["--steps", STEPS]


def _run(d: Path, name: str, nproc: int, *extra, torchrun: bool = False) -> dict:
    return logged_run(d, name, nproc, COMMON + list(extra), torchrun=torchrun)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp")
    out = {"R": _run(d, "R", 2)}
    out["A"] = _run(d, "A", 4, "--pp", "2", "--strategy", "pp-balance", "--checkpoint-dir", d / "ckA",
                    "--save-every", "2")
    out["B"] = _run(d, "B", 2, "--pp", "2", "--strategy", "pp-balance", "--checkpoint-dir", d / "ckB",
                    "--save-every", "2", "--stop-after", "4", "--resume-from", d / "ckA" / "step-00000002")
    out["C"] = _run(d, "C", 6, "--pp", "2", "--strategy", "pp-balance", "--checkpoint-dir", d / "ckC",
                    "--resume-from", d / "ckB" / "step-00000004")
    out["dir"] = d
    return out




def test_pp2_trains_like_plain_hdp_and_plans_pipelines(runs):
    a = runs["A"]
    assert "4 ranks on cpu (pp 2 x hdp 2 x tp 1)" in a["out"]
    m = a["metrics"]
    assert m[-1]["loss"] < m[0]["loss"]
    assert all(r["plan"].startswith("plan[pp-") and "pipelines of 2 stages" in r["plan"] for r in m), \
        [r["plan"] for r in m]
    assert_same_steps(runs["R"], a, range(STEPS))


def test_resume_across_hdp_degrees_at_fixed_pp(runs):
    assert_same_steps(runs["A"], runs["B"], range(2, 4))
    assert_same_steps(runs["A"], runs["C"], range(4, STEPS))
    assert "now 6" in runs["C"]["out"]


def test_a_checkpoint_of_two_stages_is_refused_at_another_depth(runs):
    d = runs["dir"]
    res = launch(2, COMMON + ["--checkpoint-dir", d / "ckD", "--resume-from", d / "ckA" / "step-00000002"],
                 timeout=300)
    assert res.returncode != 0
    assert "saved with 2 pipeline stages, resumed with hdp.pp=1" in res.stdout + res.stderr
