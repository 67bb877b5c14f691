"""Multi-process test harness: real processes, real torch.distributed, a hard timeout, worlds kept alive.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size``
processes, each with the default process group initialised (``bytescale`` unless told otherwise)
over a fresh FileStore, and returns the list of per-rank return values (anything torch.save can
write). If any rank raises, the world is killed and the error (with the rank's traceback) is raised
in the test as ``torch.multiprocessing.ProcessRaisedException``. If the job outlives ``timeout``
seconds, every process is killed and the test fails with a TimeoutError: a hang never hangs the
suite.

**Pooled worlds.** Spawning a process that imports torch and bytescale costs seconds; most test
bodies run in one. So the processes of a world stay alive across tests (as torch's
``MultiProcContinuousTest`` does): a world is keyed by its size, backend, ``init`` flag and the
caller's environment (a test that sets ``BYTESCALE_*`` knobs gets a world started with them, as
the knobs are read once per process). Each call sends the body to the live processes, which create
a new default process group for it over a new store, run it, destroy the group and restore what a
body can change in the process (environment, default dtype, grad mode, the default RNG seed,
thread count, deterministic and anomaly modes). A world whose body raised, timed out, lost a
process, left the group or a Python thread behind, or could not be restored is killed and never
used again, so a broken world in one test never fails another: the next call gets a new one.

``fresh=True`` (for a body that must own its process from the start: one that initialises the
group itself, changes process-wide state it cannot undo, or kills its own rank on purpose) or
``BYTESCALE_TEST_POOL=0`` (every call) gives new processes that end with the call.
``BYTESCALE_TEST_POOL_PROCS`` bounds the processes kept alive (default 12; the least recently used
world goes first).

**Forked from a server with torch loaded.** Importing torch costs about 2 s of CPU per process on
the 2-core test machine. Worlds (pooled or fresh) are started by a multiprocessing *forkserver*
that imports torch once (:data:`PRELOAD`) and forks every rank from that clean, single-threaded
state; each rank then takes the caller's environment and imports bytescale itself, so knobs read
at import or first use see the test's values. ``BYTESCALE_TEST_START=spawn`` starts every rank as a
new interpreter instead. :func:`forked` runs any function in such a process (the training entry
point's tests run ``bytescale.train``'s ``main`` in worlds of them).
"""
from __future__ import annotations

import atexit
import collections
import datetime
import gc
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0

# Imported once by the forkserver, inherited by every rank it forks. Not bytescale: its knobs are
# read from the environment a rank is given.
# transformers and the HF model classes the tests use: about 2.5 s of CPU per rank that runs an HF model.
# (Imported with OMP_NUM_THREADS=1, none of these starts a thread: the server stays single-threaded.)
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor", "numpy", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.mixtral.modeling_mixtral"]

_VOLATILE_ENV_PREFIXES = ("PYTEST_",)  # changes per test, read by nothing under test


# ----------------------------------------------------------------------------------------------
# The worker: one rank of a world, serving test bodies until told to stop or its parent is gone.

def _process_state() -> tuple:
    """What a body may change in a process and the worker must find restored afterwards."""
    return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(),
            threading.active_count())


def _dtensor_cached() -> bool:
    """Whether this thread's DTensor caches hold entries (a body that used DTensor / DeviceMesh)."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _redistribute

        prop = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_info().currsize
        return bool(prop or _redistribute._gen_transform_infos.cache_info().currsize)
    except (ImportError, AttributeError):
        return False


def _clear_dtensor_caches() -> None:
    """DTensor's sharding propagation and redistribution plans are cached by spec, and a spec's
    DeviceMesh compares equal to the next test's mesh of the same shape and names: a cached result
    would carry the destroyed world's mesh, whose group names no longer resolve ("Could not resolve
    the process group registered under the name 3"). A new process has empty caches; so does a
    served rank after this."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _redistribute

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        _redistribute._gen_transform_infos.cache_clear()
    except (ImportError, AttributeError):  # another torch: nothing cached by these names
        pass


def _restore(env0: Dict[str, str], seed0: int, dtype0: torch.dtype) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_dtensor_caches()
    os.environ.clear()
    os.environ.update(env0)
    torch.set_default_dtype(dtype0)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)
    torch.manual_seed(seed0)  # as a new process: torch's default generator starts at a fixed seed
    gc.collect()


class _Fd:
    """A file descriptor of the caller's, duplicated into the started rank (``int`` there)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


def _serve(rank: int, world_size: int, backend: str, conn, one_shot: bool, env: Dict[str, str],
           out: int, err: int) -> None:
    # A forked rank starts with the forkserver's environment and output: take the caller's (as a
    # spawned one would), so that its output lands in the test's captured output.
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import bytescale  # noqa: F401  (registers the backend)

    seed0, dtype0, env0 = torch.initial_seed(), torch.get_default_dtype(), dict(os.environ)
    state0 = _process_state()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        payload, sys_path, tmpdir, pg_timeout_s, init = task
        sys.path[:] = sys_path  # the parent's, as a spawned process gets it: the body's module imports
        try:
            fn, args = pickle.loads(payload)
            if init:
                store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=pg_timeout_s))
            result = fn(rank, world_size, *args)
            torch.save(result, os.path.join(tmpdir, f"result_{rank}.pt"))
        except BaseException:  # noqa: BLE001 - reported to the parent, which kills the world
            # Reported before any teardown: the parent ends the world at once (a peer blocked in
            # a collective this rank left would otherwise hold destroy_process_group).
            conn.send(("error", traceback.format_exc()))
            return
        if one_shot:
            # A world used once ends as before pooling: the group destroyed, the process gone.
            if dist.is_initialized():
                dist.destroy_process_group()
            conn.send(("ok", ""))
            return
        try:
            left = "a default process group" if (not init and dist.is_initialized()) else ""
            # DTensor caches its plans by spec, and a spec's mesh equals the next body's mesh of
            # the same shape: entries would carry this world's destroyed groups (clearing this
            # thread's caches is not enough: other threads keep their own), so such a world retires
            if not left and _dtensor_cached():
                left = "DTensor caches of this world's meshes"
            _restore(env0, seed0, dtype0)
            if not left and _process_state() != state0:
                left = f"process state {_process_state()} (was {state0})"
        except BaseException:  # noqa: BLE001
            left = "a failed reset: " + traceback.format_exc()
        # "ok" + what the body left behind: the parent then retires this world after the call.
        conn.send(("ok", left))
        if left:
            return


# ----------------------------------------------------------------------------------------------
# The parent side: worlds, the pool, and run_distributed.

class _World:
    """``world_size`` live worker processes and the parent's end of a pipe to each."""

    def __init__(self, world_size: int, backend: str, one_shot: bool):
        ctx = start_context()
        self.world_size = world_size
        self.conns: List[Any] = []
        self.procs: List[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_serve, args=(rank, world_size, backend, child, one_shot, dict(os.environ),
                                                 _Fd(1), _Fd(2)),
                            name=f"bytescale-test-rank{rank}", daemon=False)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.usable = True
        self.why = ""
        _log(f"world of {world_size} started")

    def kill(self) -> None:
        self.usable = False
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()

    def stop(self) -> None:
        """Ask the workers to exit; kill those that do not within a few seconds."""
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def run(self, fn: Callable[..., Any], args: tuple, tmpdir: str, timeout: float,
            pg_timeout: float, init: bool) -> None:
        """Run one body on every rank; raise as the unpooled harness did. Leaves ``usable``
        False when this world must not serve another call."""
        name = getattr(fn, "__name__", fn)
        payload = pickle.dumps((fn, args))
        for c in self.conns:
            c.send((payload, list(sys.path), tmpdir, pg_timeout, init))
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.why = "timed out"
                self.kill()
                raise TimeoutError(f"distributed job {name} (world size {self.world_size}) "
                                   f"did not finish within {timeout:.0f} s")
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            connection.wait(waitables, timeout=min(remaining, 1.0))
            for r in sorted(pending):
                msg = None
                if self.conns[r].poll():
                    try:
                        msg = self.conns[r].recv()
                    except (EOFError, OSError):
                        msg = None
                if msg is not None:
                    kind, text = msg
                    if kind == "error":
                        # the root cause first: a rank that died (a survivor's backend error
                        # names the lost connection; the forkserver reports the exit a bit later)
                        self._raise_if_one_died(pending - {r}, 3.0 if "DistBackendError" in text else 0.2)
                        self.why = f"rank {r} raised"
                        self.kill()
                        raise mp.ProcessRaisedException(
                            f"\n\n-- Process {r} terminated with the following error:\n{text}",
                            r, self.procs[r].pid)
                    pending.discard(r)
                    if text:  # the body left state behind: retire the world after this call
                        self.usable, self.why = False, f"rank {r} left {text}"
                elif not self.procs[r].is_alive():
                    self.procs[r].join(1)
                    code = self.procs[r].exitcode
                    pending.discard(r)
                    self.usable, self.why = False, f"rank {r} exited ({code})"
                    if code != 0:
                        self.why = f"rank {r} exited with code {code}"
                        self.kill()
                        raise mp.ProcessExitedException(
                            f"process {r} terminated with exit code {code}", r, self.procs[r].pid,
                            code)
                    # exit code 0 without a reply: the rank ended itself (os._exit(0)); no result

    def _sent_a_reply(self, q: int) -> bool:
        """Whether rank ``q`` sent a message before it ended (a dead rank's closed pipe reads as
        ready too: EOF is not a reply)."""
        try:
            return self.conns[q].poll() and self.conns[q].recv() is not None
        except (EOFError, OSError):
            return False

    def _raise_if_one_died(self, others, grace: float) -> None:
        """A survivor's error often reports a peer that died (its collective lost the peer): give
        a dead rank's exit ``grace`` seconds to show and report it first, so that the error names
        the cause whatever the scheduling of the processes."""
        deadline = time.monotonic() + grace
        while True:
            for q in sorted(others):
                if not self.procs[q].is_alive():
                    self.procs[q].join(1)
                    code = self.procs[q].exitcode
                    if code not in (0, None) and not self._sent_a_reply(q):
                        self.why = f"rank {q} exited with code {code}"
                        self.kill()
                        raise mp.ProcessExitedException(f"process {q} terminated with exit code {code}", q,
                                                        self.procs[q].pid, code)
            alive = [self.procs[q].sentinel for q in others if self.procs[q].is_alive()]
            if not alive or time.monotonic() > deadline:
                return
            connection.wait(alive, timeout=0.05)


_ctx = None


def start_context():
    """The multiprocessing context ranks start from: the forkserver with :data:`PRELOAD` imported
    (``BYTESCALE_TEST_START=spawn``: new interpreters)."""
    global _ctx
    if _ctx is None:
        if os.environ.get("BYTESCALE_TEST_START", "forkserver") == "spawn":
            _ctx = mp.get_context("spawn")
        else:
            _ctx = mp.get_context("forkserver")
            _ctx.set_forkserver_preload(PRELOAD)
            # Started now, with this process' environment: ranks that do not set their own
            # (torch's harness) get it, not that of whichever test happened to start the server.
            from multiprocessing import forkserver

            unset = "OMP_NUM_THREADS" not in os.environ
            if unset:  # no OpenMP pool in the server: a fork copies only the forking thread
                os.environ["OMP_NUM_THREADS"] = "1"
            try:
                forkserver.ensure_running()
            finally:
                if unset:
                    del os.environ["OMP_NUM_THREADS"]
    return _ctx


_pool: "collections.OrderedDict[tuple, _World]" = collections.OrderedDict()
_pool_lock = threading.Lock()


def _pool_limit() -> int:
    return int(os.environ.get("BYTESCALE_TEST_POOL_PROCS", "12"))


def _pooling() -> bool:
    return os.environ.get("BYTESCALE_TEST_POOL", "1") != "0"


def _env_key() -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if not k.startswith(_VOLATILE_ENV_PREFIXES)))


def _take_world(key: tuple, world_size: int, backend: str) -> _World:
    with _pool_lock:
        world = _pool.pop(key, None)
        if world is not None and world.usable and all(p.is_alive() for p in world.procs):
            return world
        if world is not None:
            world.kill()
        # make room: the least recently used worlds go first
        while _pool and sum(w.world_size for w in _pool.values()) + world_size > _pool_limit():
            _pool.popitem(last=False)[1].stop()
    return _World(world_size, backend, one_shot=False)


def _log(text: str) -> None:
    path = os.environ.get("BYTESCALE_TEST_POOL_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {os.environ.get('PYTEST_CURRENT_TEST', '?')}: {text}\n")


def _give_back(key: tuple, world: _World) -> None:
    if not world.usable:
        _log(f"world of {world.world_size} retired: {world.why}")
    with _pool_lock:
        if world.usable and world.world_size <= _pool_limit():
            _pool[key] = world
        else:
            world.stop()


def shutdown_pool() -> None:
    """End every pooled world (registered at exit; tests may call it too)."""
    with _pool_lock:
        while _pool:
            _pool.popitem(last=False)[1].stop()


atexit.register(shutdown_pool)


def pooled_worlds() -> List[Tuple[int, List[int]]]:
    """(world size, worker pids) of each live pooled world, least recently used first."""
    with _pool_lock:
        return [(w.world_size, [p.pid for p in w.procs]) for w in _pool.values()]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "bytescale",
    timeout: float = DEFAULT_TIMEOUT_S,
    pg_timeout: float = 60.0,
    init: bool = True,
    fresh: Optional[bool] = None,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on a world of ``world_size`` processes (pooled unless
    ``fresh``; a body that initialises the group itself, ``init=False``, gets a fresh world by
    default); see the module doc."""
    if fresh is None:
        fresh = not init
    pooled = _pooling() and not fresh
    key = (world_size, backend, init, _env_key())
    with tempfile.TemporaryDirectory(prefix="bytescale-test-") as tmpdir:
        world = _take_world(key, world_size, backend) if pooled else _World(world_size, backend, one_shot=True)
        try:
            world.run(fn, args, tmpdir, timeout, pg_timeout, init)
        finally:
            if pooled:
                _give_back(key, world)
            else:
                world.stop()
        results = []
        for r in range(world_size):
            path = os.path.join(tmpdir, f"result_{r}.pt")
            # A rank that deliberately exited early (os._exit(0)) leaves no result: None.
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return results


def capture_error(fn: Callable[[], Any]):
    """Run ``fn``; return (exception type name or None, message, seconds taken)."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result under test
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "no error", time.monotonic() - t0


def train_on_whole_documents(ds, loader, model, opt) -> tuple:
    """The single-process reference of the multi-process training tests: every step of ``loader``
    trained on its whole documents (no sharding, no rings) with ``model`` (a bytescale Llama, its
    MoE balance loss included) and ``opt``. Returns the per-step losses and the steps' sample ids."""
    import torch

    from bytescale.attention import Layout
    from bytescale.data import IGNORE_INDEX
    from bytescale.runtime import token_level_loss

    losses, batches = [], []
    for step in loader:
        ids = list(step.sample_ids)
        docs = [ds.tokens(i, 0, ds.length(i)) for i in ids]
        labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
        pos = torch.cat([torch.arange(len(d)) for d in docs])
        logits, aux = model(torch.cat(docs), pos, layout=Layout.local([len(d) for d in docs]),
                            global_tokens=step.global_tokens, return_aux=True)
        loss = token_level_loss(logits, labels, step.global_loss_tokens)
        (loss + aux).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        batches.append(ids)
    return losses, batches
