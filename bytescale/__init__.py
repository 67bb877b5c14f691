"""bytescale: hybrid data parallelism for long-context training on PyTorch.

``import bytescale`` registers the ``"bytescale"`` torch.distributed backend.

Subsystems: communication (:mod:`bytescale.comm`: backend, dynamic groups), attention
(:mod:`bytescale.ring`: ring and varlen attention ops; :mod:`bytescale.microbatch`: the attention
entry point models call), planning (:mod:`bytescale.planner`), runtime and data
(:mod:`bytescale.parallel`, :mod:`bytescale.loss`, :mod:`bytescale.data`, :mod:`bytescale.models`,
:mod:`bytescale.hf`).
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed  # noqa: F401  (c10d types must be registered before _C)

from . import _C  # noqa: F401
from . import microbatch, planner, ring
from .offload import offload
from .profile import profile
from .comm import BACKEND_NAME, DynamicGroup, clear_dynamic_groups, dynamic_group, world_backend
from .loss import token_level_loss
from .microbatch import attention
from .parallel import HybridDataParallel
from .planner import CostModel, Plan, plan
from .ring import RingLayout, ring_attention, varlen_attention

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
    "CostModel",
    "Plan",
    "plan",
    "RingLayout",
    "ring_attention",
    "varlen_attention",
    "offload",
    "profile",
]
