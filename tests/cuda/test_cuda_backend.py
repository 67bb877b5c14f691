"""CUDA path of the bytescale backend at world size 1 (one GPU): NCCL round trips, non-blocking
wait, dynamic group of one, attention ops on CUDA. Skipped without a GPU; passed on one H200
(2026-11-22). Multi-GPU NCCL cannot run on the single lent GPU and is unverified."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def pg():
    import bytescale  # noqa: F401

    dist.init_process_group("bytescale", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_collectives_round_trip(pg):
    x = torch.arange(10, dtype=torch.float32, device="cuda")
    y = x.clone()
    dist.all_reduce(y)
    assert torch.equal(y, x)
    dist.all_reduce(y, op=dist.ReduceOp.AVG)
    assert torch.equal(y, x)
    out = torch.empty(10, device="cuda")
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x)
    dist.reduce_scatter_tensor(out, x)
    assert torch.equal(out, x)
    dist.broadcast(y, src=0)
    o2 = torch.empty_like(x)
    dist.all_to_all_single(o2, x)
    assert torch.equal(o2, x)
    dist.barrier()


def test_wait_does_not_block_cpu(pg):
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):
        a = a @ a / 64  # a long GPU queue on the current stream
    t = torch.ones(1 << 20, device="cuda")
    t0 = time.perf_counter()
    w = dist.all_reduce(t, async_op=True)
    w.wait()  # the current stream waits on the end event; the CPU returns at once
    cpu = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    gpu = time.perf_counter() - t1
    assert cpu < gpu, (cpu, gpu)


def test_dynamic_group_and_attention_on_cuda(pg):
    import bytescale
    from bytescale.attention import reference_varlen_attention
    from bytescale.attention import ring_attention, varlen_attention

    g = bytescale.dynamic_group([0])
    t = torch.ones(5, device="cuda")
    dist.all_reduce(t, group=g)
    assert torch.equal(t, torch.ones(5, device="cuda"))
    lens = [100, 37]
    q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.float64, requires_grad=True)
    ref = reference_varlen_attention(q, k, v, lens)
    torch.testing.assert_close(varlen_attention(q, k, v, lens), ref)
    torch.testing.assert_close(ring_attention(q, k, v, lens, [0]), ref)
