"""init_process_group("bytescale") under torchrun (env://) and with an explicit Store."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist, bytescale
    dist.init_process_group("bytescale")  # env:// from torchrun
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    g = bytescale.dynamic_group(list(reversed(range(dist.get_world_size()))))
    u = torch.ones(3)
    dist.all_reduce(u, group=g)
    assert dist.get_backend() == "bytescale", dist.get_backend()
    print(f"rank {dist.get_rank()} sum {t[0].item():.0f} group {u[0].item():.0f}", flush=True)
    dist.destroy_process_group()
    """
)


def test_torchrun_env_init(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(script)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(3):
        assert f"rank {r} sum 6 group 3" in out.stdout, out.stdout


def _one_all_reduce(rank: int, world: int):
    t = torch.ones(2)
    dist.all_reduce(t)
    return t.tolist()


def test_store_init():
    # run_distributed initialises through an explicit FileStore
    assert run_distributed(_one_all_reduce, 2) == [[2.0, 2.0]] * 2


# device_id= must name an accelerator (torch rejects cpu), so the eager-connect path
# (BytescaleBackend::eagerConnectSingleDevice -> NCCL) is covered by tests/test_cuda_backend.py on a GPU.


def _init_with_cuda_device_id(rank, world, store_dir):
    import datetime
    import os

    from dist_utils import capture_error

    import bytescale  # noqa: F401

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    kind, msg, _ = capture_error(lambda: dist.init_process_group(
        "bytescale", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30),
        device_id=torch.device("cuda", 0)))
    return kind, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour (on a GPU: tests/cuda)")
def test_device_id_without_a_gpu_fails_at_init(tmp_path):
    """device_id=cuda on a machine without a GPU fails right at init with an error naming the
    device (torch 2.14 checks the index before any backend is created; bytescale's own eager
    connect, issue 21 finding 2, would raise naming CUDA), never later at the first ring or
    dynamic-group op. That the communicator IS created at init is shown on a GPU only:
    tests/cuda/test_cuda_backend.py::test_device_id_creates_the_communicator."""
    for kind, msg in run_distributed(_init_with_cuda_device_id, 2, str(tmp_path), init=False, timeout=120):
        assert kind is not None, "device_id=cuda was accepted without a GPU"
        assert "GPU" in msg or "CUDA" in msg or "cuda:0" in msg, msg
