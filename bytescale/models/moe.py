"""Mixtral-style mixture of experts for the package's Llama, exact under HDP.

Each token picks its ``top_k`` experts from a softmax router (the chosen weights renormalised to
sum to 1, as Mixtral does); every expert is a SwiGLU MLP replicated on every HDP rank. Routing is
per token, so HDP's re-sharding of sequences over ranks changes nothing in it.

The router's auxiliary balance loss is SEQUENCE-wise (as in DeepSeek-V3) and normalised like the
token-level loss, so that the sum over ranks and micro-batches equals single-process training on
the same global batch exactly::

    L_aux = alpha * sum_docs (doc_len / G) * E * sum_e f_e * P_e
    f_e   = (tokens of the document routed to e) / (top_k * doc_len)      (no gradient)
    P_e   = (sum over the document's tokens of the router probability of e) / doc_len

with G the global batch's token count. P_e is a plain sum over tokens, so each rank adds its own
tokens' share; f_e needs the whole document's counts: for a document sharded over a ring the
counts are all-reduced over the micro-batch's ring (a dynamic group), the rest is local.

Expert parallelism (:func:`bytescale.models.expert_parallel.expert_parallel`) keeps each rank's
share of the experts and runs them dropless: the router's per-expert token counts are exchanged
by an all-to-all over the expert-parallel group, the tokens (one row per chosen expert) by an uneven
all-to-all, the local experts run on what they received, and a reverse all-to-all brings the
outputs home, where they are weighted and summed exactly as without EP. Routing and the balance
loss stay on the token's home rank.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import zigzag
from ..attention.layout import Layout

__all__ = ["MoE", "balance_loss", "segments"]


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` of rows; backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def segments(layout: Optional[Layout], num_tokens: int) -> Tuple[List[int], List[int], int]:
    """(tokens held here per document, full length per document, number of local documents).

    Documents in the layout's token order: the local ones whole, then each sharded document's two
    zig-zag chunks (contiguous). Without a layout the input is one document.
    """
    if layout is None:
        return [num_tokens], [num_tokens], 1
    held = list(layout.local_lens)
    full = list(layout.local_lens)
    n = len(layout.ring)
    for s in layout.sharded_lens:
        held.append(zigzag.local_tokens(s, n, layout.ring_pos))
        full.append(s)
    return held, full, len(layout.local_lens)


def balance_loss(probs: torch.Tensor, topk_idx: torch.Tensor, layout: Optional[Layout],
                 global_tokens: Optional[int], top_k: int) -> torch.Tensor:
    """The sequence-wise balance loss (module docstring) WITHOUT the coefficient alpha.

    probs: (T, E) router probabilities; topk_idx: (T, k) chosen experts.
    """
    T, E = probs.shape
    held, full, n_local = segments(layout, T)
    if T == 0 or not held:
        return probs.sum() * 0.0  # keeps the router in the graph (padding micro-batches)
    seg = torch.repeat_interleave(torch.arange(len(held), device=probs.device),
                                  torch.tensor(held, device=probs.device))
    counts = torch.zeros(len(held), E, dtype=torch.float64, device=probs.device)
    hits = F.one_hot(topk_idx, E).sum(1).to(torch.float64)  # (T, E)
    counts.index_add_(0, seg, hits)
    if layout is not None and len(held) > n_local and len(layout.ring) > 1:
        import torch.distributed as dist

        from ..comm import dynamic_group

        sharded = counts[n_local:].contiguous()
        dist.all_reduce(sharded, group=dynamic_group(layout.ring))
        counts = torch.cat([counts[:n_local], sharded])
    lens = torch.tensor(full, dtype=torch.float64, device=probs.device).clamp_min(1.0)
    f = (counts / (top_k * lens[:, None])).to(probs.dtype)
    p_sum = torch.zeros(len(held), E, dtype=probs.dtype, device=probs.device).index_add(0, seg, probs)
    g = float(global_tokens if global_tokens else T)
    # sum_docs (len/G) * E * sum_e f_e * (p_sum_e / len) = (E / G) * sum_docs sum_e f_e * p_sum_e
    return (f * p_sum).sum() * (E / g)


class Expert(nn.Module):
    """One SwiGLU expert."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed experts: ``forward(x, layout, global_tokens) -> (y, aux)`` (aux without alpha)."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.top_k = top_k
        self.n_experts = n_experts
        self.router = nn.Linear(dim, n_experts, bias=False)
        # nn.ModuleList of every expert; under expert parallelism an nn.ModuleDict of this rank's
        # (keyed by global expert index, so parameter names stay those of the full model)
        self.experts: nn.Module = nn.ModuleList(Expert(dim, ffn_dim) for _ in range(n_experts))
        self.ep_group = None   # the expert-parallel process group (set by expert_parallel)
        self.edp_group = None  # the group the kept experts' gradients are summed over
        self.ep_size = 1

    def local_experts(self) -> List[Tuple[int, nn.Module]]:
        """(global expert index, expert) of the experts this rank holds, in index order."""
        return [(int(name), e) for name, e in self.experts.named_children()]

    def forward(self, x: torch.Tensor, layout: Optional[Layout] = None,
                global_tokens: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(x)
        probs = torch.softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
        return self.run_experts(x, top_w, top_i), balance_loss(probs, top_i, layout, global_tokens, self.top_k)

    def run_experts(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """``sum_k top_w[t, k] * expert_{top_i[t, k]}(x[t])`` for every token ``t``: the experts held
        here, or under expert parallelism the dropless dispatch / combine over the EP group."""
        if self.ep_group is not None:
            return self._dispatch_combine(x, top_w, top_i)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(top_i == e, as_tuple=True)
            # every expert runs, on zero tokens if none chose it: every parameter gets a (zero)
            # gradient on every rank, as FSDP2's reduce-scatter expects
            y = expert(x.index_select(0, tok)) * top_w[tok, slot].unsqueeze(-1)
            out = out.index_add(0, tok, y.to(out.dtype))
        return out

    def _dispatch_combine(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """The experts under expert parallelism (module docstring): every rank of the EP group
        calls this the same number of times in the same order (zero tokens included)."""
        import torch.distributed as dist

        k, n_exp, ep = self.top_k, self.n_experts, self.ep_size
        per = n_exp // ep
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)       # assignments grouped by expert, so by rank
        tok = torch.div(order, k, rounding_mode="floor")
        counts = torch.bincount(flat_e, minlength=n_exp).to(torch.int64)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.ep_group)  # [src][local expert] counts
        send_splits = counts.view(ep, per).sum(1).tolist()
        rc = recv.view(ep, per)
        recv_splits = rc.sum(1).tolist()
        xr = _AllToAll.apply(x.index_select(0, tok), recv_splits, send_splits, self.ep_group)
        # the received rows, source by source, each source's by local expert: regroup by expert
        start = (torch.cumsum(rc.reshape(-1), 0) - rc.reshape(-1)).view(ep, per).tolist()
        rcl = rc.tolist()
        ys, idx = [], []
        for j, (_, expert) in enumerate(self.local_experts()):
            rows = [torch.arange(start[s][j], start[s][j] + rcl[s][j]) for s in range(ep)]
            r = torch.cat(rows).to(x.device)
            idx.append(r)
            # every local expert runs, on zero rows if none came: every parameter gets a gradient
            ys.append(expert(xr.index_select(0, r)))
        perm = torch.cat(idx)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        y = torch.cat(ys).index_select(0, inv) if perm.numel() else torch.cat(ys)
        yb = _AllToAll.apply(y, send_splits, recv_splits, self.ep_group)
        w = top_w.reshape(-1).index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tok, (yb * w).to(x.dtype))
