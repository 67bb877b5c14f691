"""Plain-PyTorch attention over packed documents (torch's SDPA per document): the independent
reference of the tests and benchmarks."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["reference_varlen_attention"]


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
