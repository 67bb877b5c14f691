"""Document-length distributions the simulator compares, each with where its numbers come from.

A distribution draws one global batch of document lengths (seeded). Four are built in:

* ``byted`` and ``github``: the ByteScale paper's published statistics of its two corpora
  (:mod:`bytescale.data.synthetic`; segment shapes ours where the paper is silent): heavy tails.
* ``magi-short`` and ``magi-long``: the two binned document-length histograms MagiAttention's
  distributed-attention benchmark samples from (SandAI-org/MagiAttention,
  ``exps/dist_attn/benchmark/utils.py``, ``varlen_short_seqlen_distribution`` -- documents up to
  64K, following the ChatQA 2 data (Xu et al. 2024) its blog cites -- and
  ``varlen_long_seqlen_distribution``, "data distribution for seqlen > 64k"). The bins and their
  document shares are copied below as published (the long one's add up to 1.31: normalised when
  drawn, as that benchmark's sampler does); a length is drawn uniformly inside its bin, as
  that benchmark's own sampler does.

Anything else is a token store directory or a lengths file (:func:`bytescale.sim.__main__.read_lengths`):
its documents drawn uniformly at random without replacement (seeded) until the batch is full.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["BINNED", "SOURCES", "Binned", "draw_batch", "histogram"]

K = 1024
_MAGI = "SandAI-org/MagiAttention exps/dist_attn/benchmark/utils.py"


@dataclass(frozen=True)
class Binned:
    """A published histogram: bin edges in tokens and each bin's share of the documents."""

    edges: Tuple[float, ...]
    shares: Tuple[float, ...]
    source: str

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        p = np.asarray(self.shares, dtype=np.float64)
        which = rng.choice(len(p), size=n, p=p / p.sum())
        lo = np.asarray(self.edges[:-1])[which]
        hi = np.asarray(self.edges[1:])[which]
        return np.maximum(1, np.floor(lo + rng.random(n) * (hi - lo + 1))).astype(np.int64)


def _bins(edges_k: Sequence[float], shares: Sequence[float], source: str) -> Binned:
    return Binned(tuple(float(e) * K for e in edges_k), tuple(float(s) for s in shares), source)


BINNED: Dict[str, Binned] = {
    "magi-short": _bins(
        [0, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 15, 20, 64],
        [0.0766, 0.1651, 0.1246, 0.0972, 0.1324, 0.0927, 0.0720, 0.0519, 0.0379, 0.0264, 0.0380, 0.0245,
         0.0145, 0.0097, 0.0122, 0.0128, 0.0051, 0.0064],
        f"{_MAGI}: varlen_short_seqlen_distribution (documents <= 64K; ChatQA 2 data)"),
    "magi-long": _bins(
        [0, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
        [0.16, 0.05, 0.04, 0.06, 0.08, 0.21, 0.4, 0.2, 0.05, 0.04, 0.01, 0.01],
        f"{_MAGI}: varlen_long_seqlen_distribution (its 'seqlen > 64k' mix, up to 4M)"),
}

SOURCES: Dict[str, str] = {
    "byted": "ByteScale paper (Ge et al. 2025), its in-house corpus's published statistics "
             "(bytescale.data.synthetic)",
    "github": "ByteScale paper (Ge et al. 2025), its GitHub corpus's published statistics "
              "(bytescale.data.synthetic)",
    **{k: v.source for k, v in BINNED.items()},
}


def _fill(draw, tokens: int) -> np.ndarray:
    """Lengths from ``draw(n)`` chunks until ``tokens`` would be exceeded (at least one document)."""
    out: List[np.ndarray] = []
    total = 0
    while True:
        chunk = draw(4096)
        if chunk.size == 0:
            break
        c = np.cumsum(chunk) + total
        k = int(np.searchsorted(c, tokens, side="right"))
        if k < chunk.size:
            out.append(chunk[:max(k, 1 if not out and total == 0 else k)])
            break
        out.append(chunk)
        total = int(c[-1])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def draw_batch(name: str, tokens: int, seed: int = 0, corpus: Optional[np.ndarray] = None) -> np.ndarray:
    """One global batch of at most ``tokens`` tokens (at least one document) from distribution
    ``name`` (:data:`SOURCES`), or, given ``corpus`` (its documents' lengths), from that corpus."""
    rng = np.random.default_rng(seed)
    if corpus is not None:
        order = rng.permutation(np.asarray(corpus, dtype=np.int64))
        pos = [0]

        def take(n: int) -> np.ndarray:
            a = order[pos[0]:pos[0] + n]
            pos[0] += n
            return a

        return _fill(take, tokens)
    if name in BINNED:
        return _fill(lambda n: BINNED[name].sample(n, rng), tokens)
    if name in ("byted", "github"):
        from ..data.synthetic import global_batch_lengths

        return global_batch_lengths(name, tokens, seed=seed)
    raise ValueError(f"unknown distribution {name!r}; choose from {', '.join(SOURCES)} or give a token store "
                     "directory / lengths file")


def histogram(lengths: np.ndarray) -> Dict[str, list]:
    """Documents and tokens per power-of-two length bin (``edges[i] < length <= edges[i+1]``), and
    the shares a reader asks about: documents <= 4K, tokens in documents > 32K / 128K / 1M."""
    x = np.asarray(lengths, dtype=np.int64)
    hi = max(1, int(np.ceil(np.log2(max(2, int(x.max()) if x.size else 2)))))
    edges = [0] + [1 << k for k in range(0, hi + 1)]
    idx = np.searchsorted(np.asarray(edges[1:]), x, side="left")
    docs = np.bincount(idx, minlength=len(edges) - 1)
    toks = np.bincount(idx, weights=x, minlength=len(edges) - 1)
    tot = max(int(x.sum()), 1)
    return {"edges": edges, "documents": docs.tolist(), "tokens": [int(t) for t in toks],
            "docs_le_4K": float((x <= 4 * K).mean()) if x.size else 0.0,
            **{f"tokens_gt_{k}": float(x[x > v].sum() / tot) for k, v in (("32K", 32 * K), ("128K", 128 * K),
                                                                            ("1M", K * K))}}
