"""CUDA's execution model on CPU, for tests (issue: the GPU path proven before a GPU).

Two things make a CUDA run differ from the CPU runs every test does, and both hide defects:

* NCCL runs every operation of a communicator (world collectives, dynamic-group collectives,
  point-to-point exchanges) in issue order on one CUDA stream, each blocking the stream until all
  ranks it involves joined, while Gloo runs each on threads of its own. ``BYTESCALE_NCCL_ORDER=1``
  (read once per process, ``csrc/common/env.h``) makes the CPU transport run them on ONE in-order
  queue per rank (``csrc/comm/gloo_transport.h``): a cycle between two ranks' streams deadlocks
  on CPU too, and surfaces as the transport's timeout error naming what the queue is stuck behind.
* CUDA autograd runs ``backward`` on a device thread while the caller waits, so grad hooks and
  activation-checkpoint recomputation run there, not on the caller's thread.
  :func:`backward_on_device_thread` does the same on CPU (except under tracing: the engine hands
  the caller's dispatcher state, such as torch.compile's dispatch modes, to its device thread, and
  a Python thread cannot receive it, so such a backward stays on the caller's thread); with ``BYTESCALE_NCCL_ORDER=1``
  ``import bytescale`` turns it on for the whole process (:func:`install_from_env`).

``BYTESCALE_NCCL_ORDER=1 python -m pytest ...`` runs tests under both (scripts/run_tests.sh runs
the multi-process runtime, attention and HF-training tests so).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

from . import _C

__all__ = ["nccl_order", "backward_on_device_thread", "backward_thread_enabled", "install_from_env"]

_state = threading.local()  # .on_device_thread: this thread is a backward thread
_lock = threading.Lock()
_installed = 0  # nesting depth of backward_on_device_thread
_originals: dict = {}


def nccl_order() -> bool:
    """True when this process runs the CPU transport in NCCL order (``BYTESCALE_NCCL_ORDER=1``)."""
    return bool(_C.comm.nccl_order())


def backward_thread_enabled() -> bool:
    """True while every backward runs on a separate thread (see :func:`backward_on_device_thread`)."""
    return _installed > 0


def _dispatch_tls() -> tuple[str, str]:
    return (repr(torch._C._dispatch_tls_local_include_set()),
            repr(torch._C._dispatch_tls_local_exclude_set()))


_fresh_thread_tls: list = []  # the dispatcher's thread-local key sets of a fresh thread, read once


def _caller_has_dispatch_state() -> bool:
    """True when the caller's thread carries dispatcher state that CUDA's autograd engine hands to
    its device thread (at::ThreadLocalState: Python dispatch modes, functorch transforms, include
    and exclude key sets such as autocast's) but a fresh Python thread cannot receive: tracing
    (torch.compile's AOT autograd, opcheck, make_fx) runs backward under such state."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if _get_current_dispatch_mode_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    if not _fresh_thread_tls:
        t = threading.Thread(target=lambda: _fresh_thread_tls.append(_dispatch_tls()))
        t.start()
        t.join()
    return _dispatch_tls() != _fresh_thread_tls[0]


def _on_device_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "on_device_thread", False):  # reentrant backward: stays on this thread
            return fn(*args, **kwargs)
        if _caller_has_dispatch_state():
            # CUDA's engine carries this state to its device thread; a Python thread cannot, so
            # the backward stays here rather than running without the caller's modes.
            return fn(*args, **kwargs)
        result: list = []
        error: list = []

        def target() -> None:
            _state.on_device_thread = True
            try:
                result.append(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                error.append(e)

        t = threading.Thread(target=target, name="bytescale-autograd-device-thread")
        t.start()
        t.join()
        if error:
            raise error[0]
        return result[0]

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def backward_on_device_thread() -> Iterator[None]:
    """Inside the block, ``loss.backward()``, ``torch.autograd.backward`` and
    ``torch.autograd.grad`` run the autograd engine on a fresh thread while the caller waits, as
    CUDA autograd runs backward on its device thread: grad hooks and activation-checkpoint
    recomputation see that thread's state, not the caller's (Python thread-locals included)."""
    global _installed
    with _lock:
        if _installed == 0:
            _originals["backward"] = torch.autograd.backward
            _originals["grad"] = torch.autograd.grad
            torch.autograd.backward = _on_device_thread(_originals["backward"])
            torch.autograd.grad = _on_device_thread(_originals["grad"])
        _installed += 1
    try:
        yield
    finally:
        with _lock:
            _installed -= 1
            if _installed == 0:
                torch.autograd.backward = _originals.pop("backward")
                torch.autograd.grad = _originals.pop("grad")


_env_block = None


def install_from_env() -> None:
    """With ``BYTESCALE_NCCL_ORDER=1``: every backward of the process on a separate thread
    (called by ``import bytescale``; idempotent)."""
    global _env_block
    try:
        on = nccl_order()
    except ValueError:
        # A malformed BYTESCALE_* knob: importing must still work; the error (naming the knob and
        # its value) is raised where bytescale first uses the knobs.
        return
    if on and _env_block is None:
        _env_block = backward_on_device_thread()
        _env_block.__enter__()
