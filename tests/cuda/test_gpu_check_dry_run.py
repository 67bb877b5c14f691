"""scripts/gpu_check.sh --dry-run on CPU: every stage resolves (its paths exist, every test it names
is collected, every script it runs answers --help), the plan fits a GPU machine's budget, and no
stage can run past 8 minutes. Runs in CI so the GPU check cannot rot (it once ran test paths that
had moved, and would have run no CUDA test on the next GPU; it was once one 25-minute command on
machines that give 10 minutes a command)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _plan() -> tuple[list[str], list[str], int]:
    out = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    planned, extra, total = [], [], None
    for line in out.splitlines():
        name, secs = line.split()[0], int(line.split()[1])
        if name == "total":
            total = secs
        elif "extra" in line:
            extra.append(name)
        else:
            planned.append(name)
    return planned, extra, total


def test_gpu_check_plan_fits_the_budget_in_priority_order():
    planned, extra, total = _plan()
    assert planned == ["build", "staged", "tests", "grad", "speed"], planned
    assert total is not None and total <= 12 * 60, total
    # every stage's steps (their timeouts) end within 8 minutes
    text = SCRIPT.read_text()
    for name in planned + extra:
        body = re.search(r"^stage_%s\(\) \{\n(.*?)^\}" % name, text, re.S | re.M)
        assert body, f"no stage_{name}"
        limits = [int(m) for m in re.findall(r"(?:_step|\btimed) \S+ (\d+)\b", body.group(1))]
        if name == "build":  # the environment record is a few seconds
            limits.append(60)
        assert limits and sum(limits) < 8 * 60, (name, limits)


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "dry run: ok" in out, out[-6000:]
    planned, extra, _ = _plan()
    for name in planned + extra:
        assert f"dry run: stage {name} resolves" in out, (name, out[-4000:])
    # the named CUDA tests were really collected (skipped on CPU, but found)
    collected = (tmp_path / "out" / "dry-collect.log").read_text()
    for name in ("test_device_id_creates_the_communicator", "test_checkpoint_recompute_on_the_cuda_device_thread",
                 "test_ring_attention_with_real_kernels_across_processes", "test_cuda_offload_bit_identical",
                 "test_static_groups_and_pipeline_channels_without_device_id"):
        assert name in collected, name


def test_gpu_check_rejects_an_unknown_stage(tmp_path):
    res = subprocess.run(["bash", str(SCRIPT), "--stage", "no-such-stage"], cwd=REPO,
                         env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown stage 'no-such-stage'" in res.stderr


def test_dry_run_checks_fail_naming_the_stage_and_the_step(tmp_path):
    """The dry run's Python checks (scripts/gpu_check_dry.py, one interpreter for all of them): a
    script that fails its ``--help``, a missing module and an option the trainer does not know each
    fail, named with their stage and step; the good ones pass."""
    bad_script = tmp_path / "bad.py"
    bad_script.write_text("import argparse\nraise ImportError('no such kernel library')\n")
    checks = tmp_path / "checks.tsv"
    rows = [("speed", "good", "script", "benchmarks/bench_comm.py"),
            ("speed", "broken", "script", str(bad_script)),
            ("grad", "nomod", "module", "bytescale.no_such_module"),
            ("demo", "args", "train", "--steps", "3", "--no-such-option"),
            ("tests", "fine", "train", "--steps", "3", "--bf16")]
    checks.write_text("".join("\t".join(r) + "\n" for r in rows))
    res = subprocess.run(["python3", str(REPO / "scripts" / "gpu_check_dry.py"), str(checks)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "dry run: good: benchmarks/bench_comm.py --help ok" in out, out
    assert "dry run: fine: bytescale.train options ok" in out, out
    assert "dry run: broken:" in out and "no such kernel library" in out, out
    assert "dry run: nomod: -m bytescale.no_such_module --help failed" in out, out
    assert "dry run: args: bytescale.train options failed" in out and "no-such-option" in out, out
    assert sorted(line.split()[1] for line in out.splitlines() if line.startswith("failed-stage")) == \
        ["demo", "grad", "speed"], out
