"""The pp x hdp x tp mesh and static groups.

``bytescale.init_mesh(tp=T)`` lays the world out with TP innermost; its TP and HDP groups are
STATIC groups (communicators of their own: a Gloo context of the members on CPU) whose collectives
give the sums computed independently here; ``new_group`` makes a static group by default and a
dynamic one when asked; the C++ split path (``ProcessGroup.split_group``, what DeviceMesh uses on a
device-bound world) makes static groups too; a user's DeviceMesh with named dimensions gives the
same unit map; bad sizes and node-spanning TP groups are reported with the values.
"""
from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

pytestmark = pytest.mark.multiprocess


def _x(rank: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float64) * (rank + 1) + rank


def _backend(group):
    return group._get_backend(torch.device("cpu"))


def _mesh_groups(rank, world):
    import bytescale
    from bytescale import _C

    mesh = bytescale.init_mesh(tp=2)
    out = {"units": mesh.units.to_list(), "coords": mesh.coords(), "tp_ranks": mesh.ranks("tp"),
           "hdp_ranks": mesh.ranks("hdp"), "names": mesh.device_mesh.mesh_dim_names}
    for name in ("tp", "hdp"):
        g = mesh.group(name)
        y = _x(rank)
        dist.all_reduce(y, group=g)
        out[name + "_sum"] = y
        b = _backend(g)
        out[name + "_static"] = isinstance(b, _C.comm.BytescaleBackend) and not b.is_world
        out[name + "_global"] = list(b.global_ranks)
        # a reduce-scatter (not native in Gloo: bytescale's P2P algorithm on the group's own channel)
        big = torch.arange(2 * 3, dtype=torch.float64) + rank
        o = torch.empty(3, dtype=torch.float64)
        dist.reduce_scatter_tensor(o, big, group=g)
        out[name + "_rs"] = o
    assert bytescale.current_mesh() is mesh
    return out


def test_init_mesh_tp_innermost_static_groups():
    res = run_distributed(_mesh_groups, 4, timeout=240)
    for rank, r in enumerate(res):
        assert r["units"] == [[0, 1], [2, 3]]
        assert r["names"] == ("hdp", "tp")
        assert r["coords"] == {"pp": 0, "hdp": rank // 2, "tp": rank % 2}
        tp = [rank - rank % 2, rank - rank % 2 + 1]
        hdp = [rank % 2, rank % 2 + 2]
        assert list(r["tp_ranks"]) == tp and list(r["hdp_ranks"]) == hdp
        for name, members in (("tp", tp), ("hdp", hdp)):
            assert r[name + "_static"], f"the {name} group is not a static group"
            assert r[name + "_global"] == members
            assert torch.equal(r[name + "_sum"], sum(_x(m) for m in members))
            me = members.index(rank)
            full = sum(torch.arange(6, dtype=torch.float64) + m for m in members)
            assert torch.equal(r[name + "_rs"], full[3 * me:3 * me + 3])


def _kinds_and_split(rank, world):
    from bytescale import _C
    from bytescale.comm import GroupOptions
    from bytescale import _torch_private as tp

    out = {}
    static = dist.new_group([0, 2])
    dynamic = dist.new_group([0, 2], pg_options=GroupOptions(kind="dynamic"))
    if rank in (0, 2):
        out["static"] = type(_backend(static)).__name__
        out["dynamic"] = type(_backend(dynamic)).__name__
        y = _x(rank)
        dist.all_reduce(y, group=static)
        z = _x(rank)
        dist.all_reduce(z, group=dynamic)
        out["sums"] = (y, z)
    # the split path (DeviceMesh with a device-bound world): ProcessGroup.split_group calls the
    # backend's split() once per device type; every rank takes part, non-members get None
    mine = [0, 1] if rank < 2 else [2, 3]
    child = tp.default_group().split_group(mine, timeout=datetime.timedelta(seconds=60),
                                           group_name=f"split-{mine[0]}")
    b = child._get_backend(torch.device("cpu"))
    out["split_static"] = isinstance(b, _C.comm.BytescaleBackend) and list(b.global_ranks) == mine
    out["split_same_for_cuda"] = child._get_backend(torch.device("cuda")) is b if torch.cuda.is_available() else True
    y = _x(rank)
    child.allreduce([y]).wait()
    out["split_sum"] = y
    if rank in (1, 3):  # the creator runs on the members only
        with pytest.raises(TypeError, match="GroupOptions"):
            dist.new_group([1, 3], pg_options=object(), use_local_synchronization=True)
    return out


def test_new_group_static_by_default_dynamic_on_request_and_split():
    res = run_distributed(_kinds_and_split, 4, timeout=240)
    for rank, r in enumerate(res):
        if rank in (0, 2):
            assert r["static"] == "BytescaleBackend" and r["dynamic"] == "DynamicGroupBackend"
            expect = _x(0) + _x(2)
            assert torch.equal(r["sums"][0], expect) and torch.equal(r["sums"][1], expect)
        assert r["split_static"] and r["split_same_for_cuda"]
        base = 0 if rank < 2 else 2
        assert torch.equal(r["split_sum"], _x(base) + _x(base + 1))


def _user_device_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import bytescale

    out = {}
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "hdp"))  # TP outermost: a user's choice
    out["swapped"] = bytescale.mesh_from_device_mesh(dm).units.to_list()
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("hdp", "tp"))
    m = bytescale.mesh_from_device_mesh(dm)
    out["plain"] = m.units.to_list()
    y = _x(rank)
    dist.all_reduce(y, group=m.group("tp"))
    out["tp_sum"] = y
    try:
        bytescale.mesh_from_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    except ValueError as e:
        out["bad"] = str(e)
    return out


def test_mesh_from_a_user_device_mesh():
    for rank, r in enumerate(run_distributed(_user_device_mesh, 4, timeout=240)):
        assert r["swapped"] == [[0, 2], [1, 3]]
        assert r["plain"] == [[0, 1], [2, 3]]
        base = rank - rank % 2
        assert torch.equal(r["tp_sum"], _x(base) + _x(base + 1))
        assert "dimensions named among ('pp', 'hdp', 'tp')" in r["bad"] and "'dp'" in r["bad"]


def _bad_sizes(rank, world):
    import socket

    import bytescale

    out = {}
    try:
        bytescale.init_mesh(tp=2)
    except ValueError as e:
        out["indivisible"] = str(e)
    try:
        bytescale.init_mesh(tp=0)
    except ValueError as e:
        out["zero"] = str(e)
    # a TP group over two "nodes": rank 0 on one host, ranks 1 and 2 on another
    real = socket.gethostname
    socket.gethostname = lambda: "node-a" if rank == 0 else "node-b"
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            bytescale.init_mesh(tp=3)
        out["warn"] = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    finally:
        socket.gethostname = real
    return out


def test_bad_mesh_sizes_and_node_spanning_tp_groups():
    for r in run_distributed(_bad_sizes, 3, timeout=180):
        assert "world of 3 ranks is not divisible by pp=1 x tp=2 = 2" in r["indivisible"]
        assert "tp must be an integer >= 1, got 0" in r["zero"]
        assert any("TP group of ranks [0, 1, 2] spans 2 nodes (node-a, node-b)" in m for m in r["warn"]), r["warn"]


def _mesh_of_an_earlier_world(rank, world, store_path):
    import bytescale

    mesh = bytescale.init_mesh(tp=2)
    assert bytescale.current_mesh() is mesh
    dist.destroy_process_group()
    assert bytescale.current_mesh() is None
    dist.init_process_group("bytescale", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    # a new world: the old mesh's groups and units describe nothing in it (a loader that took it
    # planned 2 units of a world of 4: silently wrong batches)
    return bytescale.current_mesh() is None


def test_a_mesh_never_outlives_its_world(tmp_path):
    assert run_distributed(_mesh_of_an_earlier_world, 4, str(tmp_path / "store2"), timeout=120) == [True] * 4
