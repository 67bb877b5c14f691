"""Attention: the zig-zag layout, the per-micro-batch :class:`Layout`, ring and varlen attention
ops (C++, csrc/attention/; CUDA kernels in csrc/cuda/attention/) and the entry point models call."""
from . import zigzag
from .api import attention, current_layout, micro_batch_context
from .layout import Layout, local_attention, shard, shard_order, unshard, unshard_order
from .ops import (ring_attention, ring_checks_enabled, set_ring_checks, varlen_attention,
                  virtual_ring_attention)
from .reference import reference_varlen_attention

__all__ = [
    "Layout", "attention", "current_layout", "micro_batch_context", "local_attention",
    "ring_attention", "ring_checks_enabled", "set_ring_checks", "varlen_attention",
    "virtual_ring_attention", "reference_varlen_attention",
    "shard", "unshard", "shard_order", "unshard_order", "zigzag",
]
