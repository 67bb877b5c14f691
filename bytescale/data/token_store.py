"""A memory-mapped token store in Megatron's indexed ``.bin``/``.idx`` layout.

A store is a pair of files sharing a prefix: ``PREFIX.bin`` holds the token ids of every document
back to back (little-endian, one fixed dtype), and ``PREFIX.idx`` indexes them:

======================  ==========================================================================
``MMIDIDX\\x00\\x00``     9-byte magic
version                 ``<Q`` (1)
dtype code              ``<B``: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
                        8 uint16
sequence count          ``<Q`` (S)
document count          ``<Q`` (D + 1 entries of the document index)
sequence lengths        int32[S], tokens per sequence
sequence pointers       int64[S], byte offset of each sequence in ``.bin``
document index          int64[D + 1], first sequence of each document (0 ... S)
======================  ==========================================================================

Files written by Megatron's ``preprocess_data.py`` (and by :mod:`bytescale.data.prepare`) can be
read as they are. A sample of the store is a *document*: the concatenation of its sequences (one
sequence per document unless sentences were split), which must lie back to back in ``.bin``.
Lengths come from the index alone; reading a token range touches only the pages of that range.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import numpy as np
import torch

__all__ = ["TokenStore", "TokenStoreWriter", "resolve_prefix", "dtype_for_vocab", "write_index",
           "DTYPE_CODES"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: Dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
_CODE_OF = {v: k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a vocabulary (uint8, uint16 or int32)."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def resolve_prefix(path: Union[str, os.PathLike]) -> Path:
    """``DIR`` (holding ``data.idx`` or exactly one ``*.idx``), ``PREFIX``, or ``PREFIX.idx/.bin``."""
    p = Path(path)
    if p.suffix in (".idx", ".bin") and p.with_suffix(".idx").exists():
        return p.with_suffix("")
    if p.is_dir():
        if (p / "data.idx").exists():
            return p / "data"
        idx = sorted(p.glob("*.idx"))
        if len(idx) == 1:
            return idx[0].with_suffix("")
        raise FileNotFoundError(f"token store: {p} holds {len(idx)} .idx files (expected data.idx or exactly one)")
    if Path(str(p) + ".idx").exists():
        return p
    raise FileNotFoundError(f"token store: no index at {p} (looked for {p}/data.idx, {p}.idx)")


def write_index(idx_path: Union[str, os.PathLike], dtype: np.dtype, seq_lengths: np.ndarray,
                doc_index: Optional[np.ndarray] = None) -> None:
    """Write a ``.idx`` for sequences stored back to back (one document per sequence by default)."""
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF:
        raise ValueError(f"token store: dtype {dtype} has no Megatron code")
    lengths = np.ascontiguousarray(seq_lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("token store: sequence lengths must lie in [0, 2**31)")
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    docs = np.arange(lengths.size + 1, dtype=np.int64) if doc_index is None else np.asarray(doc_index, np.int64)
    tmp = Path(str(idx_path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[dtype], lengths.size, docs.size))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(docs.tobytes())
    os.replace(tmp, idx_path)


class TokenStore:
    """Read-only, memory-mapped token store; a :class:`~bytescale.data.dataset.TokenDataset`.

    Args:
        path: a directory holding ``data.idx``/``data.bin`` (what ``prepare`` writes), or a
            Megatron prefix (``/data/corpus_text_document``), or its ``.idx``/``.bin`` path.

    ``len(store)`` documents; ``store.length(i)`` from the index only; ``store.tokens(i, a, b)``
    returns tokens ``[a, b)`` of document ``i`` as int64, reading only that range. ``lengths``
    is the int64 array of every document's length. Opening is O(1) in the corpus size apart from
    the document lengths (8 bytes per document, computed once).
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.prefix = resolve_prefix(path)
        idx_path, bin_path = Path(str(self.prefix) + ".idx"), Path(str(self.prefix) + ".bin")
        if not bin_path.exists():
            raise FileNotFoundError(f"token store: {idx_path} has no data file {bin_path}")
        size = idx_path.stat().st_size
        if size < _HEADER.size:
            raise ValueError(f"token store: {idx_path} is truncated ({size} bytes)")
        with open(idx_path, "rb") as f:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise ValueError(f"token store: {idx_path} is not a Megatron index (magic {magic!r})")
        if version != VERSION:
            raise ValueError(f"token store: {idx_path} has index version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise ValueError(f"token store: {idx_path} has unknown dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        need = _HEADER.size + n_seq * 12 + n_doc * 8
        if size < need:
            raise ValueError(f"token store: {idx_path} is truncated ({size} bytes, the header needs {need})")
        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.seq_lengths = np.frombuffer(self._idx, np.int32, n_seq, off)
        self.seq_pointers = np.frombuffer(self._idx, np.int64, n_seq, off + 4 * n_seq)
        self.doc_index = np.frombuffer(self._idx, np.int64, n_doc, off + 12 * n_seq)
        if n_doc == 0 or self.doc_index[0] != 0 or self.doc_index[-1] != n_seq or np.any(np.diff(self.doc_index) < 0):
            raise ValueError(f"token store: {idx_path} has an inconsistent document index")
        bin_size = bin_path.stat().st_size
        if n_seq and int(self.seq_pointers[-1]) + int(self.seq_lengths[-1]) * self.dtype.itemsize > bin_size:
            raise ValueError(f"token store: {bin_path} ({bin_size} bytes) is shorter than its index says")
        self._check_sequences(idx_path, bin_path, bin_size)
        # Documents as (first token, length) in units of tokens; sequences of a document must be
        # contiguous (always true for files written in order).
        first_seq = self.doc_index[:-1]
        seq_cum = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(self.seq_lengths, out=seq_cum[1:])
        self.lengths = (seq_cum[self.doc_index[1:]] - seq_cum[first_seq]).astype(np.int64)
        if n_seq:
            is_start = np.zeros(n_seq + 1, dtype=bool)
            is_start[self.doc_index] = True
            step = self.seq_pointers[1:] - self.seq_pointers[:-1]
            contiguous = step == self.seq_lengths[:-1].astype(np.int64) * self.dtype.itemsize
            if not np.all(contiguous | is_start[1:n_seq]):
                raise ValueError(f"token store: {idx_path}: the sequences of a document are not back to back in .bin")
            self._start = np.where(self.lengths > 0, self.seq_pointers[np.minimum(first_seq, n_seq - 1)], 0) // self.dtype.itemsize
        else:
            self._start = np.zeros(len(self.lengths), dtype=np.int64)
        self._bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, self.dtype)
        self.bin_path, self.idx_path = bin_path, idx_path

    def _check_sequences(self, idx_path: Path, bin_path: Path, bin_size: int) -> None:
        """Every sequence lies inside ``.bin`` at a token boundary (a corrupted index raises here
        instead of handing out tokens of the wrong place)."""
        if not len(self.seq_lengths):
            return
        lens = self.seq_lengths.astype(np.int64)
        ptrs = self.seq_pointers
        bad = lens < 0
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"token store: {idx_path}: sequence {k} has negative length {int(lens[k])}")
        item = self.dtype.itemsize
        if np.any(ptrs % item):
            k = int(np.argmax(ptrs % item != 0))
            raise ValueError(f"token store: {idx_path}: sequence {k} starts at byte {int(ptrs[k])}, "
                             f"not aligned to the {self.dtype} tokens")
        # pointer <= bin_size - bytes, written so that a huge pointer cannot overflow int64
        bad = (ptrs < 0) | (ptrs > bin_size - lens * item)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"token store: {idx_path}: sequence {k} (bytes [{int(ptrs[k])}, "
                             f"{int(ptrs[k])} + {int(lens[k]) * item})) lies outside {bin_path} "
                             f"({bin_size} bytes)")

    def __len__(self) -> int:
        return len(self.lengths)

    def length(self, idx: int) -> int:
        return int(self.lengths[idx])

    def array(self, idx: int, start: int = 0, end: Optional[int] = None) -> np.ndarray:
        """Tokens ``[start, end)`` of document ``idx`` as a read-only view of the mapping (no copy)."""
        n = int(self.lengths[idx])
        end = n if end is None else end
        if not (0 <= start <= end <= n):
            raise IndexError(f"TokenStore: range [{start}, {end}) outside document {idx} of length {n}")
        s = int(self._start[idx])
        return self._bin[s + start:s + end]

    def tokens(self, idx: int, start: int, end: int) -> torch.Tensor:
        return torch.from_numpy(self.array(idx, start, end).astype(np.int64))

    def __repr__(self) -> str:
        return f"TokenStore({str(self.prefix)!r}, documents={len(self)}, tokens={int(self.lengths.sum())}, dtype={self.dtype})"


class TokenStoreWriter:
    """Append documents to ``PREFIX.bin`` and write ``PREFIX.idx`` on :meth:`close` (atomically).

    Both files are written under temporary names and renamed only when complete, so an interrupted
    writer never leaves a store that looks valid.
    """

    def __init__(self, prefix: Union[str, os.PathLike], dtype: Union[np.dtype, type]) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"TokenStoreWriter: dtype {self.dtype} has no Megatron code")
        self._tmp_bin = Path(str(self.prefix) + ".bin.tmp")
        self._f = open(self._tmp_bin, "wb")
        self._lengths: List[int] = []
        self._limit = np.iinfo(self.dtype).max if self.dtype.kind in "ui" else None

    def add(self, tokens: Union[np.ndarray, Iterable[int]]) -> None:
        """Append one document."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"TokenStoreWriter: a document must be 1-D, got shape {arr.shape}")
        if arr.size and self._limit is not None and (int(arr.max()) > self._limit or int(arr.min()) < np.iinfo(self.dtype).min):
            raise ValueError(f"TokenStoreWriter: token ids out of range for {self.dtype}")
        self._f.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self._lengths.append(int(arr.size))

    def add_file(self, store: "TokenStore") -> None:
        """Append every document of another store (same dtype), copying its ``.bin`` in blocks."""
        if store.dtype != self.dtype:
            raise ValueError(f"TokenStoreWriter: cannot append a {store.dtype} store to a {self.dtype} one")
        with open(store.bin_path, "rb") as src:
            while True:
                block = src.read(1 << 24)
                if not block:
                    break
                self._f.write(block)
        self._lengths.extend(int(n) for n in store.lengths)

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def close(self) -> None:
        self._f.close()
        os.replace(self._tmp_bin, str(self.prefix) + ".bin")
        write_index(str(self.prefix) + ".idx", self.dtype, np.asarray(self._lengths, dtype=np.int64))

    def abort(self) -> None:
        self._f.close()
        self._tmp_bin.unlink(missing_ok=True)

    def __enter__(self) -> "TokenStoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
