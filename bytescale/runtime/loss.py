"""Token-level loss: gradients equal those of single-device training on the whole global batch.

Each rank sums the per-token losses of its own tokens and divides by the number of loss tokens in
the WHOLE global batch (the same number on every rank). Summing the ranks' gradients (the HDP
wrapper all-reduces with SUM) then gives exactly the gradient of the global mean loss, whatever
the assignment of sequences to ranks and however many micro-batches each rank ran
(ByteScale paper, Eq. 1 = Eq. 2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .types import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "token_level_loss", "count_loss_tokens"]


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Number of tokens that carry a loss (label != IGNORE_INDEX)."""
    return int((labels != IGNORE_INDEX).sum())


def token_level_loss(logits: torch.Tensor, labels: torch.Tensor, global_loss_tokens: int) -> torch.Tensor:
    """Sum of this micro-batch's per-token cross-entropy divided by the global batch's token count.

    logits: (T, V); labels: (T,) with IGNORE_INDEX for tokens without a target. A DTensor of
    logits sharded over the vocabulary (``Shard(-1)`` on a 1-D mesh: the tensor-parallel LM head)
    is reduced over its mesh without gathering the logits; the loss is then the same on every rank
    of the mesh.
    """
    if logits.dim() != 2 or labels.dim() != 1 or logits.shape[0] != labels.shape[0]:
        raise ValueError(
            f"token_level_loss: logits (T, V) and labels (T,) expected, got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if global_loss_tokens <= 0:
        raise ValueError(f"token_level_loss: global_loss_tokens must be positive, got {global_loss_tokens}")
    vocab_group = _vocab_sharded(logits)
    if vocab_group is not None:  # the LM head's vocabulary-parallel logits (tensor parallelism)
        local = logits.to_local()
        local = local.float() if local.dtype in (torch.float16, torch.bfloat16) else local
        group, tp, index = vocab_group
        per = -(-logits.shape[1] // tp)
        loss_sum = _VocabParallelCrossEntropy.apply(local, labels, min(logits.shape[1], per * index), group)
        return loss_sum / global_loss_tokens
    loss_sum = F.cross_entropy(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
                               labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum / global_loss_tokens


def _vocab_sharded(logits: torch.Tensor):
    """(group, size, index) of the mesh when ``logits`` is a DTensor sharded over the vocabulary
    (the last dimension) on a 1-D mesh, else None."""
    placements = getattr(logits, "placements", None)
    if placements is None or len(placements) != 1:
        return None
    from torch.distributed.tensor import Shard

    p = placements[0]
    if not (isinstance(p, Shard) and p.dim in (-1, 1)):
        return None
    mesh = logits.device_mesh
    return mesh.get_group(), mesh.size(), mesh.get_local_rank()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of logits split over the vocabulary across a group: the maximum,
    the sum of exponentials and the target's logit are all-reduced (three small (T,) tensors),
    never the logits; backward is local (softmax minus the one-hot of the rank's columns).
    Computed on plain tensors: DTensor's loss_parallel propagates shapes per op, and every
    micro-batch length is new."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, labels: torch.Tensor, offset: int, group) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        T, V = x.shape
        m = x.max(dim=-1).values if V else x.new_full((T,), float("-inf"))
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m[:, None])
        s = e.sum(dim=-1)
        valid = labels != IGNORE_INDEX
        mine = valid & (labels >= offset) & (labels < offset + V)
        col = torch.where(mine, labels - offset, torch.zeros_like(labels))
        target = torch.where(mine, x.gather(1, col[:, None]).squeeze(1) if V else x.new_zeros(T), x.new_zeros(T))
        sums = torch.stack((s, target))
        dist.all_reduce(sums, group=group)
        s, target = sums[0], sums[1]
        per_token = torch.where(valid, torch.log(s) + m - target, x.new_zeros(T))
        ctx.save_for_backward(e, s, col, mine, valid)
        return per_token.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        e, s, col, mine, valid = ctx.saved_tensors
        g = e / s[:, None]
        if g.shape[1]:
            g[torch.arange(g.shape[0], device=g.device)[mine], col[mine]] -= 1
        g = g * valid[:, None].to(g.dtype) * grad
        return g, None, None, None
