"""Which tokens of which documents one rank holds in one micro-batch, and how they attend.

A :class:`Layout` is the attention half of a micro-batch plan
(:class:`bytescale.planner.MicroBatchPlan`): the wholly local documents first (whole, in order),
then the documents sharded over the micro-batch's ring, each as its two zig-zag chunks
(:mod:`bytescale.attention.zigzag`). The loader lays tokens out in exactly this order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from . import zigzag
from .ops import ring_attention, varlen_attention

__all__ = ["Layout", "shard", "unshard", "shard_order", "unshard_order", "local_attention"]


def local_attention(q, k, v, doc_lens, softmax_scale=None, causal=True):
    """Attention over wholly local packed documents: bytescale's varlen op (one C++ call for all
    documents, no S x S matrix: flash / cuDNN on CUDA, ATen's fused CPU flash kernel ("sdpa")
    per document on CPU, the same kernels ring steps run)."""
    return varlen_attention(q, k, v, doc_lens, softmax_scale, causal)


@dataclass(frozen=True)
class Layout:
    """One rank's micro-batch: ``local_lens`` whole documents, then ``sharded_lens`` documents
    sharded zig-zag over ``ring`` (ordered global ranks) at position ``ring_pos``.

    ``bf16_grad_comm`` sends the ring's travelling dK/dV accumulators as bf16 (half the backward
    traffic; accumulation stays fp32).
    """

    local_lens: Tuple[int, ...] = ()
    sharded_lens: Tuple[int, ...] = ()
    ring: Tuple[int, ...] = ()
    ring_pos: int = 0
    bf16_grad_comm: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_lens", tuple(int(n) for n in self.local_lens))
        object.__setattr__(self, "sharded_lens", tuple(int(n) for n in self.sharded_lens))
        object.__setattr__(self, "ring", tuple(int(r) for r in self.ring))
        if any(n < 0 for n in self.local_lens + self.sharded_lens):
            raise ValueError(f"Layout: negative document length in local {self.local_lens} / "
                             f"sharded {self.sharded_lens}")
        if self.sharded_lens and not self.ring:
            raise ValueError(f"Layout: sharded documents {self.sharded_lens} need a ring (ordered ranks)")
        if len(set(self.ring)) != len(self.ring):
            raise ValueError(f"Layout: ring {list(self.ring)} repeats a rank")
        if self.ring and not 0 <= self.ring_pos < len(self.ring):
            raise ValueError(f"Layout: ring position {self.ring_pos} outside ring {list(self.ring)}")

    @classmethod
    def local(cls, doc_lens: Sequence[int]) -> "Layout":
        """Whole documents only (no ring)."""
        return cls(local_lens=tuple(doc_lens))

    @classmethod
    def for_rank(cls, local_lens: Sequence[int], sharded_lens: Sequence[int] = (),
                 ring: Sequence[int] = (), rank: Optional[int] = None, **kw) -> "Layout":
        """Position in ``ring`` from a global rank (default: this process's)."""
        ring = tuple(int(r) for r in ring)
        pos = 0
        if ring:
            if rank is None:
                import torch.distributed as dist

                rank = dist.get_rank()
            if rank not in ring:
                raise ValueError(f"Layout: rank {rank} is not in the ring {list(ring)}")
            pos = ring.index(rank)
        return cls(tuple(local_lens), tuple(sharded_lens), ring, pos, **kw)

    @property
    def num_local_tokens(self) -> int:
        return sum(self.local_lens)

    @property
    def num_sharded_tokens(self) -> int:
        n = len(self.ring)
        return sum(zigzag.local_tokens(s, n, self.ring_pos) for s in self.sharded_lens) if n else 0

    @property
    def num_tokens(self) -> int:
        return self.num_local_tokens + self.num_sharded_tokens

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  softmax_scale: Optional[float] = None, causal: bool = True) -> torch.Tensor:
        """Packed (T, H, D) q/k/v laid out as this layout says -> attention output (T, Hq, D)."""
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"Layout: q has {q.shape[0]} tokens but the layout holds "
                             f"{self.num_tokens} ({self.num_local_tokens} local + "
                             f"{self.num_sharded_tokens} sharded): {self!r}")
        nl = self.num_local_tokens
        parts = []
        if nl:
            parts.append(local_attention(q[:nl], k[:nl], v[:nl], self.local_lens, softmax_scale, causal))
        if self.sharded_lens:
            parts.append(ring_attention(q[nl:], k[nl:], v[nl:], self.sharded_lens, self.ring,
                                        softmax_scale, causal, self.bf16_grad_comm))
        if not parts:
            # An empty micro-batch (padding): keep q, k, v in the graph so every parameter still
            # gets a (zero) gradient, as sharded-parameter reductions expect on every rank.
            return q * 0 + (k.sum() + v.sum()) * 0
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def shard(full: torch.Tensor, doc_lens: Sequence[int], n: int, pos: int) -> torch.Tensor:
    """This ring position's tokens (dim 0) of packed full documents (for tests and examples)."""
    idx = torch.from_numpy(zigzag.shard_index(doc_lens, n, pos)).to(full.device)
    return full.index_select(0, idx)


def unshard(parts: Sequence[torch.Tensor], doc_lens: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`shard`: ``parts[pos]`` from every ring position -> packed full documents."""
    n = len(parts)
    out = parts[0].new_empty((sum(doc_lens),) + tuple(parts[0].shape[1:]))
    for pos, p in enumerate(parts):
        out.index_copy_(0, torch.from_numpy(zigzag.shard_index(doc_lens, n, pos)).to(p.device), p)
    return out


def shard_order(full: torch.Tensor, doc_lens: Sequence[int], n: int) -> torch.Tensor:
    """Packed full documents -> shard order of an ``n`` ring (every position's tokens in turn)."""
    return torch.cat([shard(full, doc_lens, n, pos) for pos in range(n)])


def unshard_order(x: torch.Tensor, doc_lens: Sequence[int], n: int) -> torch.Tensor:
    """Inverse of :func:`shard_order`."""
    sizes = [sum(zigzag.local_tokens(s, n, pos) for s in doc_lens) for pos in range(n)]
    return unshard(list(torch.split(x, sizes)), doc_lens)
