"""The attention entry point models call: ``bytescale.attention.attention(q, k, v, layout=...)``.

The layout (:class:`~bytescale.attention.Layout`, from the micro-batch plan) says which documents
are wholly local (plain causal varlen attention, no communication) and which are sharded over the
micro-batch's ring (ring attention on that dynamic group). Models that can pass it (the package's
own Llama) pass it explicitly. Models that cannot (HF transformers, whose attention interface has
no such argument) run inside :func:`micro_batch_context`, which ``HybridDataParallel.micro_batch``
enters; its layout is the fallback. With neither, the input is ONE causal document
(single-process training and reference runs).

The fallback is seen by the thread that entered the block AND by threads that run on its behalf
while it waits: on CUDA, autograd runs backward (grad hooks, activation-checkpoint recomputation)
on a device thread of its own, and the recomputed attention must see the micro-batch's layout
there too, or a packed micro-batch would be attended as one document (silently wrong gradients).
A thread without a block of its own sees the one block open in the process; if blocks are open
on several threads it raises instead of guessing.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, List, Optional

import torch

from .. import _C
from .layout import Layout, local_attention

__all__ = ["attention", "micro_batch_context", "current_layout"]

_lock = threading.Lock()
_open: Dict[int, List[Optional[Layout]]] = {}  # thread id -> its stack of open blocks' layouts


def current_layout() -> Optional[Layout]:
    """The layout of the micro-batch being run (the HF fallback), or None.

    This thread's innermost :func:`micro_batch_context` if it entered one; otherwise the block open
    on the one thread that has one (autograd's device thread running a backward or a checkpoint
    recompute for it). Raises if blocks are open on several other threads.
    """
    me = threading.get_ident()
    with _lock:
        mine = _open.get(me)
        if mine:
            return mine[-1]
        others = [stack[-1] for stack in _open.values() if stack]
    if not others:
        return None
    if len(others) > 1:
        raise RuntimeError(
            f"bytescale.attention: no micro-batch layout on this thread and micro_batch_context blocks "
            f"are open on {len(others)} other threads: which layout applies is ambiguous; pass layout= "
            "explicitly or run one micro-batch at a time per process")
    return others[0]


@contextlib.contextmanager
def micro_batch_context(layout: Optional[Layout]) -> Iterator[None]:
    """Make ``layout`` the current micro-batch layout for :func:`attention` calls in the block
    (forward AND backward belong inside it: the backward's recomputation reads it too, from
    whatever thread autograd runs it on).

    The block is also the scope of ring attention's agreement check: a ring call is checked the
    first time its members make it, not again in later layers or in the recompute (the check is
    a blocking host round trip on CUDA).
    """
    if layout is not None and not isinstance(layout, Layout):
        raise TypeError(f"micro_batch_context: expected a bytescale.attention.Layout, got {type(layout).__name__}")
    me = threading.get_ident()
    with _lock:
        _open.setdefault(me, []).append(layout)
    scope = _C.attention.enter_agreement_scope()
    try:
        yield
    finally:
        _C.attention.exit_agreement_scope(scope)
        with _lock:
            stack = _open[me]
            stack.pop()
            if not stack:
                del _open[me]


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
