"""init_process_group("bytescale") under torchrun (env://) and with an explicit Store."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
