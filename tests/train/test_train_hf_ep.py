"""``bytescale.train --model mixtral_config.json --ep E``: an HF Mixtral's experts sharded over EP
groups, through the real entry point (train_launch.py).

An HF Mixtral runs on the package's MoE blocks at every EP degree (``bytescale.models.hf_moe``:
HF's routing, the dropless all-to-all dispatch, HF's balance loss made exact under HDP), so the
runs below train the same objective:
R: 4 ranks, experts replicated (EP 1), 4 steps, the reference.
A: 4 ranks, EP 2, 4 steps, a checkpoint at step 2.
B: 4 ranks, EP 4, resumed from A's step 2 (each rank's expert read by its global name).
C: 4 ranks, PP 2 x EP 2 (HDP 2 per stage), 4 steps; F: 4 ranks, EP 2 x FSDP2, 4 steps.
Every step of A, B, C and F sees R's global batch, R's loss, balance loss and gradient norm
(float32: 1e-5). A dense HF model with ``--ep``, and an HF Mixtral with ``--ep`` and ``--tp``, are
refused with the reason.
"""
from __future__ import annotations

import math

import pytest

from train_launch import assert_same_steps, launch, logged_run

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS = 4
COMMON = ["--data", "synthetic:byted", "--synthetic-docs", "400", "--synthetic-scale", "0.0005",
          "--capacity", "128", "--tokens-per-batch", "640", "--steps", STEPS, "--warmup-steps", "2",
          "--lr", "3e-3", "--progress=false", "--keep", "0", "--vocab-size", "64"]
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_ep_cfg")
    transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                               router_aux_loss_coef=0.1).save_pretrained(d / "mixtral")
    transformers.LlamaConfig(**SIZES).save_pretrained(d / "llama")
    return {k: str(d / k / "config.json") for k in ("mixtral", "llama")}


def test_hf_mixtral_with_ep_trains_like_replicated_experts(configs, tmp_path):
    model = ["--model", configs["mixtral"]]
    ref = logged_run(tmp_path, "R", 4, COMMON + model)
    a = logged_run(tmp_path, "A", 4, COMMON + model + ["--ep", "2", "--checkpoint-dir", tmp_path / "ckA",
                                                       "--save-every", "2"])
    assert "| EP 2 |" in a["out"], a["out"][-2000:]
    assert_same_steps(ref, a, range(STEPS))
    for r, w in zip(a["metrics"], ref["metrics"]):
        assert w["aux_loss"] > 0 and math.isclose(r["aux_loss"], w["aux_loss"], rel_tol=1e-5), (r["step"], r["aux_loss"],
                                                                                                  w["aux_loss"])
    assert any(r["ring_sizes"] for r in a["metrics"]), "no document was sharded over a ring"
    b = logged_run(tmp_path, "B", 4, COMMON + model + ["--ep", "4", "--checkpoint-dir", tmp_path / "ckB",
                                                       "--resume-from", tmp_path / "ckA" / "step-00000002"])
    assert_same_steps(ref, b, range(2, STEPS))
    # PP x EP: each stage's experts over its EP group, the stages' balance losses summed
    c = logged_run(tmp_path, "C", 4, COMMON + model + ["--pp", "2", "--ep", "2"])
    # EP x FSDP2: the dense parameters sharded over the HDP ranks, the experts left out of it
    f = logged_run(tmp_path, "F", 4, COMMON + model + ["--fsdp", "--ep", "2"])
    assert "FSDP2" in f["out"]
    for run in (c, f):
        assert_same_steps(ref, run, range(STEPS))
        for r in run["metrics"]:
            w = ref["metrics"][r["step"]]["aux_loss"]
            assert math.isclose(r["aux_loss"], w, rel_tol=1e-5), (r["step"], r["aux_loss"], w)


def test_ep_with_a_dense_hf_model_or_with_tp_is_a_clear_error(configs):
    res = launch(2, COMMON + ["--model", configs["llama"], "--ep", "2"], timeout=240)
    assert res.returncode != 0 and "needs a mixture-of-experts model" in res.stdout + res.stderr, \
        (res.stdout + res.stderr)[-2000:]
    res = launch(4, COMMON + ["--model", configs["mixtral"], "--ep", "2", "--tp", "2"], timeout=240)
    assert res.returncode != 0 and "HF models supports Mixtral" in res.stdout + res.stderr and \
        "with tp=1" in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]
