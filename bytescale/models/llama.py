"""A small Llama-style decoder for packed variable-length input.

Input is one packed micro-batch: ``input_ids`` (T,) and ``position_ids`` (T,) (each token's position
inside its own document, so RoPE is right for sharded zig-zag chunks too) and the micro-batch's
attention ``layout`` (:class:`bytescale.attention.Layout`; local documents: varlen attention; the
sharded ones: ring attention on their dynamic group), passed explicitly to
:func:`bytescale.attention.attention`. Without a layout the input is one causal document.

Structure (per layer): RMSNorm -> GQA attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP ->
residual. Sizes are set by :class:`LlamaConfig`; ``n_experts > 0`` replaces the MLP by a
Mixtral-style mixture of experts (:mod:`bytescale.models.moe`) whose router balance loss is exact
under HDP (``forward(..., return_aux=True)``). ``activation_checkpointing = True`` recomputes each
block in backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..attention.api import attention
from ..attention.layout import Layout
from .moe import MoE
from .tp_ops import sequence_shard_rows, shared_kv  # noqa: F401  (sequence_shard_rows: the stage I/O's)


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 344
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0            # > 0: Mixtral-style MoE MLP in every block
    top_k: int = 2                # experts per token
    moe_ffn_dim: Optional[int] = None  # each expert's hidden size (default: ffn_dim)
    router_aux_coef: float = 0.01  # alpha of the sequence-wise balance loss

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim {self.dim} not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.top_k <= self.n_experts):
            raise ValueError(f"LlamaConfig: top_k {self.top_k} must be in [1, n_experts={self.n_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension (computed in float32 for half inputs), times ``weight``."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return out.to(x.dtype) * weight


def rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x (T, H, D) at integer positions (T,)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    ang = position_ids.to(torch.float64)[:, None] * inv[None, :]  # (T, D/2)
    cos = ang.cos().to(x.dtype)[:, None, :]
    sin = ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


# attn_fn(q, k, v, softmax_scale, layout) -> (T, Hq, D)
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, Optional[Layout]], torch.Tensor]


class Attention(nn.Module):
    """GQA attention. ``n_heads`` / ``n_kv_heads`` are the heads this module computes: all of them,
    or a tensor-parallel rank's share (set by :func:`bytescale.models.parallel.tensor_parallel`,
    which also sets ``kv_share`` when the TP degree exceeds the KV heads: every rank then computes
    the one KV head its query heads use from the replicated K/V weights)."""

    def __init__(self, cfg: LlamaConfig, attn_fn: AttentionFn) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn_fn = attn_fn
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.kv_share: Optional[Tuple[int, object]] = None  # (KV head, TP process group)
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layout: Optional[Layout] = None) -> torch.Tensor:
        T = x.shape[0]
        hd = self.cfg.head_dim
        q = self.wq(x).view(T, self.n_heads, hd)
        if self.kv_share is None:
            k = self.wk(x).view(T, self.n_kv_heads, hd)
            v = self.wv(x).view(T, self.n_kv_heads, hd)
        else:
            k, v = shared_kv(self, x)
        q = rope(q, position_ids, self.cfg.rope_theta)
        k = rope(k, position_ids, self.cfg.rope_theta)
        o = self.attn_fn(q, k, v, 1.0 / math.sqrt(hd), layout)
        return self.wo(o.reshape(T, self.n_heads * hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, attn_fn: Optional[AttentionFn] = None) -> None:
        super().__init__()
        attn_fn = attn_fn or default_attention
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, attn_fn)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layout: Optional[Layout] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), position_ids, layout)
        return x + self.mlp(self.mlp_norm(x))


class MoEBlock(nn.Module):
    """A block whose MLP is a mixture of experts: ``forward(...) -> (x, balance loss without alpha)``."""

    def __init__(self, cfg: LlamaConfig, attn_fn: Optional[AttentionFn] = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, attn_fn or default_attention)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg.dim, cfg.moe_ffn_dim or cfg.ffn_dim, cfg.n_experts, cfg.top_k)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layout: Optional[Layout] = None,
                global_tokens: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), position_ids, layout)
        y, aux = self.moe(self.mlp_norm(x), layout, global_tokens)
        return x + y, aux


def default_attention(q, k, v, scale, layout=None):
    """bytescale's attention under ``layout`` (or the current micro-batch's)."""
    return autocast_safe_attention(q, k, v, layout=layout, softmax_scale=scale)


def autocast_safe_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """:func:`bytescale.attention.attention` with autocast off and k/v in q's dtype.

    Under ``torch.autocast`` the attention ops' internal matmuls would be re-cast op by op and mix
    bf16 inputs with their fp32 accumulators; the ops choose their own precision (fp32
    accumulation for bf16 inputs), so they run outside autocast on the dtype they are given.
    """
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        with torch.autocast(dev, enabled=False):
            return attention(q, k.to(q.dtype), v.to(q.dtype), **kw)
    return attention(q, k, v, **kw)


def stage_input(embed: Optional[nn.Module], input_ids: Optional[torch.Tensor], hidden: Optional[torch.Tensor],
                width: int, who: str) -> torch.Tensor:
    """A pipeline stage's input (the stage model protocol, bytescale/runtime/stage_io.py): the
    first stage (it has the embedding) embeds packed 1-D ``input_ids``; a later one takes the
    previous stage's ``hidden`` states ``(T, width)``. ValueError naming ``who`` otherwise."""
    if embed is not None:
        if input_ids is None or input_ids.dim() != 1:
            raise ValueError(f"{who} takes packed 1-D input_ids (T,), got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        return embed(input_ids)
    if hidden is None or hidden.dim() != 2 or hidden.shape[1] != width:
        raise ValueError(f"{who} takes hidden= (T, {width}), the previous stage's output; got "
                         f"{None if hidden is None else tuple(hidden.shape)}")
    return hidden


def _sequence_shard(x: torch.Tensor, tp_mesh, position_ids: Optional[torch.Tensor], local: bool) -> torch.Tensor:
    """A received stage input (this TP rank's rows of the sequence), checked, as the layers take
    it: the rows themselves (``local``: the local TP plan) or the ``Shard(0)`` DTensor torch's
    sequence-parallel styles take; the micro-batch's token count comes from ``position_ids``."""
    from torch.distributed.tensor import DTensor, Shard

    if position_ids is None:
        raise ValueError("Llama: a sequence-parallel stage needs position_ids (the micro-batch's token count)")
    tokens = int(position_ids.shape[0])
    want = sequence_shard_rows(tokens, tp_mesh.size(), tp_mesh.get_local_rank())
    if x.shape[0] != want:
        raise ValueError(f"Llama: this TP rank holds {want} of the {tokens} tokens under sequence parallelism, "
                         f"got hidden of {x.shape[0]} rows")
    if local:
        return x
    return DTensor.from_local(x, tp_mesh, [Shard(0)], run_check=False, shape=(tokens, x.shape[1]),
                              stride=(x.shape[1], 1))


class Llama(nn.Module):
    """Llama-style decoder over a packed micro-batch: ``forward(input_ids, position_ids, layout) -> logits``.

    With ``return_aux=True`` it returns ``(logits, aux)``: ``aux`` is the MoE router balance loss
    times ``router_aux_coef`` (a zero for a dense model), normalised by ``global_tokens`` (the
    global batch's token count; default: this input's), so that adding it to
    :func:`bytescale.token_level_loss` keeps HDP equal to single-process training.

    The step executor's stage protocol: ``takes_layout`` (forward takes ``layout=`` explicitly),
    ``stage`` / ``stages`` and ``hidden_size`` (the width of the hidden states between stages).
    """

    takes_layout = True  # the stage model protocol (bytescale/runtime/stage_io.py)

    def __init__(self, cfg: LlamaConfig, attn_fn: Optional[AttentionFn] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False
        fn = attn_fn or default_attention
        block = MoEBlock if cfg.is_moe else Block
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        # keyed by the layer's index in the whole model, so that a pipeline stage keeps the names
        # (checkpoints) of its layers: "layers.5.attn.wq.weight" on every pipeline depth
        self.layers = nn.ModuleDict({str(i): block(cfg, fn) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.stage, self.stages = 0, 1
        self.hidden_size = cfg.dim
        self.reset_parameters()

    def pipeline_stage(self, stage: int, stages: int) -> "Llama":
        """Keep only pipeline stage ``stage`` of ``stages`` equal stages, in place, and return the
        model: its layers (by their index in the whole model, so that parameter names and
        checkpoints do not depend on the depth), the embedding on the first stage, the final norm
        and LM head on the last. Call it on the whole model initialised as a single process would
        (the same seed on every rank) and before tensor parallelism. A middle or last stage takes
        ``hidden=`` (the previous stage's output) in :meth:`forward`; a stage before the last
        returns hidden states ``(T, dim)`` instead of logits.

        Raises:
            ValueError: the stages do not divide the layers, or ``stage`` is outside [0, stages).
            RuntimeError: the model is already one stage of a pipeline.
        """
        from ..planner import stage_layers

        if self.stages != 1:
            raise RuntimeError(f"Llama.pipeline_stage: the model is already stage {self.stage} of {self.stages}")
        try:
            per = stage_layers(self.cfg.n_layers, stages)
        except ValueError as e:
            raise ValueError(f"Llama.pipeline_stage: {e}") from None
        if not 0 <= stage < stages:
            raise ValueError(f"Llama.pipeline_stage: stage {stage} outside [0, {stages})")
        keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
        for name in list(self.layers.keys()):
            if name not in keep:
                del self.layers[name]
        if stage > 0:
            self.embed = None
        if stage < stages - 1:
            self.norm = None
            self.lm_head = None
        self.stage, self.stages = int(stage), int(stages)
        return self

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                layout: Optional[Layout] = None, *, global_tokens: Optional[int] = None,
                return_aux: bool = False, hidden: Optional[torch.Tensor] = None):
        x = stage_input(self.embed, input_ids, hidden, self.cfg.dim, f"Llama stage {self.stage} of {self.stages}")
        if self.embed is None:
            if getattr(self, "sequence_parallel", False) and not hasattr(x, "placements"):
                x = _sequence_shard(x, self.tp_mesh, position_ids, getattr(self, "tp_compute", "") == "local")
        if position_ids is None:  # (a sequence-parallel first stage holds only its rows of the embedding)
            n = input_ids.shape[0] if self.embed is not None else x.shape[0]
            position_ids = torch.arange(n, device=x.device)
        aux = None
        for layer in self.layers.values():
            args = (x, position_ids, layout) + ((global_tokens,) if self.cfg.is_moe else ())
            if self.activation_checkpointing and torch.is_grad_enabled():
                out = checkpoint(layer, *args, use_reentrant=False)
            else:
                out = layer(*args)
            if self.cfg.is_moe:
                x, a = out
                aux = a if aux is None else aux + a
            else:
                x = out
        logits = x if self.lm_head is None else self.lm_head(self.norm(x))
        if not return_aux:
            return logits
        if aux is None:
            return logits, torch.zeros((), dtype=torch.float32, device=x.device)
        return logits, aux * self.cfg.router_aux_coef
