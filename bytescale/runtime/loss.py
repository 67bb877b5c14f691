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

    logits: (T, V); labels: (T,) with IGNORE_INDEX for tokens without a target.
    """
    if logits.dim() != 2 or labels.dim() != 1 or logits.shape[0] != labels.shape[0]:
        raise ValueError(
            f"token_level_loss: logits (T, V) and labels (T,) expected, got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if global_loss_tokens <= 0:
        raise ValueError(f"token_level_loss: global_loss_tokens must be positive, got {global_loss_tokens}")
    loss_sum = F.cross_entropy(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
                               labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum / global_loss_tokens
