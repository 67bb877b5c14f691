"""``bytescale.train --model mixtral-tiny --ep E``: the MoE's experts sharded over EP groups
of HDP ranks, through the real entry point (its ``main`` in real processes with torchrun's environment: train_launch.py), and checkpoints that reshard across EP degrees.

R: 4 ranks, experts replicated (EP 1), 4 steps (the reference run).
A: 4 ranks, EP 4 (one expert per rank), 4 steps, a checkpoint every 2 steps.
B: 4 ranks, EP 2, resumed from A's step 2 (DCP reads each rank's two experts, and their optimizer
   state, by name from the EP 4 checkpoint) to the end.
F: 4 ranks, EP 2 x FSDP2 (dense parameters sharded over the HDP ranks), 4 steps, a checkpoint at
   step 2; G: 2 ranks, EP 2 x FSDP2, resumed from it.
Every step of A, B and F sees R's global batch and R's loss and gradient norm (float32: 1e-5).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from train_launch import assert_same_steps, launch, logged_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1800)]

STEPS = 4
COMMON = ["--data", "synthetic:byted", "--synthetic-docs", "400", "--synthetic-scale", "0.0005",
          "--capacity", "128", "--tokens-per-batch", "640", "--steps", STEPS, "--warmup-steps", "2",
          "--lr", "3e-3", "--progress=false", "--keep", "0", "--model", "mixtral-tiny", "--vocab-size", "64"]


def _run(d: Path, name: str, nproc: int, *extra, torchrun: bool = False) -> dict:
    return logged_run(d, name, nproc, COMMON + list(extra), torchrun=torchrun)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, module_execution_model):
    """The three runs, once per execution order (``[nccl-order]``: every rank in CUDA's)."""
    d = tmp_path_factory.mktemp("ep")
    out = {"R": _run(d, "R", 4)}
    for run in ("R",):  # every rank ran in the order this variant asks for
        assert ("NCCL order on CPU" in out[run]["out"]) == module_execution_model, out[run]["out"][-2000:]
    out["A"] = _run(d, "A", 4, "--ep", "4", "--checkpoint-dir", d / "ckA", "--save-every", "2")
    out["B"] = _run(d, "B", 4, "--ep", "2", "--checkpoint-dir", d / "ckB",
                    "--resume-from", d / "ckA" / "step-00000002")
    for run in ("A", "B"):
        assert ("NCCL order on CPU" in out[run]["out"]) == module_execution_model, out[run]["out"][-2000:]
    return out




@pytest.mark.nccl_order
def test_ep4_trains_like_replicated_experts(runs):
    assert "| EP 4 |" in runs["A"]["out"]
    assert_same_steps(runs["R"], runs["A"], range(STEPS))
    assert any(r["ring_sizes"] for r in runs["A"]["metrics"]), "no document was sharded over a ring"


@pytest.mark.nccl_order
def test_resume_ep4_to_ep2_gives_the_uninterrupted_losses(runs):
    assert_same_steps(runs["R"], runs["B"], range(2, STEPS))
    assert "ep 4; now 4, hdp 4 x tp 1, ep 2" in runs["B"]["out"]


@pytest.mark.nccl_order
def test_ep2_with_fsdp2_trains_like_replicated_experts(runs, tmp_path, module_execution_model):
    """``--ep 2 --fsdp``: the dense parameters FSDP2-sharded over the 4 HDP ranks, the experts over
    EP groups of 2 (summed over their EDP group); every rank runs the world's lockstep slots. Its
    step-2 checkpoint resumes on 2 ranks (EP 2 x FSDP2 over HDP 2) to R's losses (in Gloo order
    only: the checkpoint does not depend on the execution order)."""
    out = _run(tmp_path, "F", 4, "--ep", "2", "--fsdp", "--checkpoint-dir", tmp_path / "ckF", "--save-every", "2")
    assert "| EP 2 |" in out["out"] and "FSDP2" in out["out"]
    assert_same_steps(runs["R"], out, range(STEPS))
    if not module_execution_model:
        res = _run(tmp_path, "G", 2, "--ep", "2", "--fsdp", "--checkpoint-dir", tmp_path / "ckG",
                   "--resume-from", tmp_path / "ckF" / "step-00000002")
        assert_same_steps(runs["R"], res, range(2, STEPS))


def test_ep_with_a_dense_model_is_a_clear_error(tmp_path):
    res = launch(2, COMMON[:-4] + ["--model", "tiny", "--vocab-size", "64", "--ep", "2"], timeout=240)
    assert res.returncode != 0 and "needs a mixture-of-experts model" in res.stdout + res.stderr
