"""Shared pieces of the model-training tests: the tiny model configurations and their seeded,
float64 instances (the single-process reference and every rank start from the same weights).

``dist_utils.train_on_whole_documents`` is the float64 single-process reference loop that these
models are compared with.
"""
from __future__ import annotations

import torch

from bytescale.models import Llama, LlamaConfig

# The dense tiny Llama of the runtime and training tests: GQA (4 query heads, 2 K/V heads).
TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40)
# Its Mixtral-style MoE form: 4 experts, top-2 routing.
TINY_MOE = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, n_experts=4,
                       top_k=2)


def tiny_llama(cfg: LlamaConfig = TINY, dtype: torch.dtype = torch.float64, seed: int = 0) -> Llama:
    """A ``Llama(cfg)`` initialised from ``torch.manual_seed(seed)``, in ``dtype``."""
    torch.manual_seed(seed)
    return Llama(cfg).to(dtype)
