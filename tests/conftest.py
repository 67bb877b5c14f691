"""Test layout: one folder per subsystem (comm, attention, planner, runtime, data, train, sim, cuda)
and build (setup.py's build command).

Tests that start real processes (``dist_utils.run_distributed``) are marked ``multiprocess``
automatically, so ``pytest -m "not multiprocess"`` runs the fast single-process ones only.
"""
from __future__ import annotations

import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # dist_utils for every subfolder


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: starts several real processes (dist_utils.run_distributed)")


def _uses_processes(fn) -> bool:
    """True if the test body starts processes (run_distributed, mp.spawn, subprocess)."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "run_distributed" in src or "mp.spawn" in src or "subprocess" in src


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and _uses_processes(fn):
            item.add_marker(pytest.mark.multiprocess)
