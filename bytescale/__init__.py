"""bytescale: hybrid data parallelism for long-context training on PyTorch.

``import bytescale`` registers the ``"bytescale"`` torch.distributed backend.

Subsystems (Python mirrors csrc/): :mod:`bytescale.comm` (backend, static and dynamic groups, the ``pp x hdp x tp`` mesh),
:mod:`bytescale.attention` (zig-zag layout, ring and varlen attention, the entry point models
call), :mod:`bytescale.planner` (the C++ HDP planner, micro-batch plans, the device profiler),
:mod:`bytescale.runtime` (HybridDataParallel, token-level loss, offloading),
:mod:`bytescale.data` (datasets, the data service, the loader), :mod:`bytescale.models`
(a Llama, the HF transformers integration); options in :mod:`bytescale.config`.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed  # noqa: F401  (c10d types must be registered before _C)

from . import _C  # noqa: F401
from . import attention, comm, config, planner, runtime, testing  # noqa: F401
from .attention import Layout, ring_attention, varlen_attention
from .comm import BACKEND_NAME, DynamicGroup, clear_dynamic_groups, dynamic_group, world_backend
from .comm.mesh import Mesh, current_mesh, init_mesh, mesh_from_device_mesh
from .config import LoaderConfig, PlannerConfig, RuntimeConfig
from .planner import CostModel, MicroBatchPlan, Plan, UnitMap, plan, profile
from .runtime import HybridDataParallel, StepExecutor, offload, token_level_loss

__version__ = "0.2.0"

testing.install_from_env()  # BYTESCALE_NCCL_ORDER=1: backward on a separate thread, as on CUDA

__all__ = [
    "BACKEND_NAME", "DynamicGroup", "dynamic_group", "clear_dynamic_groups", "world_backend",
    "Mesh", "init_mesh", "mesh_from_device_mesh", "current_mesh",
    "Layout", "ring_attention", "varlen_attention",
    "PlannerConfig", "LoaderConfig", "RuntimeConfig",
    "CostModel", "MicroBatchPlan", "Plan", "UnitMap", "plan", "profile",
    "HybridDataParallel", "StepExecutor", "token_level_loss", "offload",
]
