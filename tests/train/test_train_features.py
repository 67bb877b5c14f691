"""The trainer's options, run for a few steps each in one 2-rank job (real processes, the bytescale
backend): the loss falls; bf16 autocast + activation checkpointing + plan-driven offloading;
an HF config.json under FSDP2; the MoE preset under FSDP2 with its balance loss; the static
DP x CP baseline; a real corpus (installed Python packages) as a token store (--data) and through
the data service (--data-spec); bad data and model options fail with clear errors."""
from __future__ import annotations

import json
import math
import os

import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess

BASE = ["--data", "synthetic:byted", "--synthetic-docs", "200", "--synthetic-scale", "0.004", "--capacity", "160",
        "--max-length", "320", "--tokens-per-batch", "1024", "--progress=false", "--warmup-steps", "2"]


def _jobs(d):
    hf_cfg = os.path.join(d, "hf_llama", "config.json")
    return {
        "falls": BASE + ["--steps", "12", "--lr", "1e-2", "--metrics", os.path.join(d, "falls.jsonl")],
        "bf16_ac_offload": BASE + ["--steps", "3", "--bf16", "--activation-checkpointing", "--offload",
                                   "--strategy", "pow2"],
        "hf_fsdp": BASE + ["--steps", "3", "--model", hf_cfg, "--fsdp", "--bf16", "--activation-checkpointing"],
        "moe_fsdp": BASE + ["--steps", "3", "--model", "mixtral-tiny", "--fsdp", "--router-aux-coef", "0.1"],
        "static": BASE + ["--steps", "3", "--strategy", "static"],
        "store": ["--data", os.path.join(d, "store"), "--length-scale", "0.05", "--capacity", "256",
                  "--tokens-per-batch", "1024", "--steps", "3", "--progress=false",
                  "--samples-log", os.path.join(d, "store.samples.jsonl")],
        "service": ["--data-spec", os.path.join(d, "mix.toml"), "--capacity", "256", "--tokens-per-batch", "1024",
                    "--steps", "3", "--progress=false", "--samples-log", os.path.join(d, "service.samples.jsonl")],
    }


def _train(rank, world, d):
    import torch

    from bytescale.train import Trainer, parse_args
    from bytescale.train.config import ConfigError

    if rank == 0:
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        cfg.save_pretrained(os.path.join(d, "hf_llama"))
    torch.distributed.barrier()
    out = {}
    for name, argv in _jobs(d).items():
        t = Trainer(parse_args(argv))
        try:
            recs = t.train()
            out[name] = {"records": recs, "static_cp": t.static_cp, "kind": t.info.kind, "moe": t.info.moe,
                         "offload": t.planner.offload, "bf16": t.cfg.train.bf16}
        finally:
            t.close()
    errors = {}
    for name, argv in {"no_data": ["--steps", "1"], "bad_store": ["--data", d, "--steps", "1"],
                       "bad_preset": BASE + ["--model", "huge"], "too_long": BASE + ["--capacity", "64"]}.items():
        try:
            Trainer(parse_args(argv)).close()
            errors[name] = "no error"
        except ConfigError as e:
            errors[name] = str(e)
    return out, errors


def test_trainer_options_run_and_the_loss_falls(tmp_path):
    from bytescale.data.prepare import prepare

    prepare([], str(tmp_path / "store"), python_packages=True, max_packages=12, max_doc_bytes=20000,
            progress=False, plot=False)
    (tmp_path / "mix.toml").write_text(f'[[sources]]\nname = "pkgs"\nstore = "{tmp_path / "store"}"\n'
                                       '[[curriculum]]\nmax_length = 512\n')  # documents cut to 512 tokens
    res = run_distributed(_train, 2, str(tmp_path), timeout=400)
    out, errors = res[0]
    falls = out["falls"]["records"]
    assert len(falls) == 12
    first, last = falls[0]["loss"], sum(r["loss"] for r in falls[-3:]) / 3
    assert last < first - 0.3, (first, last)
    lines = [json.loads(x) for x in open(tmp_path / "falls.jsonl")]
    assert [x["step"] for x in lines] == list(range(12)) and "plan" in lines[0]
    assert (tmp_path / "falls.png").exists()
    for name in ("bf16_ac_offload", "hf_fsdp", "moe_fsdp", "static"):
        recs = out[name]["records"]
        assert len(recs) == 3 and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in recs), name
    assert out["hf_fsdp"]["kind"] == "hf"
    assert out["moe_fsdp"]["moe"] and all(r["aux_loss"] > 0 for r in out["moe_fsdp"]["records"])
    assert out["static"]["static_cp"] == 2
    # the baseline shards EVERY sequence over its CP group of 2
    assert all(r["ring_sizes"] and set(r["ring_sizes"]) == {2} for r in out["static"]["records"])
    for name in ("store", "service"):  # the real corpus, two ways
        recs = out[name]["records"]
        assert len(recs) == 3 and all(4 < r["loss"] < 7 for r in recs), name
        samples = [json.loads(x) for x in open(tmp_path / f"{name}.samples.jsonl")]
        assert [x["step"] for x in samples] == [0, 1, 2] and all(x["samples"] for x in samples)
    assert errors["no_data"].startswith("no data: give --data DIR")
    assert "not a directory" in errors["bad_store"] or "token store" in errors["bad_store"]
    assert "unknown model preset 'huge'" in errors["bad_preset"]
    assert "does not fit 2 ranks x hdp.capacity 64" in errors["too_long"]


@pytest.mark.skipif(os.environ.get("BYTESCALE_TEST_COMPILE") != "1",
                    reason="torch.compile of blocks takes minutes on CPU; BYTESCALE_TEST_COMPILE=1 runs it")
def test_compiled_blocks_train_like_eager(tmp_path):
    def job(rank, world, d):
        from bytescale.train import Trainer, parse_args

        res = []
        for extra in ([], ["--compile", "--compile-backend", "aot_eager"]):
            t = Trainer(parse_args(BASE + ["--steps", "2"] + extra))
            try:
                res.append([r["loss"] for r in t.train()])
            finally:
                t.close()
        return res

    eager, compiled = run_distributed(job, 2, str(tmp_path), timeout=600)[0]
    assert compiled == pytest.approx(eager, rel=1e-5)
