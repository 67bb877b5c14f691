"""torch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py) with
every process group on the ``bytescale`` backend, CPU, world size 3.

Not collected by pytest on its own (no ``test_`` prefix): ``test_torch_distributed_suite.py`` runs
it in a fresh interpreter (the suite reads its environment at import) and checks the results.
Run it by hand with ``python -m pytest tests/comm/torch_dist_suite.py -k <pattern>``.

How the suite picks its backend: the module reads ``BACKEND`` (and ``WORLD_SIZE``, ``TEMP_DIR``,
``INIT_METHOD``) from the environment at import, and its decorators decide at import which tests
apply to that backend. We import it with ``BACKEND=gloo`` so that bytescale is held to exactly the
tests Gloo (torch's CPU backend) runs, then point the module's ``BACKEND`` at ``bytescale`` so that
every ``init_process_group`` (and every ``new_group`` that names no backend) creates bytescale
groups; ``bytescale`` is added wherever the suite's feature tables list ``gloo``. Tests that ask
for Gloo by name (``new_group(backend="gloo")``) still get a Gloo group beside it.

Each test forks 3 processes (fork, not spawn: the processes inherit the imported torch and the
registered backend, which saves seconds per test on a small machine).
"""
from __future__ import annotations

import os

os.environ["BACKEND"] = "gloo"  # the suite's decorators: bytescale runs what Gloo runs
os.environ.setdefault("WORLD_SIZE", "3")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import bytescale  # noqa: E402,F401  (registers the "bytescale" backend in this and every forked process)

for _features in DistTestCases.backend_feature.values():
    if "gloo" in _features:
        _features.add("bytescale")

from torch.testing._internal.distributed import distributed_test as _dt  # noqa: E402



class _BytescaleHeldToGloo(str):
    """The module's runtime ``BACKEND``: the string "bytescale" (what ``init_process_group`` and
    ``new_group`` receive, what ``dist.get_backend`` is compared with) that also compares equal to
    "gloo", so the test bodies' ``if BACKEND == "gloo"`` CPU branches (DDP on CPU modules, ...) run
    for bytescale as they do for Gloo instead of leaving their variables unset."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


_dt.BACKEND = _BytescaleHeldToGloo("bytescale")
assert "BYTESCALE" in dist.Backend._plugins, "bytescale did not register its backend"


class TestBytescaleBackend(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    """Every test of torch's _DistTestBase, on 3 forked processes running the bytescale backend."""

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
