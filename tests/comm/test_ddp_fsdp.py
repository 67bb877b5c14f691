"""DDP and FSDP2 train on the bytescale backend exactly like plain single-process training.

Reference: one process, plain SGD on the concatenated global batch (mean loss), float64.
DDP on bytescale is also compared bit-for-bit with DDP on gloo in the same processes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import run_distributed

STEPS = 3
PER_RANK = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(PER_RANK, 8, generator=g, dtype=torch.float64), torch.randn(
        PER_RANK, 3, generator=g, dtype=torch.float64
    )


def _reference(world: int):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        xs, ys = zip(*[_batch(step, r) for r in range(world)])
        loss = nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(model, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _ddp(rank: int, world: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref_pg = dist.new_group(list(range(world)), backend="gloo")
    a = DDP(_model(), bucket_cap_mb=0.0001)  # several buckets
    b = DDP(_model(), process_group=ref_pg, bucket_cap_mb=0.0001)
    _train(a, rank)
    _train(b, rank)
    pa = [p.detach().clone() for p in a.module.parameters()]
    pb = [p.detach().clone() for p in b.module.parameters()]
    for x, y in zip(pa, pb):
        assert torch.equal(x, y), "DDP on bytescale differs from DDP on gloo"
    return pa


def _fsdp(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, rank)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_single_process(world):
    ref = _reference(world)
    for params in run_distributed(_ddp, world):
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_matches_single_process(world):
    ref = _reference(world)
    for params in run_distributed(_fsdp, world):
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12)
