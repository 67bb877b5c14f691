"""Hugging Face transformers integration: ``attn_implementation="bytescale"``.

``import bytescale.models.hf`` (or :func:`register`) registers an attention implementation with
transformers' ``AttentionInterface``. A model using that interface (``LlamaForCausalLM``, Qwen,
Mistral, ...) then trains under bytescale with only ``attn_implementation`` changed::

    model = LlamaForCausalLM(config, attn_implementation="bytescale")   # or from_pretrained(...)
    logits = model(input_ids=ids[None], position_ids=pos[None]).logits  # one packed micro-batch

Input is one packed micro-batch (batch size 1) with ``position_ids`` restarting at 0 for each
document (so RoPE is right for sharded chunks); the current micro-batch layout (set by
``HybridDataParallel.micro_batch``) tells which documents are local and which is sharded over a
dynamic group. The attention mask transformers builds is ignored: document boundaries come from
the layout (outside any layout the input is one causal document).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .llama import autocast_safe_attention

NAME = "bytescale"

__all__ = ["NAME", "register", "bytescale_attention_forward"]


def bytescale_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers attention function: q/k/v (1, H, T, D) -> output (1, T, H, D)."""
    if query.shape[0] != 1:
        raise ValueError(
            "bytescale attention expects one packed micro-batch (batch size 1), got batch size "
            f"{query.shape[0]}; pack documents along the sequence and pass position_ids"
        )
    if dropout:
        raise ValueError("bytescale attention does not support attention dropout")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"bytescale attention supports causal (decoder) attention; {type(module).__name__} is not causal")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = autocast_safe_attention(q, k, v, softmax_scale=scaling, causal=True)
    return out.unsqueeze(0), None


def register() -> None:
    """Register ``attn_implementation="bytescale"`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, bytescale_attention_forward)
    try:  # mask creation: bytescale needs none (boundaries come from the layout)
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register(NAME, sdpa_mask)
    except Exception:  # pragma: no cover - older transformers without the mask interface
        pass


register()
