"""Tokenizers for preparing and streaming corpora: built-in byte level, or an HF tokenizer on disk.

Nothing is ever downloaded: an HF tokenizer is read from a local ``tokenizer.json`` (the
``tokenizers`` library) or a local directory that ``transformers.AutoTokenizer`` can load with
``local_files_only=True``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """Text to token ids."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256, no special tokens)."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    @staticmethod
    def decode(ids: np.ndarray) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local path (no special tokens added)."""

    def __init__(self, path: str) -> None:
        p = Path(path)
        self.name = str(p.resolve())
        file = p / "tokenizer.json" if p.is_dir() else p
        try:
            if file.is_file():
                from tokenizers import Tokenizer as _Tok

                tok = _Tok.from_file(str(file))
                self._encode = lambda t: tok.encode(t, add_special_tokens=False).ids
                self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
            elif p.is_dir():
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
                self._encode = lambda t: tok(t, add_special_tokens=False)["input_ids"]
                self.vocab_size = int(len(tok))
            else:
                raise FileNotFoundError(f"no such file or directory: {p}")
        except ImportError as e:
            raise RuntimeError(f"tokenizer {path}: loading it needs {e.name} (pip install {e.name})") from e
        except Exception as e:
            raise RuntimeError(f"tokenizer {path}: cannot be loaded from disk: {type(e).__name__}: {e}") from e

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._encode(text), dtype=np.int64)


def load_tokenizer(spec: str = "bytes") -> Tokenizer:
    """``"bytes"`` (built-in byte level) or a local path to an HF tokenizer (file or directory).

    Raises a :class:`RuntimeError` naming the path if it cannot be read; never downloads.
    """
    if spec in ("bytes", "byte", None):
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise RuntimeError(f"tokenizer {spec!r}: no such file or directory (use 'bytes' for the built-in "
                           "byte-level tokenizer, or a local path to an HF tokenizer)")
    return HFTokenizer(spec)
