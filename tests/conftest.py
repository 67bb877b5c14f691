"""Test layout: one folder per subsystem (comm, attention, planner, runtime, data, train, sim, cuda)
and build (setup.py's build command).

Tests that start real processes (``dist_utils.run_distributed``) are marked ``multiprocess``
automatically, so ``pytest -m "not multiprocess"`` runs the fast single-process ones only. Their
worlds are pooled across the whole run (``dist_utils``: processes kept alive, a fresh process group
per test, a broken world never reused).

**CUDA's execution model as a parameter.** Tests marked ``nccl_order`` (every test under
tests/runtime and tests/attention, tests/train/test_train_hf.py, and any test or module that
carries the marker) run twice: as written (``[gloo-order]``) and under CUDA's execution model on
CPU (``[nccl-order]``: ``BYTESCALE_NCCL_ORDER=1`` in the environment their processes start with,
so pooled worlds of that mode are their own, and every backward of the test process itself on a
separate thread, ``bytescale.testing.backward_on_device_thread``). The nccl-order variants run
after all others, so each mode's pooled worlds stay warm. ``--nccl-order=only`` runs just those,
``--nccl-order=off`` none of them.

**The budget.** The terminal summary lists the slowest tests and each directory's total, and
names every test over 60 s whose docstring gives no reason for it (a line starting ``Slow:``).
"""
from __future__ import annotations

import collections
import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # dist_utils for every subfolder

_HERE = os.path.dirname(os.path.abspath(__file__))
# Where the CUDA-order variant runs for every test (the directories the former second pass re-ran).
NCCL_ORDER_PATHS = ("runtime" + os.sep, "attention" + os.sep, os.path.join("train", "test_train_hf.py"))
SLOW_S = 60.0


def pytest_addoption(parser):
    parser.addoption("--nccl-order", choices=("both", "only", "off"), default="both",
                     help="run the CUDA-order ([nccl-order]) variants of nccl_order tests: both "
                          "modes (default), only those, or none")


def pytest_sessionstart(session):
    # The ranks' forkserver (tests/dist_utils.py), with the session's environment, before any test
    # changes it; it imports torch in the background while collection goes on.
    import dist_utils

    dist_utils.start_context()


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: starts several real processes (dist_utils.run_distributed)")
    config.addinivalue_line("markers", "nccl_order: also run under CUDA's execution model on CPU "
                                       "(BYTESCALE_NCCL_ORDER=1, backward on a device thread)")


def _uses_processes(fn) -> bool:
    """True if the test body starts processes (run_distributed, mp.spawn, subprocess)."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "run_distributed" in src or "mp.spawn" in src or "subprocess" in src


def _wants_nccl_order(metafunc) -> bool:
    rel = os.path.relpath(str(metafunc.definition.path), _HERE)
    if rel.startswith(NCCL_ORDER_PATHS):
        return True
    return metafunc.definition.get_closest_marker("nccl_order") is not None


def pytest_generate_tests(metafunc):
    mode = metafunc.config.getoption("--nccl-order")
    if mode == "off" or not _wants_nccl_order(metafunc):
        return
    modes = {"both": [False, True], "only": [True]}[mode]
    ids = ["nccl-order" if m else "gloo-order" for m in modes]
    if "module_execution_model" in metafunc.fixturenames:  # a module-scoped fixture runs the ranks
        metafunc.parametrize("module_execution_model", modes, indirect=True, scope="module", ids=ids)
        return
    metafunc.fixturenames.append("cuda_execution_model")
    metafunc.parametrize("cuda_execution_model", modes, indirect=True,
                         ids=["nccl-order" if m else "gloo-order" for m in modes])


@pytest.fixture(scope="module")
def module_execution_model(request):
    """As :func:`cuda_execution_model`, for a module-scoped fixture that starts the processes (the
    training entry point's runs): a function-scoped variable would be set only after such a
    fixture ran, so its ``[nccl-order]`` variant would silently run in Gloo order."""
    on = bool(getattr(request, "param", False))
    if not on:
        yield False
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BYTESCALE_NCCL_ORDER", "1")
        yield True


@pytest.fixture
def cuda_execution_model(request, monkeypatch):
    """True in a test's ``[nccl-order]`` variant: its processes start with
    ``BYTESCALE_NCCL_ORDER=1`` and this process runs every backward on a separate thread."""
    on = bool(getattr(request, "param", False))
    if not on:
        yield False
        return
    from bytescale.testing import backward_on_device_thread

    monkeypatch.setenv("BYTESCALE_NCCL_ORDER", "1")
    with backward_on_device_thread():
        yield True


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and _uses_processes(fn):
            item.add_marker(pytest.mark.multiprocess)
    # the CUDA-order variants last (stable otherwise): each mode's pooled worlds stay warm
    items.sort(key=lambda it: "[nccl-order" in it.nodeid or "-nccl-order" in it.nodeid)


_durations: dict = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def _has_reason(item) -> bool:
    doc = inspect.getdoc(getattr(item, "function", None)) or ""
    return any(line.strip().startswith("Slow:") for line in doc.splitlines())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _durations:
        return
    tr = terminalreporter
    slowest = sorted(_durations.items(), key=lambda kv: -kv[1])
    n = int(os.environ.get("BYTESCALE_TEST_SLOWEST", "25"))
    tr.write_sep("=", f"slowest {min(n, len(slowest))} tests (setup + call + teardown)")
    for nodeid, d in slowest[:n]:
        tr.write_line(f"{d:8.1f} s  {nodeid}")
    per_dir: dict = collections.defaultdict(float)
    for nodeid, d in _durations.items():
        per_dir[os.path.dirname(nodeid.split("::")[0])] += d
    tr.write_sep("-", "time per directory")
    for d, s in sorted(per_dir.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{s:8.1f} s  {d}")
    tr.write_line(f"{sum(_durations.values()):8.1f} s  all tests")
    items = {it.nodeid: it for it in getattr(tr.config, "_bytescale_items", [])}
    unexplained = [(k, d) for k, d in slowest if d > SLOW_S and k in items and not _has_reason(items[k])]
    if unexplained:
        tr.write_sep("-", f"over {SLOW_S:.0f} s with no 'Slow:' reason in the docstring")
        for nodeid, d in unexplained:
            tr.write_line(f"{d:8.1f} s  {nodeid}")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    session.config._bytescale_items = list(session.items)
    # Tests whose module can start its work ahead (a long subprocess that mostly waits) do so now,
    # unless only collecting; the test itself waits for the result and checks it.
    if not session.config.option.collectonly:
        for module in {id(it.module): it.module for it in session.items if hasattr(it, "module")}.values():
            if hasattr(module, "start_in_background"):
                module.start_in_background()
