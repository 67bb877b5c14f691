"""Predictions on several length distributions side by side (``python -m bytescale.sim --compare``).

For each distribution (:mod:`bytescale.sim.distributions`: the paper's ``byted`` and ``github``, the
public ``magi-short`` and ``magi-long``, or a token store / lengths file such as the main command's
corpus) one global batch is drawn (seeded) and simulated under the paper's ablation rows:

* ``static`` DP x CP, ``pow2`` (Megatron-style dynamic CP),
* ``hdp-lockstep``: + dynamic communication (HDP's any-size rings, no balance scheduler: every rank
  the same micro-batch slots, as the paper's row before its scheduler),
* ``hdp-offload-lockstep``: + selective offloading,
* ``hdp-balance``: + the balance scheduler.

The speed-up of HDP + balance over static is split into the shares of its three steps in log
terms (static -> dynamic communication -> + offload -> + balance; the shares add up to 100%, a step
that slows the step down has a negative share). Each distribution's histogram of the drawn batch
and its source are kept in the JSON.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import numpy as np

from .distributions import SOURCES, draw_batch, histogram

__all__ = ["ROWS", "compare_distributions", "compare_table", "compare_png"]

ROWS = ("static", "pow2", "hdp-lockstep", "hdp-offload-lockstep", "hdp-balance")
_STEPS = (("communication", "static", "hdp-lockstep"), ("offload", "hdp-lockstep", "hdp-offload-lockstep"),
          ("balance", "hdp-offload-lockstep", "hdp-balance"))


def gain_shares(step: Dict[str, float]) -> Dict[str, float]:
    """Each ablation step's share of log(static / hdp-balance) (module docstring)."""
    total = math.log(step["static"] / step["hdp-balance"])
    if abs(total) < 1e-12:
        return {name: float("nan") for name, _, _ in _STEPS}
    return {name: math.log(step[a] / step[b]) / total for name, a, b in _STEPS}


def compare_distributions(items: Sequence[str], *, model: str = "llama-7b", gpus: int = 1024,
                          gpus_per_node: int = 8, context: int = 2 << 20, tokens: int = 32 << 20,
                          seed: int = 0, cluster: str = "h100-nvlink-ib400",
                          labels: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Simulates :data:`ROWS` on one batch of each distribution; returns the JSON document."""
    from . import simulate_batch
    from .__main__ import read_lengths
    from .strategies import split_at_context

    out: Dict[str, Any] = {"config": {"model": model, "gpus": gpus, "gpus_per_node": gpus_per_node,
                                      "context": context, "global_batch_tokens": tokens, "seed": seed,
                                      "cluster": cluster, "rows": list(ROWS)},
                           "distributions": {}}
    for item in items:
        if item in SOURCES:
            name, source, corpus = item, SOURCES[item], None
        else:
            corpus = read_lengths(item)
            name = (labels or {}).get(item, item)
            source = f"{item} ({corpus.size:,} documents, {int(corpus.sum()):,} tokens; drawn without replacement)"
        raw = draw_batch(item, tokens, seed=seed, corpus=corpus)
        lens = split_at_context(raw, context)
        res = {r.strategy: r for r in simulate_batch(lens, model, gpus, gpus_per_node, list(ROWS), cluster)}
        step = {k: r.step_time_s for k, r in res.items()}
        out["distributions"][name] = {
            "source": source, "documents": int(raw.size), "tokens": int(raw.sum()), "histogram": histogram(raw),
            "speedup": {k: step["static"] / v for k, v in step.items()},
            "gain_share": gain_shares(step),
            "rows": {k: {"step_time_s": r.step_time_s, "breakdown_share": r.to_dict()["breakdown_share"],
                         "local_tokens": r.to_dict()["local_tokens"] / max(r.tokens, 1),
                         "max_ring": r.info.get("max_ring", 1)} for k, r in res.items()}}
    return out


def compare_table(doc: Dict[str, Any]) -> str:
    """The side-by-side text table of :func:`compare_distributions`'s document."""
    c = doc["config"]
    lines = [f"predicted at scale, one {c['global_batch_tokens'] >> 20}M-token global batch per distribution "
             f"(seed {c['seed']}): {c['model']} on {c['gpus']:,} GPUs, {c['context'] >> 10}K context",
             f"{'distribution':<14} {'docs<=4K':>8} {'tok>128K':>8} {'pow2':>6} {'+comm':>6} {'+offl':>6} "
             f"{'+bal':>6}  gain from comm / offload / balance  local tokens (HDP+bal)"]
    for name, d in doc["distributions"].items():
        h, s, g = d["histogram"], d["speedup"], d["gain_share"]
        shares = " / ".join("  -  " if g[k] != g[k] else f"{g[k]:>4.0%}" for k in ("communication", "offload", "balance"))
        lines.append(f"{name:<14} {h['docs_le_4K']:>8.0%} {h['tokens_gt_128K']:>8.0%} {s['pow2']:>5.2f}x "
                     f"{s['hdp-lockstep']:>5.2f}x {s['hdp-offload-lockstep']:>5.2f}x {s['hdp-balance']:>5.2f}x  "
                     f"{shares:>34}  {d['rows']['hdp-balance']['local_tokens']:>6.0%}")
    lines.append("speed-ups over static DP x CP; +comm = HDP's dynamic communication without the balance scheduler "
                 "(lockstep slots), +offl = with selective offloading, +bal = with the balance scheduler")
    lines.append("sources:")
    lines += [f"  {name}: {d['source']}" for name, d in doc["distributions"].items()]
    return "\n".join(lines)


def compare_png(doc: Dict[str, Any], path: str) -> None:
    """Tokens by document length per distribution, and the speed-ups side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = doc["distributions"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, d in ds.items():
        h = d["histogram"]
        tot = max(sum(h["tokens"]), 1)
        a.step(h["edges"][1:], [t / tot for t in h["tokens"]], where="post", label=name)
    a.set(xscale="log", xlabel="document length (tokens, power-of-two bins)", ylabel="share of tokens",
          title="tokens by document length")
    a.legend(fontsize=8)
    rows = [r for r in ROWS if r != "static"]
    w = 0.8 / len(rows)
    xs = np.arange(len(ds))
    for i, r in enumerate(rows):
        b.bar(xs + (i - (len(rows) - 1) / 2) * w, [d["speedup"][r] for d in ds.values()], w, label=r)
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(xs, list(ds), fontsize=8)
    b.set(ylabel="speed-up over static DP x CP", title="predicted at scale")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
