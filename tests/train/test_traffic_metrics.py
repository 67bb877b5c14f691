"""The trainer's per-step traffic fields (bytescale.comm.traffic, counted by the transport) against
what the step must move, computed here from the model's shapes and the step's layout: on 2 ranks
every ring has 2 members, so per layer each member sends its K/V shard once forward and once
backward and each dK/dV accumulator travels 2 hops: ring K/V bytes = sharded tokens x 2 (K and V)
x kv_heads x head_dim x 4 bytes x layers, dK/dV twice that; gradient sync = every rank's
parameters in fp32. The static baseline shards every sequence: no token stays local."""
from __future__ import annotations

import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess

BASE = ["--data", "synthetic:byted", "--synthetic-docs", "200", "--synthetic-scale", "0.004", "--capacity", "160",
        "--max-length", "320", "--tokens-per-batch", "1024", "--progress=false", "--model", "tiny", "--steps", "3"]


def _train(rank, world):
    from bytescale.train import Trainer, parse_args

    out = {}
    for name, extra in (("hdp", []), ("static", ["--strategy", "static"])):
        t = Trainer(parse_args(BASE + extra))
        try:
            cfg = t.info.arch
            out[name] = {"records": t.train(), "params": sum(p.numel() for p in t.model_module.parameters()),
                         "arch": cfg}
        finally:
            t.close()
    return out


def test_step_traffic_equals_what_the_layout_must_move():
    out = run_distributed(_train, 2, timeout=400)[0]
    for name, run in out.items():
        arch = run["arch"]
        layers, kv_heads = arch["n_layers"], arch["n_kv_heads"]
        head_dim = arch["dim"] // arch["n_heads"]
        per_token = 2 * kv_heads * head_dim * 4 * layers
        for r in run["records"]:
            c = r["comm_bytes"]
            assert c["grad_sync"] == 2 * run["params"] * 4, (name, c)
            assert c["ring_kv_fwd"] == c["ring_kv_bwd"] == r["sharded_tokens"] * per_token, (name, r)
            assert c["ring_dkv_bwd"] == 2 * c["ring_kv_fwd"], (name, c)
            assert abs(r["local_token_share"] - (1 - r["sharded_tokens"] / r["tokens"])) < 1e-12
            assert len(r["ring_steps"]) == len(r["ring_wait_s"]) == 2 and min(r["ring_wait_s"]) >= 0
            assert (sum(r["ring_steps"]) > 0) == (r["sharded_tokens"] > 0)
    assert all(r["local_token_share"] == 0 and r["sharded_tokens"] == r["tokens"] for r in out["static"]["records"])
    assert any(r["local_token_share"] > 0 for r in out["hdp"]["records"])
