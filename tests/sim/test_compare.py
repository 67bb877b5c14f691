"""Predictions on several distributions (python -m bytescale.sim --compare), the published
histograms they draw from, and the paper's pre-balance rows in world lockstep."""
from __future__ import annotations

import json
import math

import numpy as np

from bytescale.sim import simulate_batch
from bytescale.sim.__main__ import main
from bytescale.sim.compare import gain_shares
from bytescale.sim.distributions import BINNED, draw_batch, histogram


def test_binned_draws_follow_the_published_shares():
    for name, b in BINNED.items():
        tokens = 8 << 30 if name == "magi-long" else 200 << 20  # tens of thousands of documents either way
        x = draw_batch(name, tokens, seed=1)
        assert x.sum() <= tokens and x.min() >= 1 and x.max() <= b.edges[-1] + 1
        # the document share of every bin, computed from the published numbers, within 1 point
        shares = np.asarray(b.shares) / sum(b.shares)
        idx = np.searchsorted(np.asarray(b.edges[1:]), x, side="left")
        got = np.bincount(np.minimum(idx, len(shares) - 1), minlength=len(shares)) / x.size
        assert np.abs(got - shares).max() < 0.01, (name, got, shares)
    short = draw_batch("magi-short", 10 << 20)
    assert short.max() <= 64 * 1024 + 1
    h = histogram(short)
    assert h["tokens_gt_128K"] == 0 and sum(h["documents"]) == short.size and sum(h["tokens"]) == short.sum()


def test_draw_from_a_corpus_without_replacement():
    corpus = np.arange(1, 101)
    x = draw_batch("mine", 1000, seed=3, corpus=corpus)
    assert len(set(x.tolist())) == x.size and x.sum() <= 1000 and x.sum() + corpus.max() > 1000


def test_lockstep_rows_wait_for_the_slowest_rank():
    lens = np.array([300_000, 70_000, 9_000, 5_000, 200, 1, 40_000, 12_000] * 6)
    res = {r.strategy: r for r in simulate_batch(lens, "llama-7b", 64, 8, ["hdp", "hdp-lockstep", "hdp-offload",
                                                                            "hdp-offload-lockstep"],
                                                   capacity=16384)}
    for free, lock in (("hdp", "hdp-lockstep"), ("hdp-offload", "hdp-offload-lockstep")):
        # the same plan and the same compute; a lockstep slot lasts as long as its slowest member,
        # so no rank finishes before the busiest rank's compute, and every rank but the slowest of
        # a slot waits. (Lockstep may still beat the flat replay of the plan's order: it runs each
        # rank's locals costliest first, Plan.group_lockstep, so step times are not compared.)
        assert np.allclose(res[lock].compute, res[free].compute)
        assert res[lock].step_time_s >= float(np.max(res[lock].compute)) - 1e-9
        assert res[lock].breakdown()["idle_s"] > 0


def test_gain_shares_add_up():
    g = gain_shares({"static": 10.0, "hdp-lockstep": 5.0, "hdp-offload-lockstep": 4.0, "hdp-balance": 2.5})
    assert math.isclose(sum(g.values()), 1.0)
    assert math.isclose(g["communication"], math.log(2) / math.log(4))


def test_compare_cli(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("300000 70000 9000 5000 200 1\n" * 20)
    out = tmp_path / "c.json"
    assert main(["--compare", f"mine={lengths},magi-short", "--gpus", "64", "--gpus-per-node", "8", "--context",
                 "512K", "--global-batch-tokens", "4M", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert list(doc["distributions"]) == ["mine", "magi-short"]
    for name, d in doc["distributions"].items():
        assert d["source"] and set(d["speedup"]) == {"static", "pow2", "hdp-lockstep", "hdp-offload-lockstep",
                                                      "hdp-balance"}
        assert d["speedup"]["static"] == 1.0 and sum(d["histogram"]["tokens"]) == d["tokens"]
        assert f"  {name}: {d['source']}" in text
    assert "MagiAttention" in doc["distributions"]["magi-short"]["source"]
    assert main(["--compare", "nonesuch", "--gpus", "64"]) == 2
