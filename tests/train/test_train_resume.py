"""Checkpoints that resume on another world size, through the real entry point
(``torchrun -m bytescale.train --data STORE``, a token store of the installed Python packages),
against the uninterrupted run.

One uninterrupted run A (4 ranks) saves every 2 steps. Then, with and without FSDP2:
  B: 3 ranks continue from A's step-2 checkpoint (4 -> 3; with FSDP2 the checkpoint of a
     replicated model is re-sharded) and save at steps 4 and 6;
  D: a crash is simulated in a copy of B's directory (step 6 gone, a half-written directory
     left), and 4 ranks continue with ``--resume`` (3 -> 4): the newest complete checkpoint is
     step 4, the half one is ignored and removed, the samples log is rewritten from step 4.
Every resumed step sees the same global batch as A (--samples-log) and the same loss (float32,
different reduction orders: 1e-5 relative). The documents are split at the default length
(capacity x 4 ranks); at 3 ranks the capacity is raised so they still fit. Then corrupt and mismatched checkpoints fail clearly
and leave the directory untouched.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from train_launch import REPO, _env, jsonl, launch, ok

pytestmark = pytest.mark.multiprocess

STEPS = 6
COMMON = ["--length-scale", "0.02", "--capacity", "128", "--tokens-per-batch", "1536", "--steps", STEPS,
          "--warmup-steps", "2", "--lr", "3e-3", "--progress=false", "--keep", "0"]


def _run(d: Path, name: str, nproc: int, *extra, torchrun: bool = False) -> dict:
    res = ok(launch(nproc, ["--data", d / "store"] + COMMON + ["--metrics", d / f"{name}.jsonl",
                                                               "--samples-log", d / f"{name}.samples.jsonl", *extra],
                    torchrun=torchrun))
    return {"metrics": jsonl(d / f"{name}.jsonl"), "samples": jsonl(d / f"{name}.samples.jsonl"), "out": res.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from bytescale.data.prepare import prepare

    d = tmp_path_factory.mktemp("resume")
    prepare([], str(d / "store"), python_packages=True, max_packages=30, max_doc_bytes=40000, progress=False,
            plot=False)
    out = {"dir": d, "A": _run(d, "A", 4, "--checkpoint-dir", d / "ckA", "--save-every", "2", torchrun=True)}
    for tag, fsdp in (("", []), ("_fsdp", ["--fsdp"])):
        out["B" + tag] = _run(d, "B" + tag, 3, "--checkpoint-dir", d / f"ckB{tag}", "--save-every", "2",
                              "--resume-from", d / "ckA" / "step-00000002", *fsdp)
        # a crash after step 4: step 6 never completed, a half-written directory is left behind
        ckd = d / f"ckD{tag}"
        shutil.copytree(d / f"ckB{tag}", ckd)
        shutil.rmtree(ckd / "step-00000006")
        half = ckd / "step-00000006.tmp-deadbeef-1"
        half.mkdir()
        (half / "__0_0.distcp").write_bytes(b"half")
        # the crashed run's samples log ran up to step 5; the resumed run rewrites steps >= 4
        shutil.copy(d / "A.samples.jsonl", d / f"D{tag}.samples.jsonl")
        out["D" + tag] = _run(d, "D" + tag, 4, "--checkpoint-dir", ckd, "--resume", *fsdp)
        out["half_removed" + tag] = not half.exists()
    return out


def _compare(ref: dict, got: dict, first: int) -> None:
    steps = [r["step"] for r in got["metrics"]]
    assert steps == list(range(first, STEPS)), steps
    for r in got["metrics"]:
        a = ref["metrics"][r["step"]]
        assert math.isclose(r["loss"], a["loss"], rel_tol=1e-5), (r["step"], r["loss"], a["loss"])
        assert math.isclose(r["grad_norm"], a["grad_norm"], rel_tol=1e-4), (r["step"], r["grad_norm"], a["grad_norm"])
        assert math.isclose(r["lr"], a["lr"], rel_tol=1e-12)


@pytest.mark.parametrize("tag", ["", "_fsdp"])
def test_4_to_3_ranks_continues_on_the_same_batches_and_losses(runs, tag):
    """Slow: the module's fixture launches the real entry point several times (an uninterrupted
    run, then resumes on other world sizes) under torchrun."""
    a, b = runs["A"], runs["B" + tag]
    _compare(a, b, 2)
    assert b["samples"] == a["samples"][2:]
    # the run really was re-planned: 3 ranks, rings in the plans (A's too)
    assert all(len(r["micro_batches"]) == 3 for r in b["metrics"])
    assert "hdp.capacity raised from 128 to 171" in b["out"]  # 512-token documents on 3 ranks
    assert any(r["ring_sizes"] for r in b["metrics"]) and any(r["ring_sizes"] for r in a["metrics"])


@pytest.mark.parametrize("tag", ["", "_fsdp"])
def test_3_to_4_ranks_with_resume_after_a_crash(runs, tag):
    a, dd = runs["A"], runs["D" + tag]
    _compare(a, dd, 4)
    # the samples log of the crashed run + the resumed one equals the uninterrupted run's
    assert dd["samples"] == a["samples"]
    assert runs["half_removed" + tag], "the half-written checkpoint directory was not cleaned up"
    ck = runs["dir"] / f"ckD{tag}"  # B saved steps 4 and 6; D's step 6 replaces the lost one
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000004", "step-00000006"]


def test_uninterrupted_run_falls_and_writes_its_outputs(runs):
    d = runs["dir"]
    m = runs["A"]["metrics"]
    assert [r["step"] for r in m] == list(range(STEPS))
    assert m[-1]["loss"] < m[0]["loss"]
    for r in m:
        assert r["tokens"] <= 1536 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["data_wait_s"] >= 0
        # the balanced strategy names the plan it returns: its own, or pow2's when that replays shorter
        assert r["plan"].startswith(("plan[balanced]", "plan[pow2]")), r["plan"]
    assert (d / "A.png").stat().st_size > 1000
    assert sorted(p.name for p in (d / "ckA").iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    man = json.loads((d / "ckA" / "step-00000004" / "bytescale_checkpoint.json").read_text())
    assert man["step"] == 4 and man["world_size"] == 4
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return
    assert list((d / "A_tb").glob("events.out.tfevents.*")), "no TensorBoard event file"


# -- bad checkpoints: a clear error, nothing written ------------------------------------------------

_BAD = r"""
import sys, json
from bytescale.train.__main__ import main
print(json.dumps([main(a) for a in json.loads(sys.argv[1])]))
"""


def _snapshot(d: Path):
    return sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*"))


def test_corrupt_or_mismatched_checkpoint_fails_clearly_and_writes_nothing(runs, tmp_path):
    src = runs["dir"] / "ckA" / "step-00000004"
    cases = {}
    for name in ("missing", "truncated", "model", "manifest"):
        ck = tmp_path / name
        shutil.copytree(src.parent, ck)
        cases[name] = ck
    (cases["missing"] / "step-00000006" / "__1_0.distcp").unlink()
    f = cases["truncated"] / "step-00000006" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:100])
    (cases["manifest"] / "step-00000006" / "bytescale_checkpoint.json").write_text("{not json")
    common = ["--data", str(runs["dir"] / "store")] + [str(x) for x in COMMON]
    argv = [common + ["--checkpoint-dir", str(cases["missing"]), "--resume"],
            common + ["--checkpoint-dir", str(cases["truncated"]), "--resume"],
            common + ["--checkpoint-dir", str(cases["model"]), "--resume", "--model", "small"],
            common + ["--checkpoint-dir", str(cases["manifest"]), "--resume"],
            common + ["--checkpoint-dir", str(cases["model"])]]  # not resuming into a used directory
    before = {k: _snapshot(v) for k, v in cases.items()}
    res = subprocess.run([sys.executable, "-c", _BAD, json.dumps(argv)], capture_output=True, text=True,
                         env=_env(), cwd=str(REPO), timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [2] * len(argv), res.stderr[-4000:]
    errs = [line for line in res.stderr.splitlines() if line.startswith("bytescale.train: error:")]
    assert len(errs) == len(argv), res.stderr[-4000:]
    assert "incomplete: data file __1_0.distcp is missing" in errs[0]
    assert "corrupt: data file __0_0.distcp" in errs[1]
    assert "saved from another model" in errs[2] and "dim: 64 there, 128 here" in errs[2]
    assert "unreadable bytescale_checkpoint.json" in errs[3] or "no bytescale_checkpoint.json" in errs[3]
    assert "already holds checkpoints" in errs[4] and "--resume" in errs[4]
    for k, v in cases.items():
        assert _snapshot(v) == before[k], f"{k}: the checkpoint directory changed"
