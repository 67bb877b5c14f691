"""Python mirror of csrc/attention/zigzag.h (the one definition of the zig-zag layout).

A length-s sequence over an N-rank ring is cut into 2N chunks with bounds b_j = floor(j*s/(2N));
ring position i holds chunks i and 2N-1-i. tests/test_loader.py checks this against the C++ side.
"""
from __future__ import annotations

from typing import Tuple


def chunk(s: int, n: int, j: int) -> Tuple[int, int]:
    return (j * s) // (2 * n), ((j + 1) * s) // (2 * n)


def chunks_of(n: int, i: int) -> Tuple[int, int]:
    return i, 2 * n - 1 - i


def local_tokens(s: int, n: int, i: int) -> int:
    a = chunk(s, n, i)
    b = chunk(s, n, 2 * n - 1 - i)
    return (a[1] - a[0]) + (b[1] - b[0])
