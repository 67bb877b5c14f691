"""The step's types: what the loader hands the step executor each step.

A :class:`Step` is one global batch as this rank sees it: its micro-batches (tensors, the plan
they were laid out by, the attention layout) in the plan's order, the global batch itself and the
step's plan.
"""
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
    token-level loss's denominator, the same on every rank). ``batch``: the global batch as the
    data source gave it (:class:`bytescale.data.GlobalBatch`: sample ids, lengths, sources; the same
    on every rank); ``plan``: the step's plan (over HDP units, with its unit map).
    """

    index: int
    sample_ids: Tuple[int, ...]
    global_tokens: int
    global_loss_tokens: int
    micro_batches: Tuple[MicroBatch, ...]
    plan: Any = None
    info: Dict[str, Any] = field(default_factory=dict)
    batch: Any = None

    @property
    def lengths(self) -> Tuple[int, ...]:
        """The global batch's document lengths, in batch order."""
        return tuple(int(n) for n in self.batch.lengths) if self.batch is not None else ()
