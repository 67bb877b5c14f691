"""The simulator's invariants (issue 14): a one-rank plan equals the cost model; doubling the
bandwidth never slows a step; static and HDP agree on equal short sequences; a ring waits for all
its members and the waiting is idle; the per-rank breakdown sums to the step."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bytescale.planner import CostModel
from bytescale.sim import (STRATEGIES, Schedule, build_schedule, cluster, cost_model, model_shape,
                           simulate, simulate_batch)
from bytescale.sim.engine import BYTES_PER_TOKEN_READ, micro_batch_times

SHAPE = model_shape("llama-7b")


def _batch(seed: int, n: int = 200, hi: int = 40000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.exp(rng.uniform(np.log(64), np.log(hi), n)).astype(np.int64)
    return np.maximum(x, 1)


@pytest.mark.parametrize("strategy", ["static", "pow2", "hdp", "hdp-offload", "hdp-offload-eq3", "hdp-balance",
                                      "hdp-full"])
@pytest.mark.parametrize("s", [1, 777, 8192])
def test_one_rank_equals_cost_model(strategy, s):
    cl = cluster("h100-nvlink-ib400", 1, 1)
    cm = cost_model(SHAPE, cl)
    (r,) = simulate_batch([s], SHAPE, 1, 1, [strategy], cl, capacity=8192, cost=cm)
    stall = s * BYTES_PER_TOKEN_READ / cl.loader_bw if STRATEGIES[strategy][2] == "global" else 0.0
    assert r.grad_sync_s == 0.0  # one rank: nothing to synchronise
    assert r.step_time_s - stall == pytest.approx(cm.seq_time(float(s)), rel=1e-12)
    assert r.compute[0] == pytest.approx(cm.seq_time(float(s)), rel=1e-12)
    assert r.exposed_comm[0] == 0.0 and r.idle[0] == pytest.approx(0.0, abs=1e-12)
    assert r.mfu == pytest.approx(SHAPE.flops(s, float(s) ** 2) / (r.step_time_s * cl.peak_flops))


@pytest.mark.parametrize("world,gpn,seed", [(5, 2, 0), (16, 4, 1), (64, 8, 2), (3, 8, 3)])
def test_doubling_bandwidth_never_slows_a_step(world, gpn, seed):
    lengths = _batch(seed, n=120, hi=min(4096 * world, 20000 * max(1, world // 8)))
    cl = cluster("h100-nvlink-ib400", world, gpn)
    cm = cost_model(SHAPE, cl)
    names = [n for n in STRATEGIES if not (n == "static" and world & (world - 1))]
    slow = simulate_batch(lengths, SHAPE, world, gpn, names, cl, capacity=4096, cost=cm)
    for f in (2.0, 4.0):
        fast = simulate_batch(lengths, SHAPE, world, gpn, names, cl.scaled_bandwidth(f), capacity=4096, cost=cm)
        for a, b in zip(slow, fast):
            assert b.step_time_s <= a.step_time_s * (1 + 1e-12), (a.strategy, f)
            assert b.exposed_comm.sum() <= a.exposed_comm.sum() * (1 + 1e-12) + 1e-15


@pytest.mark.parametrize("world", [1, 4, 8])
def test_static_and_hdp_agree_on_equal_short_sequences(world):
    lengths = np.full(16 * world, 512, dtype=np.int64)  # two per 1024-token micro-batch
    res = {r.strategy: r for r in simulate_batch(lengths, SHAPE, world, 8, list(STRATEGIES), capacity=1024)}
    assert res["static"].info["cp"] == 1
    ref = res["static"].step_time_s
    for name in ("hdp-full",):  # no data stall in either (static reads its share, hdp-full prefetches)
        assert res[name].step_time_s == pytest.approx(ref, rel=1e-12)
    for name in ("pow2", "hdp", "hdp-offload", "hdp-offload-eq3", "hdp-balance"):  # the same, plus the stall of reading the batch
        assert res[name].step_time_s - res[name].data_stall_s == pytest.approx(ref, rel=1e-12)
    for r in res.values():
        assert r.exposed_comm.sum() == 0.0 and r.idle.max() == pytest.approx(0.0, abs=1e-9)


def _hand_schedule() -> Schedule:
    # rank 0: local (1000 tokens), then ring 0 with rank 1; rank 1: ring 0 only; rank 2: local (2000)
    return Schedule.from_arrays(
        strategy="hand", world=3, rank_mb=np.array([0, 2, 3, 4]), mb_ring=np.array([-1, 0, 0, -1]),
        ring_grp=np.array([0, 2]), grp_ranks=np.array([0, 1], dtype=np.int32),
        mb_tokens=np.array([1000.0, 500.0, 500.0, 2000.0]), mb_attn=np.zeros(4),
        mb_ring_size=np.array([1, 2, 2, 1]), mb_offload=np.zeros(4), mb_docs=np.ones(4, dtype=np.int64),
        loader="remote")


def _unit_cost() -> CostModel:
    cm = CostModel()
    cm.a1, cm.b1, cm.g, cm.layers = 0.0, 1e-3, 0.0, 1  # 1 ms per token, nothing else
    return cm


def test_ring_waits_for_all_members_and_waiting_is_idle():
    cl = replace(cluster("h100-nvlink-ib400", 3, 8), intra_latency=0.0)
    r = simulate(_hand_schedule(), cl, SHAPE, _unit_cost(), tokens=4000, sum_sq=0.0, grad_bytes=0.0)
    comm = 3 * 500 * _unit_cost().kv_bytes_per_token / cl.intra_bw  # one ring step, nothing to hide it
    assert r.mb_start[1] == pytest.approx(1.0) and r.mb_start[2] == pytest.approx(1.0)  # rank 1 waited
    assert r.mb_end[1] == pytest.approx(1.5 + comm)
    assert r.step_time_s == pytest.approx(2.0)  # rank 2's local micro-batch is the longest
    assert r.idle[1] == pytest.approx(2.0 - 0.5 - comm)  # 1 s waiting for rank 0 + the tail
    assert r.idle[0] == pytest.approx(2.0 - 1.5 - comm)
    assert r.exposed_comm[0] == pytest.approx(comm) and r.exposed_comm[2] == 0.0


def test_ring_across_nodes_pays_the_inter_node_link():
    cl = replace(cluster("h100-nvlink-ib400", 3, 8), intra_latency=0.0)
    one_node = simulate(_hand_schedule(), cl, SHAPE, _unit_cost(), 4000, 0.0, 0.0)
    two_nodes = simulate(_hand_schedule(), replace(cl, gpus_per_node=1), SHAPE, _unit_cost(), 4000, 0.0, 0.0)
    ratio = two_nodes.exposed_comm[0] / one_node.exposed_comm[0]
    assert ratio > 5  # 370 GB/s NVLink vs 48 GB/s InfiniBand (plus latency)


def test_deadlocking_schedule_is_reported():
    s = _hand_schedule()
    bad = Schedule.from_arrays(s.strategy, 3, rank_mb=np.array([0, 2, 4, 4]), mb_ring=np.array([0, 1, 1, 0]),
                               ring_grp=np.array([0, 2, 4]), grp_ranks=np.array([0, 1, 0, 1], dtype=np.int32),
                               mb_tokens=np.full(4, 10.0), mb_attn=np.zeros(4), mb_ring_size=np.full(4, 2),
                               mb_offload=np.zeros(4), mb_docs=np.ones(4, dtype=np.int64), loader=s.loader)
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad, cluster("h100-nvlink-ib400", 3, 8), SHAPE, _unit_cost(), 40, 0.0, 0.0)


@pytest.mark.parametrize("corpus_seed,world,gpn", [(4, 64, 8), (5, 40, 8), (6, 7, 2)])
def test_breakdown_sums_to_step_time_per_rank(corpus_seed, world, gpn):
    lengths = _batch(corpus_seed, n=300, hi=min(60000, 8192 * world))
    names = [n for n in STRATEGIES if not (n == "static" and world & (world - 1))]
    for r in simulate_batch(lengths, SHAPE, world, gpn, names, capacity=8192):
        total = r.compute + r.exposed_comm + r.offload + r.idle + r.grad_sync_s + r.data_stall_s + r.step_overhead_s
        np.testing.assert_allclose(total, r.step_time_s, rtol=1e-9, err_msg=r.strategy)
        assert (r.idle >= -1e-9).all() and (r.compute > 0).any()
        assert sum(r.breakdown().values()) == pytest.approx(r.step_time_s, rel=1e-9)
        assert r.tokens == int(lengths.sum()) and r.tokens_per_s == pytest.approx(r.tokens / r.step_time_s)


def test_schedule_holds_every_token_once():
    lengths = _batch(7, n=150, hi=50000)
    cm = cost_model(SHAPE, cluster("h100-nvlink-ib400", 32, 8))
    for name in STRATEGIES:
        s = build_schedule(name, lengths, 32, 4096, cm)
        assert s.mb_tokens.sum() == pytest.approx(lengths.sum()), name
        # attention shares: sum over ranks of s^2/d for each sequence = sum of s^2
        assert s.mb_attn.sum() == pytest.approx((lengths.astype(float) ** 2).sum(), rel=1e-9), name


def test_models_profiles_and_capacity(tmp_path):
    import json

    from bytescale.sim import default_capacity

    cl = cluster("h100-nvlink-ib400", 1024, 8)
    assert default_capacity(SHAPE, cl, cost_model(SHAPE, cl)) == 8192  # RESULTS.md's stated capacity
    # Table 1's LLaMA-7B has 8 K/V groups (GQA): 5.93B parameters (6.74B with MHA); Llama 2 70B: 68.98B
    assert 5.9e9 < SHAPE.params < 6.0e9 and 6.8e10 < model_shape("llama-70b").params < 7.0e10
    moe = model_shape("mistral-8x7b")
    assert 4.5e10 < moe.params < 4.8e10 and moe.active_layer_params < moe.attn_params + moe.mlp_params
    cfg = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 6,
           "intermediate_size": 2816, "vocab_size": 5000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = model_shape(str(tmp_path / "config.json"))
    assert (hf.layers, hf.kv_heads, hf.head_dim) == (6, 4, 64)
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="missing key 'num_attention_heads'"):
        model_shape(str(tmp_path / "bad.json"))
    prof = {"a1": 1e-10, "b1": 2e-6, "g": 3e-4, "a2": 1e5, "b2": 0, "layers": 7, "bw_d2h": 1e10, "bw_h2d": 1e10}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    cm = cost_model(hf, cl, profile=str(tmp_path / "p.json"))
    assert (cm.a1, cm.b1, cm.g, cm.layers) == (1e-10, 2e-6, 3e-4, 7) and cm.ring_bw == cl.inter_bw
    with pytest.raises(ValueError, match="no such file"):
        cost_model(hf, cl, profile=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="efficiency"):
        cost_model(hf, cl, efficiency=1.5)


@pytest.mark.parametrize("world,gpn,corpus", [(64, 8, "byted"), (37, 4, "byted"), (128, 8, "github")])
def test_doubling_bandwidth_never_slows_a_step_replanned(world, gpn, corpus):
    """The whole pipeline: the planner re-plans for the faster network (its cost model follows the
    cluster), the simulator prices the new plans."""
    from bytescale.data.synthetic import global_batch_lengths
    from bytescale.sim import split_at_context

    lengths = split_at_context(global_batch_lengths(corpus, 1 << 22, seed=world), 2048 * world)
    cl = cluster("h100-nvlink-ib400", world, gpn)
    names = [n for n in STRATEGIES if not (n == "static" and world & (world - 1))]
    slow = simulate_batch(lengths, SHAPE, world, gpn, names, cl, capacity=4096)
    fast = simulate_batch(lengths, SHAPE, world, gpn, names, cl.scaled_bandwidth(2.0), capacity=4096)
    for a, b in zip(slow, fast):
        assert b.step_time_s <= a.step_time_s * (1 + 1e-12), a.strategy


def test_measured_ring_price_replaces_the_cost_model_for_ring_micro_batches_only():
    s = replace(_hand_schedule(), mb_attn=np.array([0.0, 4e4, 4e4, 0.0]))
    cl = replace(cluster("h100-nvlink-ib400", 3, 8), intra_latency=0.0)
    base = micro_batch_times(s, cl, _unit_cost())
    cost = _unit_cost()
    ringed = micro_batch_times(s, replace(cl, ring_a1=1e-6, ring_b1=1e-5, ring_step_s=0.01, ring_doc_step_s=0.002,
                                          ring_call_s=0.003), cost)
    ring = s.mb_ring >= 0
    assert np.array_equal(ringed["compute"][~ring], base["compute"][~ring])  # local ones unchanged
    priced = (1e-6 * s.mb_attn[ring] + 1e-5 * s.mb_tokens[ring] + (0.01 + 0.002 * s.mb_docs[ring]) * 2 + 0.003)
    np.testing.assert_allclose(ringed["compute"][ring], cost.layers * priced)
    with pytest.raises(ValueError, match="ring_step_s"):
        replace(cl, ring_step_s=-1.0)
    for f in ("ring_a1", "ring_b1", "ring_call_s", "ring_doc_step_s"):
        with pytest.raises(ValueError, match=f):
            replace(cl, **{f: -1.0})
