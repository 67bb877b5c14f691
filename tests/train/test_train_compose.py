"""The composition cells through the real entry point (``python -m bytescale.train``'s ``main`` in
real processes with torchrun's environment: train_launch.py): each pipelined run equals the run
without pipelines on the same global batches (loss and gradient norm every step, float32: 1e-5).

R:   2 ranks, HDP 2, bytescale's tiny Llama (the reference of PF).
PF:  4 ranks, PP 2 x HDP 2 with FSDP2 over each stage's HDP group (PP-Balance: uneven counts padded
     to the stage's slots by the executor's schedule), a checkpoint at step 2.
PFR: 2 ranks, PP 2 x HDP 1 with FSDP2, resumed from PF's step 2 (each stage's shards resharded by DCP).
MR:  2 ranks, HDP 2, the MoE preset (the reference of PE).
PE:  4 ranks, PP 2 x HDP 2 with each stage's experts sharded over its EP group of 2.
W:   8 ranks, the whole: PP 2 x TP 2 x EP 2 x FSDP2 (units of TP 2, HDP 2 per stage; the reference MR).
HR:  2 ranks, HDP 2, an HF Llama config.json (the reference of HP).
HP:  4 ranks, PP 2 x HDP 2, the HF model's decoder layers split into stages (hf_pipeline_stage).
PS:  4 ranks, PP 2 x HDP 2 under the static DP x CP baseline (PP-Balance's baseline through the trainer).
R1:  1 rank (the reference of PT: one HDP unit, so documents are cut at the same length).
PT:  4 ranks, PP 2 x TP 2 with sequence parallelism (each TP rank sends its rows of the sequence).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from train_launch import TINY_RUN, assert_same_steps, logged_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1800)]

STEPS = 3
COMMON = TINY_RUN + ["--steps", STEPS]


def _run(d: Path, name: str, nproc: int, *extra) -> dict:
    return logged_run(d, name, nproc, COMMON + [str(x) for x in extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import transformers

    d = tmp_path_factory.mktemp("compose")
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False).save_pretrained(d / "hf")
    hf = ["--model", d / "hf" / "config.json"]
    moe = ["--model", "mixtral-tiny"]
    return {
        "R": _run(d, "R", 2), "PF": _run(d, "PF", 4, "--pp", 2, "--fsdp", "--strategy", "pp-balance",
                                          "--checkpoint-dir", d / "ckPF", "--save-every", 2),
        "PFR": _run(d, "PFR", 2, "--pp", 2, "--fsdp", "--strategy", "pp-balance", "--checkpoint-dir", d / "ckPFR",
                    "--resume-from", d / "ckPF" / "step-00000002"),
        "MR": _run(d, "MR", 2, *moe), "PE": _run(d, "PE", 4, *moe, "--pp", 2, "--ep", 2),
        "W": _run(d, "W", 8, *moe, "--pp", 2, "--tp", 2, "--ep", 2, "--fsdp"),
        "HR": _run(d, "HR", 2, *hf), "HP": _run(d, "HP", 4, *hf, "--pp", 2),
        "PS": _run(d, "PS", 4, "--pp", 2, "--strategy", "static"),
        "R1": _run(d, "R1", 1), "PT": _run(d, "PT", 4, "--pp", 2, "--tp", 2, "--sequence-parallel"),
    }


def test_pp_with_fsdp2_trains_like_plain_hdp(runs):
    assert "4 ranks on cpu (pp 2 x hdp 2 x tp 1)" in runs["PF"]["out"]
    assert_same_steps(runs["R"], runs["PF"], range(STEPS))
    assert_same_steps(runs["R"], runs["PFR"], range(2, STEPS))  # resumed on half the HDP degree


def test_pp_with_expert_parallelism_trains_like_plain_hdp(runs):
    assert_same_steps(runs["MR"], runs["PE"], range(STEPS))


def test_the_whole_pp_tp_ep_fsdp2_at_world_8_trains_like_plain_hdp(runs):
    assert "8 ranks on cpu (pp 2 x hdp 2 x tp 2)" in runs["W"]["out"]
    assert_same_steps(runs["MR"], runs["W"], range(STEPS))


def test_an_hf_model_in_pipelines_trains_like_the_whole_model(runs):
    assert_same_steps(runs["HR"], runs["HP"], range(STEPS))


def test_pp_under_the_static_baseline_trains_like_plain_hdp(runs):
    m = runs["PS"]["metrics"]
    assert all(r["plan"].startswith("plan[static]") and "pipelines of 2 stages" in r["plan"] for r in m), \
        [r["plan"] for r in m]
    assert_same_steps(runs["R"], runs["PS"], range(STEPS))


def test_pp_with_tp_and_sequence_parallelism_trains_like_plain_hdp(runs):
    assert "4 ranks on cpu (pp 2 x hdp 1 x tp 2)" in runs["PT"]["out"]
    assert_same_steps(runs["R1"], runs["PT"], range(STEPS))
