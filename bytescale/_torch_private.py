"""Every access bytescale makes to torch.distributed's private state, in one place.

torch's public API has no hook for what a plug-in backend sometimes needs to know or do; these
functions are the only places bytescale reaches past it. Each says what it reads or writes, why,
and what it does when a torch version changes the detail (it answers conservatively instead of
raising, unless noted). Checked against torch 2.6 - 2.14.

Caller frames (the backend creator torch calls has no access to these arguments):

* :func:`creator_device_backends`: the ``backend_config`` local of torch's
  ``_new_process_group_helper`` (which devices the group maps to which backend);
* :func:`creator_local_synchronization`: the ``use_local_synchronization`` local of torch's
  ``_new_group_with_tag`` (non-members of such a group never call ``new_group``, so its
  communicator must not be split from the world's, which needs every rank).

The ``_world`` tables (torch translates global ranks through them and names groups with them):

* :func:`register_group` / :func:`unregister_group`: ``_world.pg_group_ranks`` and
  ``_world.pg_map`` for a group built outside ``new_group`` (a dynamic group);
* :func:`default_group`: ``distributed_c10d._get_default_group()``.

ProcessGroup internals used by plug-ins (torch's own extension tests use them):
:func:`register_backend` (``ProcessGroup._register_backend`` for cpu and cuda, then
``_set_default_backend``) and :func:`debug_wrapper` (``_create_process_group_wrapper``, the
ProcessGroupWrapper torch puts around its own backends under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
"""
from __future__ import annotations

import datetime
from types import FrameType
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["creator_device_backends", "creator_local_synchronization", "register_group",
           "unregister_group", "default_group", "register_backend", "debug_wrapper"]


def _frame_local(frame: Optional[FrameType], function: str, name: str, depth: int = 6):
    """The local ``name`` of the nearest caller frame running ``function`` (None if none)."""
    f = frame
    for _ in range(depth):
        if f is None:
            return None
        if f.f_code.co_name == function and name in f.f_locals:
            return f.f_locals[name]
        f = f.f_back
    return None


def creator_device_backends(frame: Optional[FrameType]) -> Dict[str, str]:
    """Device type -> backend name of the group being created ({} when unknown)."""
    try:
        cfg = _frame_local(frame, "_new_process_group_helper", "backend_config")
        return {str(k): str(v) for k, v in cfg.get_device_backend_map().items()} if cfg is not None else {}
    except Exception:  # noqa: BLE001 - another torch version: unknown
        return {}


def creator_local_synchronization(frame: Optional[FrameType]) -> bool:
    """True when the group is created with ``new_group(use_local_synchronization=True)`` (True
    also when torch's frames cannot be read: then no communicator is split from the world's)."""
    value = _frame_local(frame, "_new_group_with_tag", "use_local_synchronization", depth=8)
    return True if value is None else bool(value)


def register_group(pg: ProcessGroup, ranks: Sequence[int], backend_name: str) -> None:
    """Make torch translate global ranks for ``pg`` (``src=``, ``dst=``, P2P peers) and name its
    backend, as for a group made by ``new_group``."""
    w = dist.distributed_c10d._world
    w.pg_group_ranks[pg] = {int(g): i for i, g in enumerate(ranks)}
    w.pg_map[pg] = (backend_name, w.pg_map[default_group()][1])


def unregister_group(pg: ProcessGroup) -> None:
    w = dist.distributed_c10d._world
    w.pg_group_ranks.pop(pg, None)
    w.pg_map.pop(pg, None)


def default_group() -> ProcessGroup:
    return dist.distributed_c10d._get_default_group()


def register_backend(pg: ProcessGroup, backend, devices: Sequence[str] = ("cpu", "cuda")) -> None:
    """``backend`` serves ``pg`` on ``devices`` and is its default (a custom backend type)."""
    for dev in devices:
        pg._register_backend(torch.device(dev), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)


def debug_wrapper(backend, group_id: str, store, rank: int, size: int, timeout: datetime.timedelta):
    """torch's ProcessGroupWrapper (cross-rank desync checks) around ``backend``."""
    return dist.distributed_c10d._create_process_group_wrapper(
        wrapped_pg=backend, store_prefix=group_id, store=store, rank=rank, world_size=size,
        timeout=timeout)
