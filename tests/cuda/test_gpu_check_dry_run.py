"""scripts/gpu_check.sh --dry-run on CPU: every path the GPU check uses resolves, every test it
names is collected, every script it runs answers --help. Runs in CI so the GPU check cannot rot
(it once ran test paths that had moved, and would have run no CUDA test on the next GPU)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "dry run: ok" in out, out[-6000:]
    # the named CUDA tests were really collected (skipped on CPU, but found)
    collected = (tmp_path / "out" / "dry-collect.log").read_text()
    for name in ("test_device_id_creates_the_communicator", "test_checkpoint_recompute_on_the_cuda_device_thread",
                 "test_ring_attention_with_real_kernels_across_processes", "test_cuda_offload_bit_identical"):
        assert name in collected, name


def test_gpu_check_rejects_an_unknown_stage(tmp_path):
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "no-such-stage"], cwd=REPO,
                         env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown stage 'no-such-stage'" in res.stderr
