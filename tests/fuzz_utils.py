"""Helpers shared by the bounded-time fuzz tests."""
from __future__ import annotations

from typing import Iterable


def flip_bits(data: bytes, bits: Iterable[int]) -> bytes:
    """``data`` with each bit index in ``bits`` inverted (bit ``b`` is bit ``b % 8`` of byte ``b // 8``)."""
    out = bytearray(data)
    for b in bits:
        out[b // 8] ^= 1 << (b % 8)
    return bytes(out)
