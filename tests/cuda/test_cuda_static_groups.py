"""Static groups on NCCL with one GPU per rank (two or more GPUs; skipped otherwise, and on the
one-GPU machines lent so far: NCCL refuses two ranks on one GPU, so this is GPU-only and not yet
run). What it would catch:
  * a world NOT bound to a device (no device_id=): a static group's communicator is its own,
    created lazily; a pipeline channel (a static group of two ranks) must be created by its first
    send/recv (it used to raise "does not exist yet" with advice a static group cannot follow);
  * a bound world: static groups split from the world's communicator (ncclCommSplit, bounded by
    the group's timeout), each with its own stream, collectives and P2P on them;
  * the consistency check of a static group's collectives pairs the group's own ranks.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _channels(rank, world, store_path, bind):
    import datetime

    import torch.distributed as dist

    import bytescale

    torch.cuda.set_device(rank)
    dist.init_process_group("bytescale", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", rank) if bind else None)
    mesh = bytescale.init_mesh(pp=2)
    out = {}
    x = torch.arange(6, dtype=torch.float32, device="cuda") + 10 * rank
    if rank == 0:  # the first op on each channel is a point-to-point one
        dist.send(x, dst=1, group=mesh.p2p_group("fwd", 0))
        y = torch.empty_like(x)
        dist.recv(y, src=1, group=mesh.p2p_group("bwd", 0))
    else:
        y = torch.empty_like(x)
        dist.recv(y, src=0, group=mesh.p2p_group("fwd", 0))
        dist.send(x, dst=0, group=mesh.p2p_group("bwd", 0))
    out["p2p"] = y.cpu()
    pair = dist.new_group([0, 1])
    z = x.clone()
    dist.all_reduce(z, group=pair)
    out["all_reduce"] = z.cpu()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("bind", [False, True])
def test_static_groups_and_pipeline_channels_without_device_id(bind, tmp_path):
    res = run_distributed(_channels, 2, str(tmp_path / "store"), bind, timeout=240, init=False)
    base = torch.arange(6, dtype=torch.float32)
    assert torch.equal(res[0]["p2p"], base + 10) and torch.equal(res[1]["p2p"], base)
    for r in res:
        assert torch.equal(r["all_reduce"], 2 * base + 10)
