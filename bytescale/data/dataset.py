"""Token datasets with random access to token ranges.

The HDP loader never materialises a whole global batch on a rank: it asks the dataset for exactly
the token ranges (zig-zag chunks of sharded sequences, whole short sequences) its plan assigns to
this rank, plus one token past each range for the labels.
"""
from __future__ import annotations

from typing import List, Protocol, Sequence

import numpy as np
import torch

__all__ = ["TokenDataset", "InMemoryTokens", "SyntheticTokens"]


class TokenDataset(Protocol):
    """What the loader needs: sequence lengths and token ranges."""

    def __len__(self) -> int: ...

    def length(self, idx: int) -> int: ...

    def tokens(self, idx: int, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of sequence idx as an int64 tensor."""
        ...


class InMemoryTokens:
    """A list of 1-D int64 token tensors."""

    def __init__(self, sequences: Sequence[torch.Tensor]) -> None:
        self.sequences: List[torch.Tensor] = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
        for i, s in enumerate(self.sequences):
            if s.dim() != 1 or s.numel() == 0:
                raise ValueError(f"InMemoryTokens: sequence {i} must be a non-empty 1-D tensor, got shape {tuple(s.shape)}")

    def __len__(self) -> int:
        return len(self.sequences)

    def length(self, idx: int) -> int:
        return int(self.sequences[idx].numel())

    def tokens(self, idx: int, start: int, end: int) -> torch.Tensor:
        return self.sequences[idx][start:end]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SyntheticTokens:
    """Deterministic, learnable synthetic sequences with O(range) random access.

    Sequence i is an arithmetic progression modulo ``vocab`` with a per-sequence start and stride
    (so a model can learn to continue it from context), with a fraction ``noise`` of tokens
    replaced by hashed random tokens. Any token range is computed directly from (seed, i, t).
    """

    def __init__(self, lengths: Sequence[int], vocab_size: int, seed: int = 0, noise: float = 0.1) -> None:
        self.lengths = [int(n) for n in lengths]
        if any(n <= 0 for n in self.lengths):
            raise ValueError("SyntheticTokens: sequence lengths must be positive")
        if vocab_size < 2:
            raise ValueError(f"SyntheticTokens: vocab_size must be >= 2, got {vocab_size}")
        self.vocab = int(vocab_size)
        self.seed = int(seed)
        self.noise = float(noise)

    def __len__(self) -> int:
        return len(self.lengths)

    def length(self, idx: int) -> int:
        return self.lengths[idx]

    def tokens(self, idx: int, start: int, end: int) -> torch.Tensor:
        n = self.lengths[idx]
        if not (0 <= start <= end <= n):
            raise IndexError(f"SyntheticTokens: range [{start}, {end}) outside sequence {idx} of length {n}")
        with np.errstate(over="ignore"):
            key = _mix(np.array([self.seed * 1_000_003 + idx], dtype=np.uint64))[0]
            base = int(key % np.uint64(self.vocab))
            stride = 1 + int((key >> np.uint64(20)) % np.uint64(max(1, min(7, self.vocab - 1))))
            t = np.arange(start, end, dtype=np.uint64)
            tok = (np.uint64(base) + t * np.uint64(stride)) % np.uint64(self.vocab)
            h = _mix(t ^ key)
            noisy = (h % np.uint64(1 << 20)).astype(np.float64) < self.noise * (1 << 20)
            rnd = (h >> np.uint64(24)) % np.uint64(self.vocab)
            tok = np.where(noisy, rnd, tok)
        return torch.from_numpy(tok.astype(np.int64))
