"""Expert parallelism in the simulator: the MoE all-to-alls priced per micro-batch (four per layer,
``(ep-1)/ep`` of ``top_k x hidden x 2`` bytes a token, on NVLink inside a node), the step replayed in
EP lockstep (a block of ``ep`` units advances slot by slot), experts' gradients 1/ep per GPU; EP 1
is the former path; bad degrees are named."""
from __future__ import annotations

import numpy as np
import pytest

from bytescale.sim import cluster, simulate_batch
from bytescale.sim.__main__ import main
from bytescale.sim.engine import ep_comm_time
from bytescale.sim.model import model_shape

SHAPE = model_shape("mistral-8x7b")


def _batch(seed: int, n: int = 120, hi: int = 60000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(64), np.log(hi), n)).astype(np.int64)


def test_all_to_all_price_and_lockstep_replay():
    lens = _batch(1)
    cl = cluster("h100-nvlink-ib400", 64, 8)
    for ep in (2, 4, 8):
        base, = simulate_batch(lens, SHAPE, 64, 8, ["hdp"], capacity=32768)
        res, = simulate_batch(lens, SHAPE, 64, 8, ["hdp"], capacity=32768, ep=ep)
        s = res.schedule
        per_token, per_call = ep_comm_time(SHAPE, cl, 1, ep)
        assert per_token == pytest.approx(4 * (ep - 1) / ep * 2 * 4096 * 2 / cl.intra_bw)  # one node
        want = SHAPE.layers * (per_token * s.mb_tokens + per_call * (s.mb_tokens > 0))
        np.testing.assert_allclose(res.mb_comm - base.mb_comm, want, rtol=1e-12, atol=0)
        # every micro-batch runs inside the step, at least as long as its own duration
        dur = res.mb_compute + res.mb_comm + res.mb_tp_comm + res.mb_offload
        assert (res.mb_end - res.mb_start >= dur - 1e-9).all()
        assert res.info["replay_step_s"] >= np.bincount(s.mb_rank, weights=dur).max() - 1e-9
        assert res.grad_sync_s < base.grad_sync_s  # 1/ep of the experts' gradients per GPU
        assert res.info["ep"] == ep
    # EP 16 over 64 GPUs of 8 per node: the all-to-alls leave the node
    assert ep_comm_time(SHAPE, cl, 1, 16)[0] == pytest.approx(4 * 15 / 16 * 2 * 4096 * 2 / cl.inter_bw)
    assert ep_comm_time(SHAPE, cl, 1, 1) == (0.0, 0.0)


def test_bad_ep_is_named(capsys):
    lens = _batch(2, 20)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        simulate_batch(lens, "llama-7b", 16, 8, ["hdp"], ep=2)
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts"):
        simulate_batch(lens, SHAPE, 24, 8, ["hdp"], ep=3)
    assert main(["--lengths", "/nonexistent", "--model", "mistral-8x7b", "--ep", "2"]) == 2
