"""The attention entry point models call: ``bytescale.attention.attention(q, k, v, layout=...)``.

The layout (:class:`~bytescale.attention.Layout`, from the micro-batch plan) says which documents
are wholly local (plain causal varlen attention, no communication) and which are sharded over the
micro-batch's ring (ring attention on that dynamic group). Models that can pass it (the package's
own Llama) pass it explicitly. Models that cannot (HF transformers, whose attention interface has
no such argument) run inside :func:`micro_batch_context`, which ``HybridDataParallel.micro_batch``
enters; its thread-local layout is the fallback. With neither, the input is ONE causal document
(single-process training and reference runs).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

from .layout import Layout, local_attention

__all__ = ["attention", "micro_batch_context", "current_layout"]

_state = threading.local()


def current_layout() -> Optional[Layout]:
    """The layout of the micro-batch being run on this thread (the HF fallback), or None."""
    return getattr(_state, "layout", None)


@contextlib.contextmanager
def micro_batch_context(layout: Optional[Layout]) -> Iterator[None]:
    """Make ``layout`` the current micro-batch layout for :func:`attention` calls in the block."""
    if layout is not None and not isinstance(layout, Layout):
        raise TypeError(f"micro_batch_context: expected a bytescale.attention.Layout, got {type(layout).__name__}")
    prev = getattr(_state, "layout", None)
    _state.layout = layout
    try:
        yield
    finally:
        _state.layout = prev


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Optional[Layout] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention for packed (T, H, D) q/k/v under ``layout`` (default: the current micro-batch's)."""
    if layout is None:
        layout = current_layout()
    if layout is None:
        return local_attention(q, k, v, [q.shape[0]], softmax_scale, causal)
    if not isinstance(layout, Layout):
        raise TypeError(f"attention: layout must be a bytescale.attention.Layout, got {type(layout).__name__}")
    return layout.attention(q, k, v, softmax_scale=softmax_scale, causal=causal)
