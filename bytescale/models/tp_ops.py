"""Tensor-parallel pieces the model itself runs (imported by ``llama.py`` and ``parallel.py``, so
that the model does not import the TP plan and the plan imports the model one way): the local
shard of a DTensor, K/V of a TP rank's one shared KV head from replicated weights, and the
autograd collectives of the TP plan's local compute (``parallel.py``: activations stay plain
tensors, so no op of a layer goes through DTensor's sharding propagation, whose cache is keyed on
shapes and misses on every new micro-batch length).

Rows (the packed token dimension 0) under sequence parallelism are split as DTensor's ``Shard(0)``
is: ceil(T / tp) per rank, the last ranks fewer or none (:func:`sequence_shard_rows`).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

__all__ = ["local_tensor", "shared_kv", "sequence_shard_rows", "copy_to_tp", "reduce_from_tp", "gather_rows", "scatter_rows",
           "slice_rows"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group (a replicated input whose
    use on each rank covers only that rank's heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def shared_kv(attn: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of the one KV head this TP rank's query heads use, from the replicated K/V weights
    (``attn.kv_share = (head, tp_group)``): (T, 1, head_dim) each."""
    head, group = attn.kv_share
    hd = attn.cfg.head_dim
    T = x.shape[0]
    if isinstance(x, DTensor):
        xl = x.to_local(grad_placements=[Partial()])
    elif getattr(attn, "tp_input_prepared", False):  # the local plan summed it where it entered
        xl = x
    else:  # this rank's use of the replicated input covers only its heads: sum the gradient over TP
        xl = _AllReduceGrad.apply(x, group)
    rows = slice(head * hd, (head + 1) * hd)
    out = []
    for lin in (attn.wk, attn.wv):
        w = _AllReduceGrad.apply(local_tensor(lin.weight), group)[rows]
        out.append(F.linear(xl, w).view(T, 1, hd))
    return out[0], out[1]


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the TP group (an input whose use on each
    rank covers only that rank's share: column-parallel layers, a rank's KV head)."""
    return _AllReduceGrad.apply(x, group)


class _AllReduce(torch.autograd.Function):
    """Sum over the TP group forward (row-parallel partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over the TP group (row-parallel outputs); the gradient passes unchanged."""
    return _AllReduce.apply(x, group)


# newer torch names them *_single (its *_tensor names warn as deprecated); older torch has only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _per(tokens: int, tp: int) -> int:
    return -(-tokens // tp) if tokens else 0


def _row_range(tokens: int, tp: int, index: int) -> Tuple[int, int]:
    per = _per(tokens, tp)
    lo = min(tokens, per * index)
    return lo, min(tokens, lo + per)


def sequence_shard_rows(tokens: int, tp: int, index: int) -> int:
    """Rows of ``tokens`` that TP rank ``index`` of ``tp`` holds under sequence parallelism (the
    DTensor ``Shard(0)`` split: ceil(tokens / tp) each, the last ones fewer or none)."""
    lo, hi = _row_range(tokens, tp, index)
    return hi - lo


def _all_gather_rows(x: torch.Tensor, tokens: int, group, tp: int) -> torch.Tensor:
    """Every TP rank's rows (``Shard(0)`` split of ``tokens``) concatenated: (tokens, ...)."""
    per = _per(tokens, tp)
    tail = tuple(x.shape[1:])
    if per == 0:
        return x.new_empty((0,) + tail)
    pad = x.new_zeros((per,) + tail)
    pad[: x.shape[0]] = x
    out = x.new_empty((per * tp,) + tail)
    _all_gather(out, pad, group=group)
    return out[:tokens]


def _reduce_scatter_rows(x: torch.Tensor, group, tp: int, index: int) -> torch.Tensor:
    """This TP rank's rows of the sum of ``x`` (tokens, ...) over the TP group."""
    tokens = x.shape[0]
    per = _per(tokens, tp)
    tail = tuple(x.shape[1:])
    rows = sequence_shard_rows(tokens, tp, index)
    if per == 0:
        return x.new_empty((0,) + tail)
    pad = x.new_zeros((per * tp,) + tail)
    pad[:tokens] = x
    out = x.new_empty((per,) + tail)
    _reduce_scatter(out, pad, group=group)
    return out[:rows]


def _own_rows(x: torch.Tensor, tp: int, index: int) -> torch.Tensor:
    lo, hi = _row_range(x.shape[0], tp, index)
    return x[lo:hi]


class _GatherRows(torch.autograd.Function):
    """All-gather of the rows forward. Backward: the gradient reduce-scattered (``partial``: each
    rank's gradient covers only its share of the layer) or this rank's rows of it (complete)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: int, group, tp: int, index: int, partial: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.args = (group, tp, index, partial)
        return _all_gather_rows(x.contiguous(), tokens, group, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        group, tp, index, partial = ctx.args
        g = _reduce_scatter_rows(grad.contiguous(), group, tp, index) if partial else _own_rows(grad, tp, index)
        return g.contiguous(), None, None, None, None, None


class _ScatterRows(torch.autograd.Function):
    """This rank's rows of the sum over TP forward (row-parallel outputs under sequence
    parallelism); backward all-gathers the rows' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, tp: int, index: int) -> torch.Tensor:  # type: ignore[override]
        ctx.args = (x.shape[0], group, tp)
        return _reduce_scatter_rows(x.contiguous(), group, tp, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        tokens, group, tp = ctx.args
        return _all_gather_rows(grad.contiguous(), tokens, group, tp), None, None, None


class _SliceRows(torch.autograd.Function):
    """This rank's rows of a tensor every TP rank holds whole; backward all-gathers the rows'
    gradients (the whole tensor's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, tp: int, index: int) -> torch.Tensor:  # type: ignore[override]
        ctx.args = (x.shape[0], group, tp)
        return _own_rows(x, tp, index).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        tokens, group, tp = ctx.args
        return _all_gather_rows(grad.contiguous(), tokens, group, tp), None, None, None


def gather_rows(x: torch.Tensor, tokens: int, group, tp: int, index: int, partial: bool) -> torch.Tensor:
    """The whole sequence (tokens, ...) from every TP rank's rows; see :class:`_GatherRows`."""
    return _GatherRows.apply(x, tokens, group, tp, index, partial)


def scatter_rows(x: torch.Tensor, group, tp: int, index: int) -> torch.Tensor:
    """This TP rank's rows of the sum of the partial ``x`` over TP."""
    return _ScatterRows.apply(x, group, tp, index)


def slice_rows(x: torch.Tensor, group, tp: int, index: int) -> torch.Tensor:
    """This TP rank's rows of ``x`` (the same on every TP rank)."""
    return _SliceRows.apply(x, group, tp, index)
