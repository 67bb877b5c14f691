"""Ring attention over dynamic groups, and local varlen attention, as differentiable custom ops.

The C++ ops (csrc/attention/ring_attention.cpp) are ``torch.ops.bytescale.{varlen,ring}_attn_{fwd,bwd}``;
this module registers their autograd and fake (meta) kernels with ``torch.library`` so models using
them train and trace under ``torch.compile``. Which tokens a rank holds is described by
:class:`bytescale.attention.Layout`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from .. import _C  # registers the ops

if TYPE_CHECKING:
    from ..comm import DynamicGroup

__all__ = ["ring_attention", "varlen_attention", "virtual_ring_attention", "set_ring_checks",
           "ring_checks_enabled"]

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


# ---- the ring agreement check -----------------------------------------------------------------

def set_ring_checks(enabled: bool) -> None:
    """Turn ring attention's agreement check on or off for this process (default on).

    With it on, before any K/V moves the members of a ring exchange a fixed-size digest of the
    call (documents, ring order, dtype, query / kv heads, head dim, causal, softmax scale,
    ``bf16_grad_comm``) and every member raises the same error, naming both views, when they
    differ. ``BYTESCALE_CHECK_RING=0`` sets the default to off. Every rank must use the same
    setting: the check is itself an exchange.
    """
    _C.attention.set_ring_checks(bool(enabled))


def ring_checks_enabled() -> bool:
    """Whether ring attention's agreement check is on in this process."""
    return bool(_C.attention.ring_checks_enabled())


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
    ring (checked before any K/V moves unless :func:`set_ring_checks` turned it off: a mismatch
    raises on every member naming both views). ``bf16_grad_comm`` sends the travelling dK/dV accumulators as bf16 (half the backward
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
