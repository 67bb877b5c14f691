"""The staged transport (csrc/comm/staged_transport.h; BYTESCALE_CUDA_TRANSPORT=staged on a GPU):
every message copied through host memory and moved over the CPU (Gloo) transport, so several
processes can share one GPU. On a GPU it stages CUDA tensors (scripts/gpu_check.sh runs ring
attention, dynamic-group collectives and HDP + offload through it); here the very same staging
code runs on CPU tensors: ring steps (exchanged and posted), and a collective run through its
run() (the group_ops algorithm over the staged exchanges), against plain results."""
from __future__ import annotations

import torch

from dist_utils import run_distributed


def _staged(rank, world):
    from bytescale import _C

    ranks = list(range(world))[::-1]  # a ring in another order than the world's
    nxt, prv = ranks[(ranks.index(rank) + 1) % world], ranks[(ranks.index(rank) - 1) % world]
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        send = (torch.arange(37 * 3) + 1000 * rank).to(dtype).view(37, 3)
        for posted in (False, True):
            recv = torch.zeros_like(send)
            _C.comm._staged_ring_step(send, recv, ranks, posted)
            out[(str(dtype), posted)] = recv
    t = torch.arange(10, dtype=torch.float64) * (rank + 1)
    _C.comm._staged_all_reduce(t, list(range(world)))
    out["all_reduce"] = t
    # an empty receive (a rank holding no tokens of a ring step) is fine
    _C.comm._staged_ring_step(torch.empty(0), torch.empty(0), ranks)
    return nxt, prv, out


def test_staged_transport_moves_bytes_like_the_cpu_transport():
    world = 3
    res = run_distributed(_staged, world)
    for rank, (nxt, prv, out) in enumerate(res):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            want = (torch.arange(37 * 3) + 1000 * prv).to(dtype).view(37, 3)
            for posted in (False, True):
                assert torch.equal(out[(str(dtype), posted)], want), (rank, dtype, posted)
        assert torch.equal(out["all_reduce"], torch.arange(10, dtype=torch.float64) * 6)


def _staged_static_group(rank, world, members):
    """A static group's collectives on the staged plug-in (what a static group gets with
    BYTESCALE_CUDA_TRANSPORT=staged), here on CPU tensors: the consistency check runs on the host
    channel as on CUDA, and must pair the GROUP's ranks, not the world's."""
    import datetime

    import torch.distributed as dist
    from bytescale import _C

    group = dist.new_group(members, timeout=datetime.timedelta(seconds=20))
    out = None
    if rank in members:
        staged = _C.comm._staged_group_backend(group._get_backend(torch.device("cpu")))
        t = torch.arange(7, dtype=torch.float64) * (rank + 1)
        staged.allreduce([t]).wait()
        # a mismatch is caught by the check (so it ran), the same error on every member
        bad = torch.zeros(3 + members.index(rank))
        try:
            staged.allreduce([bad]).wait()
            err = None
        except RuntimeError as e:
            err = str(e)
        out = (t, err)
    dist.barrier()  # non-members stay until the members are done
    return out


def test_staged_static_groups_check_over_the_groups_ranks():
    for world, members in ((3, [0, 2]), (4, [2, 3])):
        res = run_distributed(_staged_static_group, world, members, timeout=120)
        want = torch.arange(7, dtype=torch.float64) * sum(r + 1 for r in members)
        for rank in range(world):
            if rank not in members:
                assert res[rank] is None
                continue
            t, err = res[rank]
            assert torch.equal(t, want), (world, members, rank, t)
            assert err is not None and "collective mismatch" in err, (world, members, rank, err)
