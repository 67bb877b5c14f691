"""Pipeline parallelism in the simulator (issue 23): ``--pp P`` cuts the model into P stages under
1F1B; every strategy plans pipelines; PP = 1 is the former path; the step obeys the pipeline's
invariants (breakdown sums to the step, bubbles grow with depth for one micro-batch, the static
baseline and PP-Balance both replay what the planner predicted); bad input is named."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bytescale.sim import PP_STRATEGIES, STRATEGIES, cluster, cost_model, default_capacity, model_shape, simulate_batch
from bytescale.sim.__main__ import main
from bytescale.sim.model import gpu_params

SHAPE = model_shape("llama-7b")


def _batch(seed: int, n: int = 150, hi: int = 60000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(64), np.log(hi), n)).astype(np.int64)


def test_pp1_is_the_former_path():
    lengths = _batch(1)
    a = simulate_batch(lengths, SHAPE, 64, 8, list(STRATEGIES), capacity=8192)
    b = simulate_batch(lengths, SHAPE, 64, 8, list(STRATEGIES), capacity=8192, pp=1)
    for x, y in zip(a, b):
        assert x.step_time_s == y.step_time_s and x.pp == y.pp == 1 and x.bubble == 0.0
        np.testing.assert_array_equal(x.mb_end, y.mb_end)


@pytest.mark.parametrize("pp,tp", [(2, 1), (4, 1), (4, 2), (8, 4)])
def test_pipelined_steps_keep_their_invariants(pp, tp):
    lengths = _batch(pp + tp)
    names = list(STRATEGIES) + list(PP_STRATEGIES)
    res = simulate_batch(lengths, SHAPE, 128, 8, names, capacity=16384, tp=tp, pp=pp)
    for r in res:
        assert r.pp == pp and r.gpus == 128 and r.world == 128 // (tp * pp), r.strategy
        b = r.breakdown()
        assert sum(b.values()) == pytest.approx(r.step_time_s, rel=1e-9), r.strategy
        assert 0.0 < r.bubble < 1.0 and r.idle.min() >= -1e-9, r.strategy
        # the planner planned with the simulator's own terms (no ring link differences here:
        # the planner prices rings at the slowest link, the simulator by their own)
        assert r.info["planner_bound"] <= r.info["replay_step_s"] * (1 + 1e-9) or r.info["rings"], r.strategy
        assert r.info["stage_layers"] == SHAPE.layers // pp
        assert 0 < r.mfu < 1
    by = {r.strategy: r for r in res}
    # PP-Balance (with offloading) is not slower than lockstep slots (without; other inputs, so 5%)
    assert by["hdp-pp-balance"].step_time_s <= 1.05 * by["lockstep"].step_time_s


def test_one_micro_batch_pays_the_whole_pipeline():
    """One sequence on one pipeline of P stages: its forward and backward cross every stage, so the
    step is P stages of one stage's time (= the whole model's time on one GPU) plus 2 (P - 1)
    transfers, and the bubble is about (P - 1) / P."""
    one = simulate_batch([4096], SHAPE, 1, 8, ["hdp-full"], cluster("h100-nvlink-ib400", 1, 8),
                         capacity=8192, grad_bytes=0.0)[0]
    for pp in (2, 4, 8):
        cl = cluster("h100-nvlink-ib400", pp, 8)
        (r,) = simulate_batch([4096], SHAPE, pp, 8, ["hdp-pp-balance"], cl, capacity=8192, pp=pp, grad_bytes=0.0)
        assert r.world == 1 and r.info["rings"] == 0
        p2p = r.info["p2p_s"]
        assert p2p > 0
        assert r.step_time_s == pytest.approx(one.step_time_s + 2 * (pp - 1) * p2p, rel=1e-9)
        busy = one.step_time_s / pp
        assert r.bubble == pytest.approx(1 - busy / r.step_time_s, rel=1e-9)
        assert r.bubble > (pp - 1) / pp - 1e-9


def test_memory_per_gpu_falls_with_pp():
    cl = cluster("h100-nvlink-ib400", 1024, 8)
    m = model_shape("llama-70b")
    params = [gpu_params(m, 8, pp) for pp in (1, 2, 4, 8)]
    assert all(params[i] < params[i - 1] for i in range(1, 4))
    caps = [default_capacity(m, cl, cost_model(m, cl, tp=8, pp=pp), tp=8, pp=pp) for pp in (1, 2, 4, 8)]
    assert all(caps[i] >= caps[i - 1] for i in range(1, 4)), caps
    assert cost_model(m, cl, tp=8, pp=4).layers == 20


def test_cli_pp(tmp_path):
    out = tmp_path / "pp.json"
    rc = main(["--corpus", "github", "--model", "llama-70b", "--gpus", "256", "--tp", "8", "--pp", "4",
               "--global-batch-tokens", "2M", "--context", "128K", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["pp"] == 4
    assert set(doc["strategies"]) == set(STRATEGIES) | set(PP_STRATEGIES)
    for r in doc["strategies"].values():
        assert r["pp"] == 4 and r["gpus"] == 256 and 0 <= r["bubble"] < 1


@pytest.mark.parametrize("argv,msg", [
    (["--pp", "3"], "3 stages do not divide the model's 32 layers"),
    (["--pp", "0"], "--pp 0: must be an integer >= 1"),
    (["--pp", "8", "--gpus", "12", "--gpus-per-node", "4"], "does not divide the cluster's 12 GPUs"),
    (["--pp", "2", "--profile", "default"], "pp 2 needs the FLOP-derived cost model"),
    (["--pp", "2", "--strategy", "pp-balance"], "unknown"),
])
def test_cli_bad_pp_input_is_named(argv, msg, capsys):
    rc = main(["--corpus", "byted", "--model", "llama-7b", "--gpus", "64", "--global-batch-tokens", "1M",
               "--context", "64K"] + argv)
    assert rc == 2
    assert msg in capsys.readouterr().err
