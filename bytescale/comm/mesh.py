"""The job's device mesh: ``pp x hdp x tp``, tensor parallelism innermost.

    mesh = bytescale.init_mesh(tp=2)          # after dist.init_process_group("bytescale")
    mesh["tp"], mesh["hdp"]                   # torch DeviceMeshes of this rank's groups
    mesh.units                                # HDP unit -> global ranks (what the planner plans)

ByteScale's HDP replaces only data and context parallelism; tensor and pipeline parallelism stay,
sized by the model. Global rank ``g = (p * hdp + h) * tp + t``: the ranks of a TP group are
consecutive (on one node under torchrun), the HDP dimension of a TP index ``t`` strides by ``tp``,
and the pipeline stages are outermost. The TP (and PP) groups are static groups
(:mod:`bytescale.comm`: communicators of their own, made once); the rings the planner forms each
step over HDP units stay dynamic groups.

A torch ``DeviceMesh`` the user built on the bytescale backend works too
(:func:`mesh_from_device_mesh`): its dimensions named among ``pp``, ``hdp`` and ``tp`` (any order).

Expert parallelism (``init_mesh(ep=E)``) splits the HDP dimension of each stage and TP index into
blocks of ``E`` consecutive HDP units: an EXPERT-PARALLEL group (``mesh.group("ep")``) holds the
ranks of one block (they shard each MoE layer's experts among them and exchange tokens by
all-to-all), and the EXPERT-DATA-PARALLEL group (``mesh.group("edp")``) holds the ranks at the same
place of every block (they hold the same experts; expert gradients are summed over it). Both are
static groups. Dense layers keep the HDP dimension (and TP) unchanged.

Pipeline parallelism (``init_mesh(pp=P)``): pipeline ``h`` at TP index ``t`` is ``grid[p][h][t]``
for ``p = 0 .. P - 1``; a stage's HDP pool is its units (``mesh.units``). Activations and their
gradients cross each stage boundary on two static two-rank groups, one per direction
(:meth:`Mesh.p2p_group`): NCCL runs a communicator's operations in issue order on one stream and a
send waits for its receiver, so one shared channel would deadlock 1F1B (stage p sends the forward
of slot w while stage p + 1 sends the backward of slot 0, each waiting for the other's receive); on
a channel of one direction the sender and the receiver list the transfers in the same slot order.
"""
from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..parallel_dims import ParallelDims
from ..planner.units import UnitMap

__all__ = ["MESH_DIMS", "Mesh", "init_mesh", "mesh_from_device_mesh", "current_mesh", "set_current_mesh"]

MESH_DIMS = ("pp", "hdp", "tp")
"""The mesh's dimensions, outermost first."""

_current: Optional["Mesh"] = None
_current_world: Optional[object] = None  # the default process group _current was made in


@dataclass(frozen=True, eq=False)
class Mesh:
    """A ``pp x hdp x tp`` layout of the world (see module docstring).

    ``device_mesh``: the torch DeviceMesh (its dimensions: those of MESH_DIMS it has, "hdp" always);
    ``grid``: every rank at ``grid[p][h][t]``; ``rank``: this process.
    """

    device_mesh: "torch.distributed.device_mesh.DeviceMesh"
    grid: Tuple[Tuple[Tuple[int, ...], ...], ...]
    rank: int
    ep: int = 1
    """Expert-parallel degree: HDP units per expert-parallel block (module docstring)."""
    expert_groups: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    """This rank's static ``"ep"`` and ``"edp"`` groups (made by :func:`init_mesh` when ep > 1)."""
    pipeline_groups: Dict[Tuple[str, int], dist.ProcessGroup] = field(default_factory=dict)
    """This rank's pipeline channels (pp > 1): ``("fwd", b)`` carries activations from stage b to
    b + 1, ``("bwd", b)`` their gradients back; two-rank static groups (:meth:`p2p_group`)."""
    dims: Optional[ParallelDims] = None
    """The sizes this mesh was laid out from (:func:`init_mesh`; None for a user's DeviceMesh)."""

    @property
    def pp(self) -> int:
        return len(self.grid)

    @property
    def hdp(self) -> int:
        return len(self.grid[0])

    @property
    def tp(self) -> int:
        return len(self.grid[0][0])

    @property
    def world_size(self) -> int:
        return self.pp * self.hdp * self.tp

    def coords(self, rank: Optional[int] = None) -> Dict[str, int]:
        """``{"pp": p, "hdp": h, "tp": t}`` of ``rank`` (default: this process)."""
        r = self.rank if rank is None else int(rank)
        for p, stage in enumerate(self.grid):
            for h, unit in enumerate(stage):
                if r in unit:
                    return {"pp": p, "hdp": h, "tp": unit.index(r)}
        raise ValueError(f"bytescale Mesh: rank {r} is not in the mesh {self.describe()}")

    @property
    def units(self) -> UnitMap:
        """HDP unit -> global ranks of this rank's pipeline stage (what the planner plans)."""
        return UnitMap(self.grid[self.coords()["pp"]])

    def __getitem__(self, name: str):
        """The DeviceMesh of dimension ``name`` ("pp", "hdp", "tp") through this rank; a dimension
        of size 1 that the DeviceMesh lacks raises KeyError (see :meth:`has`)."""
        if name not in MESH_DIMS:
            raise KeyError(f"bytescale Mesh: no dimension {name!r} (dimensions: {', '.join(MESH_DIMS)})")
        if name not in (self.device_mesh.mesh_dim_names or ()):
            raise KeyError(f"bytescale Mesh: dimension {name!r} has size 1 and is not part of the "
                           f"DeviceMesh {self.device_mesh.mesh_dim_names}")
        return self.device_mesh[name]

    def has(self, name: str) -> bool:
        return name in (self.device_mesh.mesh_dim_names or ())

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """The process group of dimension ``name`` through this rank (None for an absent size-1
        dimension: nothing to communicate). ``"ep"``/``"edp"``: the expert-parallel and
        expert-data-parallel groups (with ep 1: None and the HDP group)."""
        if name in ("ep", "edp"):
            if self.ep == 1:
                return None if name == "ep" else self.group("hdp")
            return self.expert_groups[name]
        return self[name].get_group() if self.has(name) else None

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 .. pp - 1)."""
        return self.coords()["pp"]

    def p2p_group(self, direction: str, boundary: int) -> dist.ProcessGroup:
        """The channel of stage boundary ``boundary`` (between stages ``boundary`` and
        ``boundary + 1``) through this rank: ``"fwd"`` carries activations forward, ``"bwd"``
        gradients back. One static group per boundary and direction, so that each channel is a
        first-in first-out queue whose sender and receiver list its transfers in the same order
        (micro-batch slot order): on CUDA each is its own communicator and stream, and a forward
        send waiting for its receiver never holds up a backward transfer (module docstring)."""
        key = (direction, int(boundary))
        if key not in self.pipeline_groups:
            raise KeyError(f"bytescale Mesh: rank {self.rank} (stage {self.stage} of {self.pp}) has no "
                           f"{direction!r} channel across stage boundary {boundary}")
        return self.pipeline_groups[key]

    def ranks(self, name: str, rank: Optional[int] = None) -> Tuple[int, ...]:
        """Global ranks of the ``name`` group through ``rank`` (default: this process)."""
        c = self.coords(rank)
        if name == "tp":
            return self.grid[c["pp"]][c["hdp"]]
        if name == "hdp":
            return tuple(u[c["tp"]] for u in self.grid[c["pp"]])
        if name == "pp":
            return tuple(stage[c["hdp"]][c["tp"]] for stage in self.grid)
        if name == "ep":
            b = c["hdp"] // self.ep * self.ep
            return tuple(u[c["tp"]] for u in self.grid[c["pp"]][b:b + self.ep])
        if name == "edp":
            return tuple(u[c["tp"]] for u in self.grid[c["pp"]][c["hdp"] % self.ep::self.ep])
        raise KeyError(f"bytescale Mesh: no dimension {name!r}")

    def describe(self) -> str:
        return (f"pp {self.pp} x hdp {self.hdp} x tp {self.tp} = {self.world_size} ranks "
                f"{f'(ep {self.ep}) ' if self.ep > 1 else ''}"
                f"(TP groups {[list(u) for u in self.grid[0][:4]]}{' ...' if self.hdp > 4 else ''})")

    def to_dict(self) -> Dict[str, int]:
        """The layout's sizes (checkpoint manifests, plan checks)."""
        return {"pp": self.pp, "hdp": self.hdp, "tp": self.tp, "ep": self.ep}


def _check_size(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"bytescale.init_mesh: {name} must be an integer >= 1, got {v!r}")
    return v


def _default_device_type() -> str:
    from .. import _torch_private as _tp

    bound = getattr(_tp.default_group(), "bound_device_id", None)
    return bound.type if bound is not None else "cpu"


def _warn_if_tp_spans_nodes(grid, hostnames: List[str]) -> None:
    for stage in grid:
        for unit in stage:
            hosts = sorted({hostnames[r] for r in unit})
            if len(hosts) > 1:
                warnings.warn(
                    f"bytescale.init_mesh: the TP group of ranks {list(unit)} spans {len(hosts)} nodes "
                    f"({', '.join(hosts)}): its collectives (several per layer) cross the network; "
                    "make tp divide the number of ranks per node", RuntimeWarning, stacklevel=3)
                return


def _expert_groups(grid, ep: int, rank: int) -> Dict[str, dist.ProcessGroup]:
    """Create every EP and EDP group (static; every rank creates all of them, in one order) and
    return this rank's."""
    mine: Dict[str, dist.ProcessGroup] = {}
    hdp = len(grid[0])
    timeout = _world_timeout()
    for kind in ("ep", "edp"):
        for stage in grid:
            for t in range(len(stage[0])):
                col = [unit[t] for unit in stage]
                parts = ([col[b:b + ep] for b in range(0, hdp, ep)] if kind == "ep"
                         else [col[j::ep] for j in range(ep)])
                for ranks in parts:
                    g = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        mine[kind] = g
    return mine


def _world_timeout():
    """The world group's timeout, for the static groups made here (torch gives a subgroup made
    without one its 30-minute default: a stuck transfer would raise only after that)."""
    from . import world_backend

    try:
        return world_backend().timeout
    except RuntimeError:  # the world is not bytescale's
        return None


def _pipeline_groups(grid, rank: int) -> Dict[Tuple[str, int], dist.ProcessGroup]:
    """Create every pipeline channel (static two-rank groups: per pipeline and TP index, per stage
    boundary, one per direction; every rank creates all of them, in one order) and return this
    rank's. They time out as the world does."""
    mine: Dict[Tuple[str, int], dist.ProcessGroup] = {}
    timeout = _world_timeout()
    pp, hdp, tp = len(grid), len(grid[0]), len(grid[0][0])
    for h in range(hdp):
        for t in range(tp):
            for b in range(pp - 1):
                pair = [grid[b][h][t], grid[b + 1][h][t]]
                for direction in ("fwd", "bwd"):
                    g = dist.new_group(pair, timeout=timeout)
                    if rank in pair:
                        mine[(direction, b)] = g
    return mine


def init_mesh(tp: int = 1, pp: int = 1, device_type: Optional[str] = None, ep: int = 1) -> Mesh:
    """Lay the world out as ``pp x hdp x tp`` (TP innermost), make it the current mesh, return it.

    Collective: every rank calls it after ``dist.init_process_group("bytescale")``. ``hdp`` is
    ``world / (pp x tp)``. The TP and PP groups are created here, once, as static groups; with
    ``ep`` > 1 so are the expert-parallel and expert-data-parallel groups (module docstring).

    Raises:
        ValueError: a size that is not a positive integer, a world size that ``pp x tp`` does
            not divide, or an ``ep`` that does not divide ``hdp`` (naming the values). A TP group
            whose ranks are on several nodes (by hostname) gives a RuntimeWarning.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("bytescale.init_mesh: call dist.init_process_group('bytescale') first")
    tp, pp, ep = _check_size("tp", tp), _check_size("pp", pp), _check_size("ep", ep)
    world = dist.get_world_size()
    try:  # the sizes and what composes: stated once (bytescale/parallel_dims.py)
        dims = ParallelDims(world, pp=pp, tp=tp, ep=ep)
    except ValueError as e:
        raise ValueError(f"bytescale.init_mesh: {e}") from None
    hdp = dims.hdp
    sizes = {"pp": pp, "hdp": hdp, "tp": tp}
    names = tuple(d for d in MESH_DIMS if sizes[d] > 1 or d == "hdp")
    hosts: List[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    device_mesh = init_device_mesh(device_type or _default_device_type(), tuple(sizes[d] for d in names),
                                   mesh_dim_names=names)
    grid = dims.grid
    _warn_if_tp_spans_nodes(grid, hosts)
    groups = _expert_groups(grid, ep, dist.get_rank()) if ep > 1 else {}
    channels = _pipeline_groups(grid, dist.get_rank()) if pp > 1 else {}
    mesh = Mesh(device_mesh, grid, dist.get_rank(), ep, groups, channels, dims)
    set_current_mesh(mesh)
    return mesh


def mesh_from_device_mesh(device_mesh) -> Mesh:
    """A :class:`Mesh` over a DeviceMesh the user built (dimensions named among pp, hdp, tp, in
    any order; a missing one has size 1); it becomes the current mesh."""
    names = tuple(device_mesh.mesh_dim_names or ())
    bad = [n for n in names if n not in MESH_DIMS]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"bytescale: a DeviceMesh for HDP needs dimensions named among {MESH_DIMS} "
                         f"(each once), got {names or 'unnamed dimensions'}")
    ranks = device_mesh.mesh
    if ranks.numel() != dist.get_world_size():
        raise ValueError(f"bytescale: the DeviceMesh holds {ranks.numel()} ranks, the world {dist.get_world_size()}")
    full = ranks
    for d in MESH_DIMS:  # add the missing dimensions as size 1, then order them pp, hdp, tp
        if d not in names:
            full = full.unsqueeze(-1)
            names = names + (d,)
    full = full.permute([names.index(d) for d in MESH_DIMS])
    grid = tuple(tuple(tuple(int(r) for r in unit) for unit in stage) for stage in full.tolist())
    channels = _pipeline_groups(grid, dist.get_rank()) if len(grid) > 1 else {}
    mesh = Mesh(device_mesh, grid, dist.get_rank(), pipeline_groups=channels)
    set_current_mesh(mesh)
    return mesh


def current_mesh() -> Optional[Mesh]:
    """The mesh :func:`init_mesh` made last in this world: None before, after the world was
    destroyed, and in a later world (a process group initialised again), whose ranks and groups
    the old mesh does not describe."""
    if _current is None or not dist.is_initialized() or dist.group.WORLD is not _current_world:
        return None
    return _current


def set_current_mesh(mesh: Optional[Mesh]) -> None:
    """Make ``mesh`` the current one of this world (the default process group now initialised)."""
    global _current, _current_world
    _current = mesh
    _current_world = dist.group.WORLD if mesh is not None and dist.is_initialized() else None
