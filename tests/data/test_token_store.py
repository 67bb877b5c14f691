"""Token store: Megatron .bin/.idx layout written independently here, random access, bad files."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from bytescale.data import TokenStore, TokenStoreWriter
from bytescale.data.token_store import dtype_for_vocab


def _megatron_files(prefix, docs_of_sequences, dtype=np.uint16, code=8):
    """Write a store the way Megatron's builder lays it out, by hand (independent of our writer):
    documents made of several sequences, int32 lengths, int64 byte pointers, int64 doc index."""
    seqs = [np.asarray(s, dtype=dtype) for doc in docs_of_sequences for s in doc]
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)]).astype(np.int64)
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs_of_sequences])]).astype(np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())


def test_reads_megatron_layout_with_multi_sequence_documents(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 60000, n) for n in ns] for ns in ([5, 3], [7], [1, 1, 1], [40])]
    _megatron_files(tmp_path / "corpus_text_document", docs)
    st = TokenStore(tmp_path / "corpus_text_document")  # Megatron prefix
    assert len(st) == 4 and st.dtype == np.uint16
    assert [st.length(i) for i in range(4)] == [8, 7, 3, 40]
    for i, doc in enumerate(docs):
        full = np.concatenate(doc).astype(np.int64)
        assert st.tokens(i, 0, len(full)).tolist() == full.tolist()
        for a, b in [(0, 1), (1, min(5, len(full))), (len(full) - 1, len(full)), (2, 2)]:
            got = st.tokens(i, a, b)
            assert got.dtype == torch.int64 and got.tolist() == full[a:b].tolist()
    assert TokenStore(str(tmp_path / "corpus_text_document.idx")).length(3) == 40


def test_writer_round_trip_and_dtypes(tmp_path):
    rng = np.random.default_rng(1)
    for vocab in (256, 50000, 200000):
        dt = dtype_for_vocab(vocab)
        docs = [rng.integers(0, vocab, n) for n in (1, 17, 1000, 3)]
        d = tmp_path / f"v{vocab}"
        d.mkdir()
        with TokenStoreWriter(d / "data", dt) as w:
            for x in docs:
                w.add(x)
        st = TokenStore(d)
        assert st.lengths.tolist() == [1, 17, 1000, 3]
        for i, x in enumerate(docs):
            assert st.tokens(i, 0, len(x)).tolist() == x.tolist()
        with pytest.raises(IndexError, match="outside document 1 of length 17"):
            st.tokens(1, 5, 18)


def test_writer_rejects_out_of_range_ids_and_leaves_no_store(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        with TokenStoreWriter(tmp_path / "data", np.uint8) as w:
            w.add([1, 2, 300])
    assert not (tmp_path / "data.idx").exists() and not (tmp_path / "data.bin").exists()


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no index"):
        TokenStore(tmp_path / "nothing")
    _megatron_files(tmp_path / "x", [[[1, 2, 3]]])
    raw = bytearray((tmp_path / "x.idx").read_bytes())
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX\x00" + bytes(raw[9:]))
    (tmp_path / "bad.bin").write_bytes((tmp_path / "x.bin").read_bytes())
    with pytest.raises(ValueError, match="not a Megatron index"):
        TokenStore(tmp_path / "bad")
    (tmp_path / "short.idx").write_bytes(bytes(raw[:40]))
    (tmp_path / "short.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="truncated"):
        TokenStore(tmp_path / "short")
    (tmp_path / "cut.idx").write_bytes(bytes(raw))
    (tmp_path / "cut.bin").write_bytes((tmp_path / "x.bin").read_bytes()[:2])
    with pytest.raises(ValueError, match="shorter than its index"):
        TokenStore(tmp_path / "cut")
