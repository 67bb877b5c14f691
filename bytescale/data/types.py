"""Types of the data path: what the loader hands the training loop each step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

import torch

from ..attention.layout import Layout
from ..planner.types import MicroBatchPlan

__all__ = ["IGNORE_INDEX", "MicroBatch", "Step"]

IGNORE_INDEX = -100
"""Label of a token without a target (a document's last token; padding)."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's tensors on this rank, with the plan they were laid out by.

    ``input_ids``, ``labels``, ``position_ids``: (T,) int64, tokens in the plan's token order
    (local documents whole, then each sharded document's zig-zag chunks); positions restart at 0
    for every document (RoPE-correct for chunks); labels are the next token of the same document.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    plan: MicroBatchPlan
    layout: Layout

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def offload_ratio(self) -> float:
        return self.plan.offload_ratio


@dataclass
class Step:
    """One training step on this rank: its micro-batches in execution order.

    ``global_loss_tokens`` is the number of tokens with a label in the WHOLE global batch (the
    token-level loss's denominator, the same on every rank).
    """

    index: int
    sample_ids: Tuple[int, ...]
    global_tokens: int
    global_loss_tokens: int
    micro_batches: Tuple[MicroBatch, ...]
    plan: Any = None
    info: Dict[str, Any] = field(default_factory=dict)
