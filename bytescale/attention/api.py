"""The current micro-batch and the attention entry point models call.

The HDP runtime enters :func:`micro_batch_context` around each micro-batch's forward (and keeps
the layout with the autograd graph for backward). Inside it, :func:`attention` runs:
  * wholly local documents: plain causal varlen attention, no communication;
  * the document(s) sharded over this rank's dynamic group: ring attention on that group.
Outside any context, :func:`attention` treats the input as ONE causal document (single-process
training and reference runs).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["attention", "micro_batch_context", "current_layout", "reference_varlen_attention", "LocalLayout"]

_state = threading.local()


def current_layout():
    """The layout of the micro-batch being run on this thread, or None."""
    return getattr(_state, "layout", None)


@contextlib.contextmanager
def micro_batch_context(layout) -> Iterator[None]:
    """Make ``layout`` the current micro-batch layout for :func:`attention` calls in the block."""
    prev = getattr(_state, "layout", None)
    _state.layout = layout
    try:
        yield
    finally:
        _state.layout = prev


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_lens: Sequence[int],
    softmax_scale: Optional[float] = None,
    causal: bool = True,
) -> torch.Tensor:
    """Plain-PyTorch attention over packed documents (T, H, D); documents never attend each other.

    GQA/MQA: k/v heads are repeated to the query heads. Used when no bytescale layout is active and
    as the independent reference in tests.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"attention expects (T, H, D) tensors, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads is not a multiple of {hkv} kv heads")
    if sum(doc_lens) != q.shape[0]:
        raise ValueError(f"attention: document lengths sum to {sum(doc_lens)} but q has {q.shape[0]} tokens")
    rep = hq // hkv
    outs = []
    start = 0
    for n in doc_lens:
        qs = q[start:start + n].transpose(0, 1)
        ks = k[start:start + n].repeat_interleave(rep, dim=1).transpose(0, 1)
        vs = v[start:start + n].repeat_interleave(rep, dim=1).transpose(0, 1)
        if n > 0:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=softmax_scale)
            outs.append(o.transpose(0, 1))
        start += n
    if not outs:  # no tokens: stay in the graph (zero gradients for every projection)
        return q * 0 + (k.sum() + v.sum()) * 0
    return torch.cat(outs, dim=0)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention for packed (T, H, D) q/k/v under the current micro-batch layout (see module doc)."""
    layout = current_layout()
    if layout is None:
        return local_attention(q, k, v, [q.shape[0]], softmax_scale, causal)
    return layout.attention(q, k, v, softmax_scale=softmax_scale, causal=causal)


def local_attention(q, k, v, doc_lens, softmax_scale=None, causal=True):
    """Attention over wholly local packed documents: on CUDA bytescale's varlen op (one fused
    flash / cuDNN call for all documents, no S x S matrix); on CPU torch's SDPA per document (its
    fused CPU kernel is faster than bytescale's tiled one, benchmarks/RESULTS.md)."""
    if q.is_cuda:
        from .ring import varlen_attention

        return varlen_attention(q, k, v, doc_lens, softmax_scale, causal)
    return reference_varlen_attention(q, k, v, doc_lens, softmax_scale, causal)


class LocalLayout:
    """Layout of a micro-batch whose documents are all local (no ring): plain varlen attention."""

    def __init__(self, doc_lens: Sequence[int]) -> None:
        self.doc_lens = [int(n) for n in doc_lens]
        if any(n < 0 for n in self.doc_lens):
            raise ValueError(f"LocalLayout: negative document length in {self.doc_lens}")

    def attention(self, q, k, v, softmax_scale=None, causal=True):
        return local_attention(q, k, v, self.doc_lens, softmax_scale, causal)

    def __repr__(self) -> str:
        return f"LocalLayout(doc_lens={self.doc_lens})"
