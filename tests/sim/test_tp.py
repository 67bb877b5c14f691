"""Tensor parallelism in the simulator (issue 22): an HDP unit of T GPUs inside a node. TP = 1 is
the former path; a unit's compute is one GPU's share (local heads, sliced matmuls) plus the TP
collectives on NVLink; K/V heads are replicated past their count; more TP never increases what a
GPU holds; rings of units pay NVLink only when their units share a node; bad input is named."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bytescale.sim import (MODELS, STRATEGIES, Schedule, cluster, cost_model, default_capacity, model_shape,
                           planner_cost, simulate, simulate_batch)
from bytescale.sim.__main__ import main
from bytescale.sim.model import (ACT_BYTES_PER_HIDDEN, act_bytes_per_token, gpu_layer_params, gpu_params,
                                 local_heads, tp_comm_time)

SHAPE = model_shape("llama-7b")


def _batch(seed: int, n: int = 150, hi: int = 60000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(64), np.log(hi), n)).astype(np.int64)


def test_presets_are_the_papers_table_1_shapes():
    table = {"llama-7b": (32, 32, 4096), "llama-13b": (40, 40, 5120), "llama-30b": (60, 56, 6656),
             "llama-70b": (80, 64, 8192), "mistral-8x7b": (32, 32, 4096), "mistral-8x22b": (56, 48, 6144)}
    for name, (layers, heads, hidden) in table.items():
        m = MODELS[name]
        assert (m.layers, m.heads, m.hidden, m.kv_heads) == (layers, heads, hidden, 8), name
    assert MODELS["mistral-8x7b"].top_k == MODELS["mistral-8x22b"].top_k == 2
    assert SHAPE.kv_bytes_per_token == 4096.0  # 8 K/V heads x 128 x 2 (K, V) x 2 bytes


def test_tp1_is_the_former_path():
    """At TP 1 every number is the former formula's, bit for bit."""
    cl = cluster("h100-nvlink-ib400", 64, 8)
    for name in MODELS:
        m = MODELS[name]
        cm = cost_model(m, cl)
        rate = cl.peak_flops * 0.4
        assert cm.a1 == 6.0 * m.heads * m.head_dim / rate
        assert cm.b1 == 6.0 * (m.active_layer_params + m.vocab * m.hidden / m.layers) / rate
        assert cm.a2 == ACT_BYTES_PER_HIDDEN * m.hidden and cm.kv_bytes_per_token == m.kv_bytes_per_token
        assert planner_cost(cm, m, cl, 1) is cm and tp_comm_time(m, cl, 1) == (0.0, 0.0)
        assert gpu_params(m, 1) == m.params and gpu_layer_params(m, 1) == m.active_layer_params
    lengths = _batch(1)
    a = simulate_batch(lengths, SHAPE, 64, 8, list(STRATEGIES), capacity=8192)
    b = simulate_batch(lengths, SHAPE, 64, 8, list(STRATEGIES), capacity=8192, tp=1)
    for x, y in zip(a, b):
        assert x.step_time_s == y.step_time_s and x.tp == y.tp == 1 and x.gpus == 64
        assert not x.tp_comm.any() and not x.mb_tp_comm.any() and x.breakdown()["tp_comm_s"] == 0.0
        np.testing.assert_array_equal(x.mb_end, y.mb_end)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_more_tp_never_increases_per_gpu_memory(name):
    m = MODELS[name]
    cl = cluster("h100-nvlink-ib400", 1024, 8)
    tps = [t for t in (1, 2, 4, 8) if m.heads % t == 0]
    act = [act_bytes_per_token(m, t) for t in tps]
    params = [gpu_params(m, t) for t in tps]
    kv = [cost_model(m, cl, tp=t).kv_bytes_per_token for t in tps]
    caps = [default_capacity(m, cl, cost_model(m, cl, tp=t), tp=t) for t in tps]
    for i in range(1, len(tps)):
        assert act[i] <= act[i - 1] and params[i] <= params[i - 1] and kv[i] <= kv[i - 1], (name, tps[i])
        assert caps[i] >= caps[i - 1], (name, tps[i], caps)  # a unit holds at least as many tokens
    assert caps[-1] >= 4 * caps[0]  # 8 GPUs per unit: each holds an eighth of the activations


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_units_compute_is_one_gpus_share_plus_tp_collectives(tp):
    """One unit, one sequence: compute = L ((a1 s^2 + b1 s) / T + g) (K/V heads split, T <= 8), TP
    collectives = L (8 (T-1)/T x hidden x 2 bytes x s / NVLink + 8 (T-1) latencies)."""
    cl = cluster("h100-nvlink-ib400", tp, 8)
    one = cost_model(SHAPE, cluster("h100-nvlink-ib400", 1, 8))
    s = 30000
    (r,) = simulate_batch([s], SHAPE, tp, 8, ["hdp-full"], cl, capacity=1 << 16, tp=tp)
    L = SHAPE.layers
    assert r.world == 1 and r.gpus == tp and r.schedule.world == 1
    assert r.compute[0] == pytest.approx(L * ((one.a1 * s * s + one.b1 * s) / tp + one.g), rel=1e-12)
    tpc = L * (8 * (tp - 1) / tp * SHAPE.hidden * 2 * s / cl.intra_bw + 8 * (tp - 1) * cl.intra_latency)
    assert r.tp_comm[0] == pytest.approx(tpc, rel=1e-12)
    assert r.step_time_s == pytest.approx(r.compute[0] + tpc, rel=1e-12)
    assert r.mfu == pytest.approx(SHAPE.flops(s, float(s) ** 2) / (r.step_time_s * tp * cl.peak_flops))


def test_kv_heads_replicated_past_their_count():
    m = replace(SHAPE, name="gqa2", kv_heads=2)
    assert local_heads(m, 2) == (16, 1) and local_heads(m, 8) == (4, 1)  # replicated 4 ways at T = 8
    cl = cluster("h100-nvlink-ib400", 64, 8)
    assert cost_model(m, cl, tp=8).kv_bytes_per_token == cost_model(m, cl, tp=2).kv_bytes_per_token == 2 * 128 * 2
    # every GPU projects its replicated K/V head: the per-GPU K/V projection does not shrink past T = 2
    kv_proj = 2 * m.hidden * m.head_dim
    assert gpu_layer_params(m, 8) - kv_proj == pytest.approx((m.active_layer_params - 2 * m.hidden * 2 * m.head_dim) / 8)
    # ... and its K/V activations stay whole: more than the sequence-parallel share
    assert act_bytes_per_token(m, 8) == pytest.approx(ACT_BYTES_PER_HIDDEN * m.hidden / 8 + 4 * m.head_dim * (1 - 2 / 8))


def _rings(world: int) -> Schedule:
    # unit 0 and unit 1 in one ring (one node at T = 4, gpn 8), units 2 and 3... units 1 and 2 in another
    return Schedule.from_arrays(
        strategy="hand", world=world, rank_mb=np.array([0, 1, 3, 4, 4]), mb_ring=np.array([0, 0, 1, 1]),
        ring_grp=np.array([0, 2, 4]), grp_ranks=np.array([0, 1, 1, 2], dtype=np.int32),
        mb_tokens=np.full(4, 4000.0), mb_attn=np.zeros(4), mb_ring_size=np.full(4, 2),
        mb_offload=np.zeros(4), mb_docs=np.ones(4, dtype=np.int64), loader="remote")


def test_rings_of_units_use_nvlink_inside_a_node_only():
    cl = cluster("h100-nvlink-ib400", 16, 8)
    cm = cost_model(SHAPE, cl, tp=4)
    r = simulate(_rings(4), cl, SHAPE, cm, 16000, 0.0, grad_bytes=0.0, tp=4)
    per_step = 3 * (cm.kv_bytes_per_token * 4000)  # three transfers, no attention to hide them
    L = SHAPE.layers
    assert r.mb_comm[0] == pytest.approx(L * (per_step / cl.intra_bw + 3 * cl.intra_latency))  # units 0, 1: node 0
    assert r.mb_comm[2] == pytest.approx(L * (per_step / cl.inter_bw + 3 * cl.inter_latency))  # units 1, 2: two nodes
    # the gradient all-reduce runs among the 4 units (one GPU each, 2 per node): it crosses nodes
    s2 = simulate(_rings(4), cl, SHAPE, cm, 16000, 0.0, tp=4)
    assert s2.grad_sync_s == pytest.approx(cl.allreduce_time(2.0 * gpu_params(SHAPE, 4), 4, 2))
    assert s2.grad_sync_s > cl.allreduce_time(2.0 * gpu_params(SHAPE, 4), 4)  # not NVLink


@pytest.mark.parametrize("tp,gpn", [(2, 8), (4, 8), (8, 8)])
def test_static_and_hdp_plan_units_and_the_breakdown_sums(tp, gpn):
    lengths = _batch(tp, n=300, hi=200000)
    gpus = 64
    for r in simulate_batch(lengths, SHAPE, gpus, gpn, list(STRATEGIES), tp=tp):
        assert r.world == gpus // tp and r.gpus == gpus and r.tp == tp
        total = (r.compute + r.exposed_comm + r.tp_comm + r.offload + r.idle + r.grad_sync_s + r.data_stall_s
                 + r.step_overhead_s)
        np.testing.assert_allclose(total, r.step_time_s, rtol=1e-9, err_msg=r.strategy)
        assert sum(r.breakdown().values()) == pytest.approx(r.step_time_s, rel=1e-9)
        assert (r.tp_comm > 0).any() and (r.idle >= -1e-9).all()
        assert r.schedule.mb_tokens.sum() == pytest.approx(lengths.sum())
        if r.strategy == "static":
            assert r.info["cp"] * r.info["dp"] == gpus // tp


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tp=3), "tp 3 does not divide gpus_per_node 8"),
    (dict(tp=0), "tp must be an integer >= 1"),
    (dict(tp=16, gpus_per_node=16, model="llama-13b"), "does not divide its 40 attention heads"),
    (dict(tp=4, model=replace(SHAPE, name="kv6", heads=24, kv_heads=6)), "neither divides its 6 K/V heads"),
    (dict(tp=4, gpus=30, gpus_per_node=4), "tp 4 does not divide the cluster's 30 GPUs"),
    (dict(tp=2, profile="default"), "needs the FLOP-derived cost model"),
])
def test_bad_tp_is_named(kwargs, needle):
    args = dict(model="llama-7b", gpus=64, gpus_per_node=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        simulate_batch([1000, 2000], args.pop("model"), args.pop("gpus"), args.pop("gpus_per_node"), ["hdp"],
                       **args)


def test_schedule_larger_than_the_cluster_is_an_error():
    cl = cluster("h100-nvlink-ib400", 8, 8)
    with pytest.raises(ValueError, match="schedule for 4 ranks of 4 GPUs on a cluster of 8 devices"):
        simulate(_rings(4), cl, SHAPE, cost_model(SHAPE, cl, tp=4), 16000, 0.0, tp=4)


def test_cli_tp(tmp_path, capsys):
    import json

    out = tmp_path / "tp.json"
    assert main(["--corpus", "github", "--model", "llama-13b", "--gpus", "64", "--context", "512K",
                 "--global-batch-tokens", "2M", "--strategy", "static,hdp-full", "--tp", "4",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["tp"] == 4
    for r in doc["strategies"].values():
        assert r["tp"] == 4 and r["gpus"] == 64 and r["breakdown"]["tp_comm_s"] > 0
    text = capsys.readouterr().out
    assert "16 HDP units of 4 GPUs" in text and "tokens/unit" in text
    assert main(["--corpus", "github", "--gpus", "64", "--tp", "3", "--global-batch-tokens", "1M"]) == 2
    assert "tp 3 does not divide gpus_per_node 8" in capsys.readouterr().err
