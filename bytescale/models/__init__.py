"""Reference models that train under bytescale (packed varlen input, bytescale attention)."""
from .llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
