"""Tensor-parallel pieces the model itself runs (imported by ``llama.py`` and ``parallel.py``, so
that the model does not import the TP plan and the plan imports the model one way): the local
shard of a DTensor, and K/V of a TP rank's one shared KV head from replicated weights.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

__all__ = ["local_tensor", "shared_kv"]


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
    # this rank's use of the replicated input covers only its heads: sum the gradient over TP
    xl = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else _AllReduceGrad.apply(x, group)
    rows = slice(head * hd, (head + 1) * hd)
    out = []
    for lin in (attn.wk, attn.wv):
        w = _AllReduceGrad.apply(local_tensor(lin.weight), group)[rows]
        out.append(F.linear(xl, w).view(T, 1, hd))
    return out[0], out[1]
