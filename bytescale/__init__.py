"""bytescale: hybrid data parallelism for long-context training on PyTorch.

``import bytescale`` registers the ``"bytescale"`` torch.distributed backend.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed  # noqa: F401  (c10d types must be registered before _C)

from . import _C  # noqa: F401
from . import microbatch
from .comm import BACKEND_NAME, DynamicGroup, clear_dynamic_groups, dynamic_group, world_backend
from .loss import token_level_loss
from .microbatch import attention
from .parallel import HybridDataParallel

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "DynamicGroup",
    "dynamic_group",
    "clear_dynamic_groups",
    "world_backend",
    "attention",
    "token_level_loss",
    "HybridDataParallel",
]
