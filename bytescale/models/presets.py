"""Named sizes of the package's Llama (``python -m bytescale.train --model NAME``).

``tiny`` and ``small`` train on CPUs (tests, the demo); the ``llama3-*`` presets have the Llama 3
shapes (vocabulary set by the data unless given) and ``mixtral-tiny`` is a small mixture of
experts. Any other model: pass an HF ``config.json`` path instead.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional

from .llama import LlamaConfig

__all__ = ["PRESETS", "preset"]

PRESETS: Dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176),
    "small": LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352),
    "base": LlamaConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408),
    "mixtral-tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                n_experts=4, top_k=2),
    "llama3-1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                             ffn_dim=8192, rope_theta=500000.0),
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_dim=14336, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              ffn_dim=28672, rope_theta=500000.0),
}


def preset(name: str, vocab_size: Optional[int] = None, **overrides) -> LlamaConfig:
    """The preset ``name`` with ``vocab_size`` and any other LlamaConfig fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} "
                         "(or give the path of an HF config.json)")
    cfg = PRESETS[name]
    if vocab_size:
        overrides["vocab_size"] = int(vocab_size)
    return replace(cfg, **overrides) if overrides else cfg
