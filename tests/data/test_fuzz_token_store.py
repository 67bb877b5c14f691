"""Fuzzing the token-store reader with a bounded time (hypothesis, derandomized: the same examples
on every run; each test a few seconds).

A truncated or corrupted ``.idx``/``.bin`` pair (wrong magic, version or dtype code, sequence
lengths or pointers out of range, a document index that does not span the sequences) must raise a
ValueError naming the file, never crash, hang or open as a store that returns wrong tokens: a store
that opens must hand out exactly ``length(i)`` tokens of every document, all inside ``.bin``.
"""
from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bytescale.data.token_store import TokenStore, TokenStoreWriter, write_index
from fuzz_utils import flip_bits

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

_DOCS = [np.arange(n, dtype=np.int64) % 251 for n in (5, 0, 17, 1, 9)]
_HEADER = 9 + 8 + 1 + 8 + 8


def _valid(dtype=np.uint16):
    """(idx bytes, bin bytes) of a small valid store, two of its documents of two sequences."""
    with tempfile.TemporaryDirectory() as d:
        prefix = Path(d) / "data"
        with TokenStoreWriter(prefix, dtype) as w:
            for doc in _DOCS:
                w.add(doc)
        lens = np.array([3, 2, 0, 10, 7, 1, 9])  # documents [5, 0, 17, 1, 9] split into sequences
        write_index(str(prefix) + ".idx", np.dtype(dtype), lens, np.array([0, 2, 3, 5, 6, 7]))
        return (Path(str(prefix) + ".idx").read_bytes(), Path(str(prefix) + ".bin").read_bytes())


_IDX, _BIN = _valid()


def _open(idx: bytes, bin_: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        prefix = Path(d) / "store"
        Path(str(prefix) + ".idx").write_bytes(idx)
        Path(str(prefix) + ".bin").write_bytes(bin_)
        try:
            store = TokenStore(prefix)
        except ValueError as e:
            assert "token store" in str(e) and "store." in str(e), str(e)  # names the file
            return
        total = store._bin.size
        for i in range(len(store)):
            n = store.length(i)
            assert n >= 0
            arr = store.array(i)
            assert arr.size == n, (i, n, arr.size)
            assert 0 <= int(store._start[i]) and int(store._start[i]) + n <= total
            if n:
                store.tokens(i, 0, n)
        del store


def test_the_valid_store_reads_back():
    with tempfile.TemporaryDirectory() as d:
        prefix = Path(d) / "store"
        Path(str(prefix) + ".idx").write_bytes(_IDX)
        Path(str(prefix) + ".bin").write_bytes(_BIN)
        store = TokenStore(prefix)
        assert [store.length(i) for i in range(len(store))] == [len(x) for x in _DOCS]
        for i, doc in enumerate(_DOCS):
            assert np.array_equal(store.array(i), doc)
        del store


def test_every_truncation_of_the_index_is_an_error():
    for n in range(len(_IDX)):
        with pytest.raises(ValueError, match=r"store\.idx"):
            _open_strict(_IDX[:n], _BIN)


def _open_strict(idx: bytes, bin_: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        prefix = Path(d) / "store"
        Path(str(prefix) + ".idx").write_bytes(idx)
        Path(str(prefix) + ".bin").write_bytes(bin_)
        del_store = TokenStore(prefix)
        del del_store


@FUZZ
@given(st.integers(0, len(_BIN) - 1))
def test_truncated_data_file(n):
    with pytest.raises(ValueError, match=r"store\.bin"):
        _open_strict(_IDX, _BIN[:n])


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_random_files(idx, bin_):
    _open(idx, bin_)


@FUZZ
@given(st.lists(st.integers(0, len(_IDX) * 8 - 1), min_size=1, max_size=4))
def test_index_bit_flips(bits):
    _open(flip_bits(_IDX, bits), _BIN)


@FUZZ
@given(st.integers(_HEADER, len(_IDX) - 4), st.sampled_from([4, 8]),
       st.integers(-2**31, 2**31 - 1) | st.sampled_from([0, 1, 2, 3, 7, 30, 31, 33, 64, 2**31 - 1]))
def test_index_entries_out_of_range(offset, width, value):
    data = bytearray(_IDX)
    if width == 8 and offset + 8 > len(data):
        offset = len(data) - 8
    data[offset:offset + width] = int(value).to_bytes(width, "little", signed=True)
    _open(bytes(data), _BIN)


@FUZZ
@given(st.binary(min_size=9, max_size=9), st.integers(0, 2**64 - 1), st.integers(0, 255),
       st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_bad_headers(magic, version, code, n_seq, n_doc):
    header = struct.pack("<9sQBQQ", magic, version, code, n_seq, n_doc)
    _open(header + _IDX[_HEADER:], _BIN)
    good = _IDX[:9]
    _open(good + struct.pack("<QBQQ", 1, code, n_seq, n_doc) + _IDX[_HEADER:], _BIN)
    _open(_IDX[:18] + struct.pack("<QQ", n_seq % 64, n_doc % 64) + _IDX[_HEADER:], _BIN)


def test_named_corruptions():
    def field(data, off, fmt, value):
        data = bytearray(data)
        struct.pack_into(fmt, data, off, value)
        return bytes(data)

    n_seq = 7
    lens_off, ptr_off, doc_off = _HEADER, _HEADER + 4 * n_seq, _HEADER + 12 * n_seq
    cases = [
        (field(_IDX, 0, "<9s", b"NOTANIDX\0"), "not a Megatron index"),
        (field(_IDX, 9, "<Q", 2), "index version 2"),
        (field(_IDX, 17, "<B", 9), "unknown dtype code 9"),
        (field(_IDX, lens_off + 4, "<i", -2), "negative"),
        (field(_IDX, ptr_off + 8 * 3, "<q", -6), "outside"),
        (field(_IDX, ptr_off + 8 * 5, "<q", 1 << 40), "outside|shorter"),
        (field(_IDX, ptr_off + 8 * 5, "<q", 15), "aligned|back to back"),
        (field(_IDX, doc_off + 8, "<q", 9), "document index"),
    ]
    for idx, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _open_strict(idx, _BIN)
