"""Ring attention over dynamic groups, and local varlen attention, as differentiable custom ops.

The C++ ops (csrc/attention/ring_attention.cpp) are ``torch.ops.bytescale.{varlen,ring}_attn_{fwd,bwd}``;
this module registers their autograd and fake (meta) kernels with ``torch.library`` so models using
them train and trace under ``torch.compile``, and provides the micro-batch layout the HDP runtime
uses.

Layout of one rank's micro-batch (the loader produces exactly this order): the wholly local
documents first (whole), then the documents sharded over the rank's dynamic group, each as its
two zig-zag chunks (chunk ``pos`` then chunk ``2N-1-pos`` of ``2N``), for any document length.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Union

import torch

from . import _C  # noqa: F401  (registers the ops)
from ._zigzag import chunk, local_tokens

if TYPE_CHECKING:
    from .comm import DynamicGroup

__all__ = ["ring_attention", "varlen_attention", "virtual_ring_attention", "RingLayout", "shard",
           "unshard"]

_ops = torch.ops.bytescale


# ---- autograd + fake kernels -----------------------------------------------------------------

@torch.library.register_fake("bytescale::varlen_attn_fwd")
def _varlen_fwd_fake(q, k, v, doc_lens, causal, scale):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=acc)


@torch.library.register_fake("bytescale::varlen_attn_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, lse, doc_lens, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("bytescale::ring_attn_fwd")
def _ring_fwd_fake(q, k, v, doc_lens, ranks, causal, scale, bf16_grad_comm=False):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=acc)


@torch.library.register_fake("bytescale::ring_attn_bwd")
def _ring_bwd_fake(dout, q, k, v, out, lse, doc_lens, ranks, causal, scale, bf16_grad_comm):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("bytescale::virtual_ring_attn_fwd")
def _vring_fwd_fake(q, k, v, doc_lens, n, causal, scale):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=acc)


@torch.library.register_fake("bytescale::virtual_ring_attn_bwd")
def _vring_bwd_fake(dout, q, k, v, out, lse, doc_lens, n, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup(ctx, inputs, output):
    q, k, v, doc_lens, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.meta = (list(doc_lens), causal, scale)


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    doc_lens, causal, scale = ctx.meta
    dq, dk, dv = _ops.varlen_attn_bwd(dout.contiguous(), q, k, v, out, lse, doc_lens, causal, scale)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("bytescale::varlen_attn_fwd", _varlen_backward, setup_context=_varlen_setup)

def _ring_setup(ctx, inputs, output):
    q, k, v, doc_lens, ranks, causal, scale, bf16_grad_comm = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.meta = (list(doc_lens), list(ranks), causal, scale, bf16_grad_comm)


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    doc_lens, ranks, causal, scale, bf16 = ctx.meta
    dq, dk, dv = _ops.ring_attn_bwd(dout.contiguous(), q, k, v, out, lse, doc_lens, ranks, causal,
                                    scale, bf16)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("bytescale::ring_attn_fwd", _ring_backward, setup_context=_ring_setup)


def _vring_setup(ctx, inputs, output):
    q, k, v, doc_lens, n, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.meta = (list(doc_lens), n, causal, scale)


def _vring_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    doc_lens, n, causal, scale = ctx.meta
    dq, dk, dv = _ops.virtual_ring_attn_bwd(dout.contiguous(), q, k, v, out, lse, doc_lens, n,
                                            causal, scale)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("bytescale::virtual_ring_attn_fwd", _vring_backward,
                                setup_context=_vring_setup)


# ---- functional API ---------------------------------------------------------------------------

def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: Sequence[int],
                     softmax_scale: Optional[float] = None, causal: bool = True) -> torch.Tensor:
    """Attention over packed, wholly local documents: q (T, Hq, D), k/v (T, Hkv, D)."""
    out, _ = _ops.varlen_attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(),
                                  [int(n) for n in doc_lens], causal, float(softmax_scale or 0.0))
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lens: Sequence[int],
                   ranks: Union[Sequence[int], "DynamicGroup"], softmax_scale: Optional[float] = None,
                   causal: bool = True, bf16_grad_comm: bool = False) -> torch.Tensor:
    """Ring attention for documents sharded zig-zag over the ring ``ranks``.

    ``ranks``: a :class:`bytescale.comm.DynamicGroup` or its ordered global ranks (ring order);
    the op checks them as the C++ group type dynamic groups use (distinct, inside the world, this
    rank a member). q/k/v hold THIS rank's tokens of the documents (for each document, its zig-zag
    chunk pair at this rank's ring position). Every member calls it with the same ``doc_lens`` and
    ring. ``bf16_grad_comm`` sends the travelling dK/dV accumulators as bf16 (half the backward
    traffic; fp32 accumulation stays local).
    """
    ranks = getattr(ranks, "ranks", ranks)  # a DynamicGroup's ordered ranks
    out, _ = _ops.ring_attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(),
                                [int(n) for n in doc_lens], [int(r) for r in ranks], causal,
                                float(softmax_scale or 0.0), bool(bf16_grad_comm))
    return out


def virtual_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           doc_lens: Sequence[int], n: int, softmax_scale: Optional[float] = None,
                           causal: bool = True) -> torch.Tensor:
    """All ``n`` positions of a ring run in sequence in this one process (differentiable).

    q/k/v are in shard order: ``torch.cat([shard(x, doc_lens, n, pos) for pos in range(n)])``;
    the output is in the same order. It runs the very block steps a real ring of ``n`` ranks runs
    (same kernels, same merge), minus the communication, so one device can test and time them.
    """
    out, _ = _ops.virtual_ring_attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(),
                                        [int(x) for x in doc_lens], int(n), causal,
                                        float(softmax_scale or 0.0))
    return out


def shard_order(full: torch.Tensor, doc_lens: Sequence[int], n: int) -> torch.Tensor:
    """Packed full documents -> shard order of an ``n`` ring (every position's tokens in turn)."""
    return torch.cat([shard(full, doc_lens, n, pos) for pos in range(n)])


def unshard_order(x: torch.Tensor, doc_lens: Sequence[int], n: int) -> torch.Tensor:
    """Inverse of :func:`shard_order`."""
    sizes = [sum(local_tokens(s, n, pos) for s in doc_lens) for pos in range(n)]
    return unshard(list(torch.split(x, sizes)), doc_lens)


# ---- layouts -----------------------------------------------------------------------------------

class RingLayout:
    """One rank's micro-batch: ``local_lens`` whole documents, then ``sharded_lens`` documents
    sharded over ``ranks`` at ring position ``ranks.index(rank)``."""

    def __init__(self, local_lens: Sequence[int], sharded_lens: Sequence[int] = (),
                 ranks: Sequence[int] = (), rank: Optional[int] = None) -> None:
        self.local_lens = [int(n) for n in local_lens]
        self.sharded_lens = [int(n) for n in sharded_lens]
        self.ranks = tuple(int(r) for r in ranks)
        if any(n < 0 for n in self.local_lens + self.sharded_lens):
            raise ValueError("RingLayout: negative document length")
        if self.sharded_lens and not self.ranks:
            raise ValueError("RingLayout: sharded documents need a ring (ranks)")
        if rank is None and self.ranks:
            import torch.distributed as dist

            rank = dist.get_rank()
        if self.ranks:
            if rank not in self.ranks:
                raise ValueError(f"RingLayout: rank {rank} is not in the ring {list(self.ranks)}")
            self.pos = self.ranks.index(rank)
        else:
            self.pos = 0

    @property
    def num_local_tokens(self) -> int:
        return sum(self.local_lens)

    @property
    def num_sharded_tokens(self) -> int:
        n = len(self.ranks)
        return sum(local_tokens(s, n, self.pos) for s in self.sharded_lens) if n else 0

    @property
    def num_tokens(self) -> int:
        return self.num_local_tokens + self.num_sharded_tokens

    @classmethod
    def from_spec(cls, spec, rank: Optional[int] = None) -> "RingLayout":
        """From a :class:`bytescale.data.loader.MicroBatchSpec`."""
        return cls([s.length for s in spec.local], [s.length for s in spec.sharded], spec.group, rank)

    def attention(self, q, k, v, softmax_scale=None, causal=True):
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"RingLayout: q has {q.shape[0]} tokens but the layout holds "
                             f"{self.num_tokens} ({self.num_local_tokens} local + "
                             f"{self.num_sharded_tokens} sharded)")
        nl = self.num_local_tokens
        parts = []
        if nl:
            parts.append(varlen_attention(q[:nl], k[:nl], v[:nl], self.local_lens, softmax_scale, causal))
        if self.sharded_lens:
            parts.append(ring_attention(q[nl:], k[nl:], v[nl:], self.sharded_lens, self.ranks,
                                        softmax_scale, causal))
        if not parts:
            # An empty micro-batch (padding): keep q, k, v in the graph so every parameter still
            # gets a (zero) gradient, as sharded-parameter reductions expect on every rank.
            return q * 0 + (k.sum() + v.sum()) * 0
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def __repr__(self) -> str:
        return (f"RingLayout(local={self.local_lens}, sharded={self.sharded_lens}, "
                f"ranks={list(self.ranks)}, pos={self.pos})")


def _shard_index(lens: Sequence[int], n: int, pos: int) -> torch.Tensor:
    idx: List[torch.Tensor] = []
    start = 0
    for s in lens:
        for c in (pos, 2 * n - 1 - pos):
            a, b = chunk(s, n, c)
            idx.append(torch.arange(start + a, start + b))
        start += s
    return torch.cat(idx) if idx else torch.empty(0, dtype=torch.long)


def shard(full: torch.Tensor, doc_lens: Sequence[int], n: int, pos: int) -> torch.Tensor:
    """This ring position's tokens (dim 0) of packed full documents (for tests and examples)."""
    return full.index_select(0, _shard_index(doc_lens, n, pos).to(full.device))


def unshard(parts: Sequence[torch.Tensor], doc_lens: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`shard`: ``parts[pos]`` from every ring position -> packed full documents."""
    n = len(parts)
    total = sum(doc_lens)
    out = parts[0].new_empty((total,) + tuple(parts[0].shape[1:]))
    for pos, p in enumerate(parts):
        out.index_copy_(0, _shard_index(doc_lens, n, pos).to(p.device), p)
    return out
