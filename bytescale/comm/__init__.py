"""The ``bytescale`` torch.distributed backend and zero-cost dynamic groups.

``import bytescale`` registers the backend, so ``dist.init_process_group("bytescale")`` works under
torchrun (``env://``), with an explicit ``store=``, and with ``device_id=``. One C++ backend serves
CPU tensors (Gloo for the collectives it does natively, bytescale's P2P algorithms for the rest)
and CUDA tensors (bytescale's NCCL backend with ONE communicator for the world).

:func:`dynamic_group` builds a group from any ordered list of global ranks, locally, in
microseconds, with no communication and no new communicator: its collectives run as P2P
algorithms (ring all-gather / reduce-scatter, pipelined broadcast, pairwise all-to-all) on the
world backend's transports.

Static and dynamic groups
-------------------------
A subgroup made collectively (``dist.new_group``, ``dist.split_group``, a ``DeviceMesh``,
:func:`bytescale.init_mesh`) is a STATIC group by default: it gets communicators of its own, a Gloo
context of its members on CPU and, on CUDA, an NCCL communicator split from the world's (when the
world is bound to a device: ``init_process_group(..., device_id=...)``; otherwise created on the
group's first CUDA collective), so its collectives are native ones and never share a channel with
the world's point-to-point traffic. Tensor-, pipeline- and expert-parallel groups are static. A
group built per micro-batch (a ring) is DYNAMIC: :func:`dynamic_group`, or
``dist.new_group(ranks, pg_options=bytescale.comm.GroupOptions(kind="dynamic"))``; it allocates
nothing and runs on the world's transports (the contract below).

Ordering contract for dynamic groups
------------------------------------
* Every member of a group calls the group's collectives in the same order.
* Messages between two ranks are matched in issue order, so any two ranks that share several
  groups must use them in the same relative order (the planner guarantees this for ring
  micro-batches). Disjoint groups never interfere; groups sharing no pair of ranks may run in any
  order.
* Collectives of a group run on the transport's worker (CPU) or communication stream (CUDA) in the
  order they were issued by this process; point-to-point calls (``send``/``recv``/``ring_exchange``)
  are posted immediately. Do not overlap an un-waited collective of one group with P2P calls to the
  same peers from another thread.
* A non-member may hold a group object, but every operation on it raises an error naming the group.

Works
-----
* ``work.wait(timeout)`` raises ``DistBackendError`` after ``timeout`` (without one: after the
  group's timeout, ``init_process_group(timeout=...)`` or ``new_group(timeout=...)``), naming the
  op, the group and the ranks it still waits for. The op is not cancelled: it keeps its tensors and
  may still complete (on CUDA the watchdog aborts the communicator after the group's timeout).
* ``work.is_completed()`` turns true by itself once the op is done, point-to-point ops included.
* Sends/receives issued inside a coalescing block (``batch_isend_irecv``) return Works that complete
  with the block's Work; waiting on one before the block ends raises.
"""
from __future__ import annotations

import datetime
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C
from .. import _torch_private as _tp

__all__ = [
    "BACKEND_NAME",
    "GroupOptions",
    "agree",
    "DynamicGroup",
    "dynamic_group",
    "world_backend",
    "clear_dynamic_groups",
]

BACKEND_NAME = "bytescale"

_world_backend: Optional[_C.comm.BytescaleBackend] = None
_lock = threading.Lock()


def _as_timedelta(t) -> datetime.timedelta:
    if isinstance(t, datetime.timedelta):
        return t
    return datetime.timedelta(seconds=float(t))


GROUP_KINDS = ("static", "dynamic")


@dataclass(frozen=True)
class GroupOptions:
    """``pg_options`` of ``dist.new_group(..., backend="bytescale")`` (or of a DeviceMesh's
    ``backend_override``): which kind of subgroup to make.

    kind: ``"static"`` (the default, also without options): communicators of its own, native
        collectives (Gloo on CPU, NCCL split from the world's on CUDA); for groups that live long
        (tensor, pipeline, expert parallelism, FSDP over a mesh dimension). ``"dynamic"``: no
        communicator, P2P algorithms on the world's transports (:func:`dynamic_group`).
    """

    kind: str = "static"
    _timeout: Optional[datetime.timedelta] = None  # read by DeviceMesh's backend_override

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"bytescale.comm.GroupOptions: kind {self.kind!r} is not one of {GROUP_KINDS}")


class _NamedProcessGroup(_C.comm.NamedProcessGroup):
    """A process group whose every device runs one bytescale backend, named "bytescale".

    c10d's plain ProcessGroup names any plug-in backend "custom" (``ProcessGroup::getBackendName``),
    and that name is what DDP's logging data (``backend_name``) and ``pg.name()`` report. The base
    class is C++ (``csrc/bindings/comm.cpp``): collectives dispatch without the GIL.
    """

    def __init__(self, backend, bound_device_id=None, store=None):
        if store is not None:  # ProcessGroup::splitGroup derives the children's stores from it
            super().__init__(store, backend.rank(), backend.size())
        else:
            super().__init__(backend.rank(), backend.size())
        _tp.register_backend(self, backend)
        if bound_device_id is not None:
            self.bound_device_id = bound_device_id


def _only_bytescale(caller_frame) -> bool:
    """True when the group being created maps every device to bytescale (not "cpu:gloo,cuda:bytescale").

    torch.distributed's creator API does not pass the backend string (read from the caller's
    frame through :mod:`bytescale._torch_private`); anything unexpected answers False.
    """
    mapping = _tp.creator_device_backends(caller_frame)
    return bool(mapping) and all(v == BACKEND_NAME for v in mapping.values())


def _named(backend, dist_opts, caller_frame):
    """``backend`` as torch expects it: inside a process group named "bytescale" when the group is
    bytescale's alone (torch then uses the returned ProcessGroup as the group)."""
    if not _only_bytescale(caller_frame):
        return backend
    if dist.get_debug_level() == dist.DebugLevel.DETAIL and dist.is_gloo_available():
        # What torch does for a backend it wraps itself (TORCH_DISTRIBUTED_DEBUG=DETAIL): the
        # ProcessGroupWrapper's cross-rank desync checks (op, shapes, sequence numbers).
        backend = _tp.debug_wrapper(backend, str(dist_opts.group_id), dist_opts.store,
                                    dist_opts.group_rank, dist_opts.group_size,
                                    _as_timedelta(dist_opts.timeout))
    torch_pg = getattr(dist_opts, "process_group", None)
    return _NamedProcessGroup(backend, getattr(torch_pg, "bound_device_id", None), dist_opts.store)


def _group_kind(pg_options) -> str:
    if pg_options is None:
        return "static"
    kind = getattr(pg_options, "kind", None)
    if kind not in GROUP_KINDS:
        raise TypeError(f"bytescale: pg_options must be a bytescale.comm.GroupOptions (kind static or "
                        f"dynamic), got {pg_options!r}")
    return kind


def _static_backend(dist_opts, caller, global_ranks, timeout):
    """A static group: a Gloo context of the members, and the CUDA communicator split from the
    world's when torch passes a split source (a device-bound world) and every rank takes part."""
    store = dist_opts.store
    rank, size = dist_opts.group_rank, dist_opts.group_size
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("bytescale/gloo/", store), rank, size, timeout)
    if hasattr(dist_opts, "split_from"):
        parent = dist_opts.split_from
    else:
        # a torch without the field: the source torch derives (distributed_c10d._get_split_source,
        # a device-bound world's backend), from which its non-members perform_nocolor_split;
        # not splitting here would leave them blocked in that split forever
        bound = getattr(_tp.default_group(), "bound_device_id", None)
        parent = _world_backend if bound is not None and torch.device(bound).type != "cpu" else None
    if not isinstance(parent, _C.comm.BytescaleBackend) or _tp.creator_local_synchronization(caller):
        parent = None  # no split: the group's own CUDA communicator, made by its members
    return _C.comm.BytescaleBackend.static_group(store, rank, timeout, gloo, global_ranks, parent)


def _create_backend(dist_opts, pg_options):
    """Creator called by torch.distributed (extended API) for every group using "bytescale"."""
    global _world_backend
    caller = sys._getframe(1)
    store = dist_opts.store
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = _as_timedelta(dist_opts.timeout)
    global_ranks = list(dist_opts.global_ranks_in_group)
    with _lock:
        if global_ranks and _world_backend is not None:
            # A subgroup (dist.new_group / DeviceMesh): static unless asked for a dynamic one.
            if _group_kind(pg_options) == "dynamic":
                world = dist.get_world_size()
                backend = _C.comm.DynamicGroupBackend(global_ranks, world, dist.get_rank(), timeout=timeout)
            else:
                backend = _static_backend(dist_opts, caller, global_ranks, timeout)
            return _named(backend, dist_opts, caller)
        if global_ranks and len(global_ranks) != size:
            raise RuntimeError(
                "bytescale: a subgroup was created with the bytescale backend while the default "
                "process group does not use it; init_process_group('bytescale') first"
            )
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("bytescale/gloo/", store), rank, size, timeout)
        backend = _C.comm.BytescaleBackend(store, rank, size, timeout, gloo)
        _world_backend = backend
        _forget_groups()
        bound = getattr(getattr(dist_opts, "process_group", None), "bound_device_id", None)
        if bound is not None and torch.device(bound).type != "cpu":
            # init_process_group(device_id=...): torch connects eagerly only backends that support
            # splitting (torch 2.14, distributed_c10d._new_process_group_helper), which this one
            # does not, so the world communicator is created here, on every rank, before any
            # ring, dynamic-group op or send/recv needs it.
            backend.eager_connect_single_device(torch.device(bound))
        return _named(backend, dist_opts, caller)


def _register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # already registered (re-import)
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


def world_backend() -> _C.comm.BytescaleBackend:
    """The C++ backend of the world group (raises if bytescale is not initialised)."""
    if _world_backend is None or not dist.is_initialized():
        raise RuntimeError(
            "bytescale: no world backend; call dist.init_process_group('bytescale') first"
        )
    return _world_backend


class DynamicGroup(_C.comm.NamedProcessGroup):
    """A process group over an ordered list of global ranks, on the world communicator.

    Pass it as ``group=`` to ``dist.all_reduce``, ``dist.all_gather_into_tensor``,
    ``dist.reduce_scatter_tensor``, ``dist.broadcast``, ``dist.all_to_all_single``,
    ``dist.batch_isend_irecv`` (and the other collectives). Ranks given to torch.distributed APIs
    (``src=``, ``dst=``, ``P2POp`` peers) are global ranks, as for any group.
    """

    def __init__(self, ranks: Sequence[int]):
        if not dist.is_initialized():
            raise RuntimeError("bytescale.dynamic_group: call dist.init_process_group('bytescale') first")
        world = dist.get_world_size()
        me = dist.get_rank()
        backend = _C.comm.DynamicGroupBackend(list(ranks), world, me)
        self._backend = backend
        self._ranks = tuple(backend.ranks)
        super().__init__(backend.group_rank, len(self._ranks))
        _tp.register_backend(self, backend)
        # torch.distributed translates global ranks (src=, dst=, P2P peers) and names the backend
        # (in logs and errors) through its _world tables.
        _tp.register_group(self, self._ranks, BACKEND_NAME)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ordered global ranks (ring order)."""
        return self._ranks

    @property
    def is_member(self) -> bool:
        return self._backend.group_rank >= 0

    @property
    def next_rank(self) -> int:
        """Global rank of the next member in ring order."""
        return self._backend.next_rank

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member in ring order."""
        return self._backend.prev_rank

    def ring_exchange(
        self, send: Optional[torch.Tensor], recv: Optional[torch.Tensor], async_op: bool = False
    ):
        """Send ``send`` to the next member and receive into ``recv`` from the previous one.

        Both directions are launched as one batched step (for ring attention). Returns the Work
        when ``async_op`` is true, else waits and returns None.
        """
        work = self._backend.ring_exchange(send, recv)
        if async_op:
            return work
        work.wait()
        return None

    def _release(self) -> None:
        _tp.unregister_group(self)

    def __repr__(self) -> str:
        return f"DynamicGroup(ranks={list(self._ranks)})"


# The cache of dynamic_group(): an LRU bounded by count AND by members, so its memory is bounded
# at any world size. A group costs about 2.7 KiB (Python object, C++ backend, torch's table
# entries) plus about 120 bytes per member (its rank tuple, torch's rank-translation dict, the C++
# rank list and sorted index; nothing of the world's size, csrc/comm/schedule.h RankMap), so the
# cache holds at most 4096 * 2.7 KiB + 2**18 * 120 B, about 41 MiB, whether the world has 4 ranks
# or 16,384 (there: e.g. 4096 rings of up to 64 ranks, or 16 whole-world groups).
_CACHE_SIZE = 4096
_CACHE_MEMBERS = 1 << 18
_group_cache: "OrderedDict[tuple[int, ...], DynamicGroup]" = OrderedDict()
_cache_members = 0

# Groups outside the cache (cache=False, or evicted): torch's _world tables hold them, so they
# never die by themselves. A sweep releases the ones nobody else refers to any more (their
# reference count back to what bytescale's and torch's own holders account for); it runs when the
# list doubles past its size after the last sweep, so a create/drop loop costs O(1) amortized and
# at most max(64, 2 x live) groups wait for release.
_uncached: "list[DynamicGroup]" = []
_sweep_at = 64
_held_refs: Optional[int] = None  # refcount of a group only bytescale's and torch's tables hold


def _track(g: DynamicGroup) -> None:
    global _sweep_at
    _uncached.append(g)
    if len(_uncached) >= _sweep_at:
        _sweep()
        _sweep_at = max(64, 2 * len(_uncached))


def _sweep() -> None:
    live = []
    for g in _uncached:
        if sys.getrefcount(g) > _held_refs:
            live.append(g)
        else:
            g._release()
    _uncached[:] = live


def dynamic_group(ranks: Iterable[int], cache: bool = True) -> DynamicGroup:
    """A group over ``ranks`` (ordered global ranks, any size 1..world), created locally.

    No communication and no communicator is involved: call it on every member (and, if convenient,
    on non-members, who may hold but not use the group). With ``cache=True`` the same ordered rank
    list returns the same object (an LRU of at most 4096 groups and 2**18 members in all, about
    41 MiB at any world size), so per-micro-batch calls cost a dict lookup. With ``cache=False``
    (and once evicted from the cache) a group is released when the caller drops it.
    """
    global _cache_members, _held_refs
    key = tuple(int(r) for r in ranks)
    if cache:
        g = _group_cache.get(key)
        if g is not None:
            _group_cache.move_to_end(key)
            return g
    g = DynamicGroup(key)
    if _held_refs is None:
        # a fresh group: torch's tables, this name and getrefcount's argument; in _sweep also
        # _uncached's entry (the loop variable stands for this name)
        _held_refs = sys.getrefcount(g) + 1
    if not cache:
        _track(g)
        return g
    _group_cache[key] = g
    _cache_members += len(key)
    while len(_group_cache) > 1 and (len(_group_cache) > _CACHE_SIZE or _cache_members > _CACHE_MEMBERS):
        old_key, old = _group_cache.popitem(last=False)
        _cache_members -= len(old_key)
        _track(old)  # released once its holders drop it too
        del old
    return g


def _forget_groups() -> None:
    """A new world: the old world's groups (torch's tables were reset with it) are dropped."""
    global _cache_members
    _group_cache.clear()
    _uncached.clear()
    _cache_members = 0


def clear_dynamic_groups() -> None:
    """Forget cached dynamic groups (they are also dropped when the world backend is recreated);
    each is released once nobody refers to it."""
    global _cache_members
    while _group_cache:
        _, g = _group_cache.popitem(last=False)
        _track(g)
        del g
    _cache_members = 0
    _sweep()


_register()


def agree(values: Sequence[int], what: str, ranks: Optional[Sequence[int]] = None,
          kind: str = "user") -> list:
    """The agreement primitive (``csrc/comm/agreement.h``) from Python: every member of ``ranks``
    (ordered global ranks, default the world) sends its ``values`` (at most 15 int64) and gets
    every member's, padded with zeros to 15, as a list of rows in group order.

    It is the exchange behind the collective consistency check, ring attention's agreement check
    and the loader's plan check (``kind="plan"``): one fixed-size message per pair, over the world
    CPU transport's host channel (never queued behind communication, on CUDA not on the NCCL
    stream), so members that are in different kinds of agreement raise naming both. Every member
    must call it; it blocks until all did (or the world group's timeout).
    """
    payload = [int(v) for v in values]
    members = None if ranks is None else [int(r) for r in ranks]
    # errors name the op, the group and the peer: "bytescale <what> on world group [0, 1]: ..."
    shown = members if members is not None else list(range(dist.get_world_size()))
    listed = ", ".join(map(str, shown)) if len(shown) <= 16 else f"{shown[0]}, ..., {shown[-1]}"
    label = f"{what} on {'world group' if members is None else 'group'} [{listed}]"
    return _C.comm.agree(payload, label, kind, members)

