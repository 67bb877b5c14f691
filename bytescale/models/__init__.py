"""Reference models that train under bytescale (packed varlen input, bytescale attention):
a Llama (optionally a Mixtral-style MoE) and named sizes of it; HF models via :mod:`.hf`."""
from .expert_parallel import expert_parallel
from .llama import Llama, LlamaConfig
from .moe import MoE
from .presets import PRESETS, preset

__all__ = ["expert_parallel", "Llama", "LlamaConfig", "MoE", "PRESETS", "preset"]
