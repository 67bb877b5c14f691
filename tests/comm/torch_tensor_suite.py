"""torch's own tensor-parallel and DTensor tests (``DTensorTestBase`` classes) on a chosen backend.

The test files themselves (pytorch ``test/distributed/tensor/**``) are not shipped in the torch
wheel, so this module runs files found elsewhere, and ``test_torch_tensor_suite.py`` runs them twice
(Gloo, then bytescale) and holds bytescale to what Gloo passes. The harness they build on IS shipped
(``torch/testing/_internal/distributed/_tensor/common_dtensor.py``); this module also provides
``BytescaleDTensorTestBase``, that harness pointed at bytescale, for our own CI tests.

How the harness picks its backend: ``DTensorTestBase.backend`` is
``dist.get_default_backend_for_device(self.device_type)`` ("gloo" on CPU) and ``init_pg`` accepts
only a fixed list of backend names before calling ``dist.init_process_group``; ``with_comms`` may
also pass a backend explicitly. ``install("bytescale")`` replaces ``DTensorTestBase.init_pg`` by one
that maps every "gloo" in the requested backend ("gloo", "cpu:gloo,cuda:nccl") to "bytescale" and
initialises the default group from the test's rendezvous file as the original does; every
subgroup the tests create (``DeviceMesh`` dims, ``new_group`` without a backend) then inherits
bytescale from the default group. ``install("gloo")`` leaves the backend alone, so that both runs
go through the same process start and the same test selection. ``DTensorContinuousTestBase``
(one pool of ranks per class, the backend from its ``backend_str()``) is pointed at bytescale by
``backend_str``; its ranks are forked as well.

- processes are forked instead of spawned (``MultiProcessTestCase._spawn_processes``): a forked
  rank inherits the patched harness and the registered backend; a spawned one would re-import a
  pristine ``common_dtensor``;
- ``instantiate_device_type_tests`` keeps ``DTensorTestBase`` classes generic (``device_type`` is
  then the harness's own choice, "cpu" here, and ``@parametrize`` expanded) instead of instantiating them
  per device: recent test
  files pass ``except_for=["cpu"]`` (they test CPU through ``LocalTensor`` classes, which use a
  fake process group and no backend at all), which would leave nothing to run on a CPU machine;
- the ``...WithLocalTensor`` / ``LocalDTensor*`` classes (fake process group, one process) are
  deselected by the test wrapper: they do not touch the backend.

Command lines::

    # one backend, the files and pytest options after "--"
    python tests/comm/torch_tensor_suite.py --backend bytescale -- FILE.py ... --junitxml=out.xml
    # both backends over every test_*.py under DIR: a per-file table and every difference
    python tests/comm/torch_tensor_suite.py --compare DIR [-k PATTERN]
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch.testing._internal import common_device_type, common_utils
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
    DTensorTestBase,
)

BACKENDS = ("gloo", "bytescale")


def _bytescale_backend_string(backend: str) -> str:
    """The backend string with every Gloo part on bytescale: "gloo" -> "bytescale",
    "cpu:gloo,cuda:nccl" -> "cpu:bytescale,cuda:nccl"."""
    if ":" not in backend:
        return "bytescale" if backend == "gloo" else backend
    parts = []
    for part in backend.split(","):
        device, name = part.split(":")
        parts.append(f"{device}:{'bytescale' if name == 'gloo' else name}")
    return ",".join(parts)


def _init_pg_on_bytescale(self, eager_init, backend: Optional[str] = None) -> None:
    """``DTensorTestBase.init_pg`` with the CPU backend on bytescale (CPU only: the harness's GPU
    branch, device binding and eager init, is NCCL's and not reached on this machine)."""
    backend = _bytescale_backend_string(backend or self.backend)
    if "bytescale" not in backend:
        raise RuntimeError(f"torch_tensor_suite: backend {backend!r} has no Gloo part to move to bytescale")
    dist.init_process_group(
        backend=backend,
        world_size=self.world_size,
        rank=self.rank,
        init_method=f"file://{self.file_name}",
    )
    _check_default_group_is_bytescale()


def _check_default_group_is_bytescale() -> None:
    got = dist.get_backend()
    if "bytescale" not in got:
        raise RuntimeError(f"torch_tensor_suite: the default group runs {got!r}, not bytescale")


def _fork_processes(self) -> None:
    self._start_processes(torch.multiprocessing.get_context("fork").Process)


class BytescaleDTensorTestBase(DTensorTestBase):
    """torch's ``DTensorTestBase`` (multi-process, ``@with_comms``, world size 4, the reference
    models of ``common_dtensor``) with every process group on the bytescale backend, ranks forked."""

    @property
    def backend(self) -> str:
        return "bytescale"

    init_pg = _init_pg_on_bytescale
    _spawn_processes = _fork_processes


def _keep_dtensor_classes_generic(original):
    def instantiate(generic_test_class, scope, *args, **kwargs):
        if isinstance(generic_test_class, type) and issubclass(
                generic_test_class, (DTensorTestBase, DTensorContinuousTestBase)):
            # The generic class stays in the module and runs with device_type "cpu"; its
            # @parametrize tests are expanded as the device instantiation would have.
            common_utils.instantiate_parametrized_tests(generic_test_class)
            return None
        return original(generic_test_class, scope, *args, **kwargs)

    return instantiate


def install(backend: str) -> None:
    """Prepare torch's DTensor test harness for a run on ``backend`` ("gloo" or "bytescale").

    Call before the test files are imported."""
    if backend not in BACKENDS:
        raise ValueError(f"torch_tensor_suite: backend must be one of {BACKENDS}, got {backend!r}")
    MultiProcessTestCase._spawn_processes = _fork_processes
    # DTensorContinuousTestBase (one pool of ranks per class) starts its ranks with the default
    # start method after trying to set "spawn"; with "fork" set first, they are forked too.
    torch.multiprocessing.set_start_method("fork", force=True)
    common_device_type.instantiate_device_type_tests = _keep_dtensor_classes_generic(
        common_device_type.instantiate_device_type_tests)
    if backend == "bytescale":
        import bytescale  # noqa: F401  (registers the backend; forked ranks inherit it)

        assert "BYTESCALE" in dist.Backend._plugins, "bytescale did not register its backend"
        DTensorTestBase.init_pg = _init_pg_on_bytescale
        DTensorContinuousTestBase.backend_str = classmethod(lambda cls: "bytescale")
        init_continuous = DTensorContinuousTestBase._init_pg.__func__

        def _init_continuous_checked(cls, rank, world_size, rdvz_file):
            init_continuous(cls, rank, world_size, rdvz_file)
            _check_default_group_is_bytescale()

        DTensorContinuousTestBase._init_pg = classmethod(_init_continuous_checked)


# ---------------------------------------------------------------------------------------------
# Running a directory of test files on both backends and comparing (test_torch_tensor_suite.py)
# ---------------------------------------------------------------------------------------------

DESELECT = "not LocalTensor and not LocalDTensor"  # fake process group, one process: no backend


def test_files(directory: str) -> list[str]:
    """Every ``test_*.py`` under ``directory`` (recursively), sorted."""
    found = []
    for root, _dirs, files in os.walk(directory):
        found += [os.path.join(root, f) for f in files if f.startswith("test_") and f.endswith(".py")]
    return sorted(found)


def run_backend(backend: str, directory: str, xml_path: str, timeout_s: float,
                select: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run every test file under ``directory`` on ``backend`` in a fresh interpreter (the harness
    reads its environment at import), results in JUnit XML at ``xml_path``."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "180")  # per test (torch reads it at import)
    keyword = DESELECT if not select else f"({DESELECT}) and ({select})"
    cmd = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--",
           *test_files(directory), "-q", "--rootdir", directory, "-k", keyword,
           f"--junitxml={xml_path}", "-o", "junit_family=xunit1"]
    return subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def read_results(xml_path: str) -> dict[str, tuple[str, str]]:
    """``{"file::Class::test": (outcome, message)}``, outcome "passed" / "failed" / "skipped"."""
    import xml.etree.ElementTree as ET

    results = {}
    for case in ET.parse(xml_path).iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        key = f"{case.get('file') or module}::{cls}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            results[key] = ("failed", (bad.get("message") or "")[-400:])
        elif skip is not None:
            results[key] = ("skipped", skip.get("message") or "")
        else:
            results[key] = ("passed", "")
    return results


def per_file_counts(results: dict[str, tuple[str, str]]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for key, (outcome, _msg) in results.items():
        row = counts.setdefault(key.split("::")[0], {"passed": 0, "failed": 0, "skipped": 0})
        row[outcome] += 1
    return counts


def counts_table(gloo: dict, bytescale: dict) -> str:
    """A markdown table: per file, passed / failed / skipped on Gloo and on bytescale."""
    g, b = per_file_counts(gloo), per_file_counts(bytescale)
    lines = ["| file | gloo pass / fail / skip | bytescale pass / fail / skip |", "|---|---|---|"]
    for f in sorted(set(g) | set(b)):
        gr = g.get(f, {"passed": 0, "failed": 0, "skipped": 0})
        br = b.get(f, {"passed": 0, "failed": 0, "skipped": 0})
        lines.append(f"| {f} | {gr['passed']} / {gr['failed']} / {gr['skipped']} | "
                     f"{br['passed']} / {br['failed']} / {br['skipped']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--compare":
        # python tests/comm/torch_tensor_suite.py --compare DIR [-k PATTERN]: both backends, a table
        import tempfile

        directory = os.path.abspath(argv[1])
        select = argv[3] if len(argv) >= 4 and argv[2] == "-k" else None
        with tempfile.TemporaryDirectory() as tmp:
            res = {}
            for backend in BACKENDS:
                xml = os.path.join(tmp, f"{backend}.xml")
                proc = run_backend(backend, directory, xml, timeout_s=3600, select=select)
                print(proc.stdout[-3000:])
                res[backend] = read_results(xml)
        print(counts_table(res["gloo"], res["bytescale"]))
        for key in sorted(res["gloo"]):
            g, b = res["gloo"][key][0], res["bytescale"].get(key, ("missing", ""))[0]
            if g != b:
                print(f"{key}: gloo {g}, bytescale {b} {res['bytescale'].get(key, ('', ''))[1][:300]}")
        return 0
    if len(argv) < 2 or argv[0] != "--backend":
        print(__doc__, file=sys.stderr)
        return 2
    import pytest

    install(argv[1])
    rest = argv[2:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    return pytest.main(["-p", "no:cacheprovider", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
