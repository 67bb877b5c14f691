"""Synthetic sequence-length generators matching the ByteScale paper's published corpus statistics.

Each corpus is a mixture of log-uniform length segments; the segments' sample probabilities are
solved (at import) so that the published statistics hold in expectation:

``byted`` (the paper's in-house corpus, 2M context):
  * ~80% of samples are <= 4K tokens;
  * 1% of samples are >= 128K and carry 44.3% of the tokens;
  * 0.05% of samples reach 2M (exactly 2,097,152) and carry 12.1% of the tokens;
  * 37% of the tokens are in sequences > 256K.
``github`` (code, 2M context):
  * 16.2% of the tokens are in sequences > 128K; 9.8% in sequences > 256K.

Segment shapes (log-uniform inside each) are our choice where the paper is silent: byted
[64, 4K] / [4K, ~60K] / [128K, 256K] / [256K, 480K] / 2M; github [128, 8K] / [8K, 128K] /
[128K, 256K] / [256K, 2M]. tests/test_synthetic.py checks the statistics on large samples.

``scale`` multiplies every length (e.g. 1/256 turns 2M into 8K for CPU demos) keeping the shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CORPORA", "sample_lengths", "global_batch_lengths", "corpus_stats"]

K = 1024
MAX_CONTEXT = 2 * K * K  # 2,097,152


@dataclass(frozen=True)
class _Segment:
    lo: int
    hi: int  # == lo for a point mass

    @property
    def mean(self) -> float:
        if self.hi == self.lo:
            return float(self.lo)
        return (self.hi - self.lo) / math.log(self.hi / self.lo)


def _loguniform_hi_for_mean(lo: float, mean: float) -> float:
    """hi such that log-uniform [lo, hi] has the given mean (bisection; mean > lo)."""
    a, b = lo * (1 + 1e-9), lo * 1e4
    for _ in range(200):
        mid = math.sqrt(a * b)
        if _Segment(int(lo), int(mid)).mean < mean:
            a = mid
        else:
            b = mid
    return math.sqrt(a * b)


def _solve_byted() -> Tuple[List[_Segment], List[float]]:
    pA, pE = 0.80, 0.0005
    A, C, D, E = _Segment(64, 4 * K), _Segment(128 * K, 256 * K), _Segment(256 * K, 480 * K), \
        _Segment(MAX_CONTEXT, MAX_CONTEXT)
    # Token shares: E = 12.1%, D+E = 37%, C+D+E = 44.3%; samples: A = 80%, C+D+E = 1% (C, D take
    # what the shares imply), B = the rest, its upper bound solved so the total matches T.
    T = pE * E.mean / 0.121
    pD = (0.37 * T - pE * E.mean) / D.mean
    pC = (0.443 - 0.37) * T / C.mean
    pB = 1.0 - pA - pC - pD - pE
    b_tokens = T - (pA * A.mean + pC * C.mean + pD * D.mean + pE * E.mean)
    B = _Segment(4 * K, int(round(_loguniform_hi_for_mean(4 * K, b_tokens / pB))))
    return [A, B, C, D, E], [pA, pB, pC, pD, pE]


def _solve_github() -> Tuple[List[_Segment], List[float]]:
    segs = [_Segment(128, 8 * K), _Segment(8 * K, 128 * K), _Segment(128 * K, 256 * K),
            _Segment(256 * K, MAX_CONTEXT)]
    m = [s.mean for s in segs]
    pA = 0.85
    pC = pD = 0.0
    for _ in range(50):  # fixed point: shares of C+D = 16.2%, D = 9.8%
        pB = 1.0 - pA - pC - pD
        short_tokens = pA * m[0] + pB * m[1]
        T = short_tokens / (1 - 0.162)
        pD = 0.098 * T / m[3]
        pC = (0.162 - 0.098) * T / m[2]
    return segs, [pA, 1.0 - pA - pC - pD, pC, pD]


CORPORA: Dict[str, Tuple[List[_Segment], List[float]]] = {
    "byted": _solve_byted(),
    "github": _solve_github(),
}


def sample_lengths(corpus: str, n: int, seed: int = 0, scale: float = 1.0,
                   max_len: Optional[int] = None) -> np.ndarray:
    """``n`` sequence lengths from ``corpus`` ("byted" or "github"), int64, all >= 1."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {sorted(CORPORA)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    segs, probs = CORPORA[corpus]
    rng = np.random.default_rng(seed)
    which = rng.choice(len(segs), size=n, p=np.asarray(probs) / sum(probs))
    lo = np.array([s.lo for s in segs], dtype=np.float64)[which]
    hi = np.array([s.hi for s in segs], dtype=np.float64)[which]
    u = rng.random(n)
    lengths = np.exp(np.log(lo) + u * (np.log(hi) - np.log(lo)))
    lengths = np.maximum(1, np.round(lengths * scale)).astype(np.int64)
    if max_len is not None:
        lengths = np.minimum(lengths, int(max_len))
    return lengths


def global_batch_lengths(corpus: str, tokens: int, seed: int = 0, scale: float = 1.0,
                         max_len: Optional[int] = None) -> np.ndarray:
    """Lengths of one global batch: samples drawn until ``tokens`` would be exceeded."""
    out: List[int] = []
    total = 0
    chunk_seed = seed
    while True:
        chunk = sample_lengths(corpus, 4096, seed=chunk_seed, scale=scale, max_len=max_len)
        chunk_seed += 1_000_003
        for n in chunk.tolist():
            if out and total + n > tokens:
                return np.asarray(out, dtype=np.int64)
            out.append(n)
            total += n


def corpus_stats(lengths: Sequence[int], scale: float = 1.0) -> Dict[str, float]:
    """The statistics the paper publishes, measured on ``lengths`` (thresholds scaled)."""
    x = np.asarray(lengths, dtype=np.float64)
    tot = x.sum()
    t = lambda k: k * K * scale  # noqa: E731
    return {
        "samples_le_4k": float((x <= t(4)).mean()),
        "samples_ge_128k": float((x >= t(128)).mean()),
        "tokens_ge_128k": float(x[x >= t(128)].sum() / tot),
        "tokens_gt_128k": float(x[x > t(128)].sum() / tot),
        "tokens_gt_256k": float(x[x > t(256)].sum() / tot),
        "samples_2m": float((x >= MAX_CONTEXT * scale).mean()),
        "tokens_2m": float(x[x >= MAX_CONTEXT * scale].sum() / tot),
    }
