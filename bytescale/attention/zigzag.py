"""The zig-zag layout, the one Python definition (mirror of csrc/common/zigzag.h).

A length-s sequence over an N-rank ring is cut into 2N chunks with bounds b_j = floor(j*s/(2N));
ring position i holds chunks i and 2N-1-i (in that order), so every position gets the same share
of causal attention work for any s (no padding; chunks may be empty when s < 2N).
tests/planner/test_microbatch_plan.py checks it against the C++ planner's token counts.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

__all__ = ["chunk", "chunks_of", "local_tokens", "local_ranges", "shard_index"]


def chunk(s: int, n: int, j: int) -> Tuple[int, int]:
    """Token range [a, b) of chunk ``j`` (0 <= j < 2n) of a length-``s`` sequence on an ``n`` ring."""
    return (j * s) // (2 * n), ((j + 1) * s) // (2 * n)


def chunks_of(n: int, i: int) -> Tuple[int, int]:
    """The two chunk indices ring position ``i`` of ``n`` holds, in token order on that rank."""
    return i, 2 * n - 1 - i


def local_ranges(s: int, n: int, i: int) -> List[Tuple[int, int]]:
    """Ranges [a, b) of a length-``s`` sequence held by ring position ``i`` of ``n``, in rank order
    (the whole sequence for ``n == 1``)."""
    if n == 1:
        return [(0, s)]
    return [chunk(s, n, j) for j in chunks_of(n, i)]


def local_tokens(s: int, n: int, i: int) -> int:
    """Tokens of a length-``s`` sequence held by ring position ``i`` of an ``n`` ring."""
    return sum(b - a for a, b in local_ranges(s, n, i))


def shard_index(doc_lens: Sequence[int], n: int, pos: int) -> np.ndarray:
    """Indices (into packed full documents) of the tokens ring position ``pos`` holds, in order."""
    parts = []
    start = 0
    for s in doc_lens:
        for a, b in local_ranges(int(s), n, pos):
            parts.append(np.arange(start + a, start + b, dtype=np.int64))
        start += int(s)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
