"""The offload engine through its copy-engine interface (csrc/offload/copy_engine.h), driven
directly: every tensor (any dtype, permuted layouts) comes back bit-identical with its strides, handles may be fetched in any order
and out of order with prefetches, discards return their buffers, and a device type with no copy
engine is a clear error. The CPU engine runs here; the CUDA engine (csrc/cuda/offload/) is
registered only in a CUDA build and runs in tests/test_offload.py on a GPU."""
from __future__ import annotations

import pytest
import torch

from bytescale import _C


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_round_trip_is_bit_identical_in_any_order(dtype):
    eng = _C.offload.Engine(0)
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(37, 3, 5, generator=g) * 100).to(dtype)
    tensors = [src, src[:, 1].clone(), src.permute(2, 0, 1), src.transpose(0, 1), src[:1].clone()]
    handles = [eng.offload(t) for t in tensors]  # permuted (dense, non-contiguous) layouts too
    assert eng.pending == len(tensors)
    for h in handles[::2]:
        eng.prefetch(h)
    for t, h in reversed(list(zip(tensors, handles))):
        y = eng.fetch(h)
        assert torch.equal(y, t) and y.stride() == t.stride()
    assert eng.pending == 0 and eng.pool_in_use_bytes == 0
    assert eng.pool_reserved_bytes > 0


def test_discard_returns_buffers_and_unknown_handles_raise():
    eng = _C.offload.Engine(0)
    a, b = eng.offload(torch.ones(100, 8)), eng.offload(torch.ones(100, 8))
    eng.prefetch(b)
    eng.discard(a)
    eng.discard(b)
    eng.discard(b)  # discarding twice is a no-op
    assert eng.pending == 0 and eng.pool_in_use_bytes == 0
    with pytest.raises(RuntimeError, match="unknown handle"):
        eng.fetch(a)


def test_device_without_copy_engine_is_a_clear_error():
    eng = _C.offload.Engine(0)
    with pytest.raises(RuntimeError, match="no copy engine for meta tensors"):
        eng.offload(torch.empty(4, 4, device="meta"))
    assert eng.pending == 0 and eng.pool_in_use_bytes == 0


_ENGINE_CHURN = """
import torch
from bytescale import _C
for _ in range(20000):
    eng = _C.offload.Engine(0)
    y = eng.fetch(eng.offload(torch.ones(64)))
    del y    # Python lets go of the restored tensor first ...
    del eng  # ... then destroys the engine (joining its worker) with the GIL held
print("ok")
"""


def test_engine_teardown_never_waits_for_a_worker_that_needs_the_gil():
    # The worker used to free the restored tensor's TensorImpl, whose Python object then needed
    # the GIL: the engine's destructor, joining the worker while holding the GIL, hung (every run
    # of this loop did before the fix). The worker now only ever holds Python-free shallow copies.
    import os
    import subprocess
    import sys

    import bytescale

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(bytescale.__file__))))
    try:
        out = subprocess.run([sys.executable, "-c", _ENGINE_CHURN], env=env, capture_output=True,
                             text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("creating, using and dropping offload engines hung (a worker waiting for the GIL)")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
