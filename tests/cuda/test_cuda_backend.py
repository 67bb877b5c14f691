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


def test_device_id_creates_the_communicator(pg):
    """Issue 21 finding 2: init_process_group(device_id=...) must create the world NCCL
    communicator at init (torch connects eagerly only backends that split), so a ring, a
    dynamic-group op or a send/recv can come before any world collective."""
    import bytescale

    assert bytescale.world_backend().device_connected("cuda")


def test_collective_after_the_eager_connect(pg):
    # the eager connect must not disturb a following world collective
    x = torch.ones(3, device="cuda")
    dist.all_reduce(x)
    assert torch.equal(x, torch.ones(3, device="cuda"))


def _two_nccl_ranks_on_one_gpu(rank, world, store_dir):
    import datetime
    import os

    from dist_utils import capture_error

    import bytescale  # noqa: F401

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    kind, msg, secs = capture_error(lambda: dist.init_process_group(
        "bytescale", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", 0)))
    return kind, msg, secs


def test_second_nccl_rank_on_the_same_gpu_fails_fast(tmp_path):
    """NCCL refuses two ranks on one GPU; the error must come fast and say so (the staged
    transport, BYTESCALE_CUDA_TRANSPORT=staged, is the way to run several processes on one GPU)."""
    from dist_utils import run_distributed

    res = run_distributed(_two_nccl_ranks_on_one_gpu, 2, str(tmp_path), init=False, timeout=120)
    kinds = [r[0] for r in res]
    assert any(k is not None for k in kinds), res
    for kind, msg, secs in res:
        if kind is not None:
            assert "one GPU" in msg or "Duplicate GPU" in msg, msg
            assert secs < 60, secs


def test_unsupported_dtype_fails_before_any_nccl_call(pg):
    """Issue 21 finding 7: every dtype is checked before an NCCL group opens (an error inside an
    open group would launch the half-queued batch and leave the peers mismatched); the
    communicator stays usable."""
    bad = torch.zeros(4, device="cuda", dtype=torch.uint16)
    with pytest.raises(RuntimeError, match="not supported by NCCL"):
        dist.all_reduce(bad)
    ok = torch.ones(4, device="cuda")
    dist.all_reduce(ok)
    assert torch.equal(ok, torch.ones(4, device="cuda"))
