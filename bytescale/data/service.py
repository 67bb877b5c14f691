"""The data service: source workers own the data, publish metadata, serve each rank its token ranges.

::

    spec = MixingSpec.load("mix.toml")                    # or a dict, or a path
    with DataService(spec, tokens_per_batch=65536, seed=0, workers=2) as svc:   # engine="local"
        src = svc.client()                               # a BatchSource (or connect(svc.address)
        batch = src.next_batch()                         #  in another process, e.g. each rank)
        ids = src.tokens(batch.sample_ids[0], 0, 128)

Engines (same API, same batches):

* ``"local"`` (default): a coordinator process and source worker processes on this machine,
  tokens through shared memory (tmpfs chunk files, or the mapped token store);
  :mod:`bytescale.data.local_engine`.
* ``"ray"``: Ray actors as coordinator and source workers, on any node of a Ray cluster
  (``ray.init`` must have been called, or ``ray_address`` given); :mod:`bytescale.data.ray_engine`.

Every client of one service sees the same global batches; a client's ``state_dict()`` (the
sampler position of its next batch plus a fingerprint of spec, data, seed and budget) resumes a
new service, at any world size and worker count, on exactly the batches that followed.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import socket
import tempfile
import threading
from collections import OrderedDict
from typing import Any, Dict, Optional, Union

import numpy as np
import torch

from .mixing import MixingSpec
from .source import BatchSource, DatasetSource, GlobalBatch

__all__ = ["DataService", "ServiceClient", "connect", "open_batch_source"]

log = logging.getLogger("bytescale.data.service")
SpecLike = Union[MixingSpec, Dict[str, Any], str, os.PathLike]


def _as_spec(spec: SpecLike) -> MixingSpec:
    if isinstance(spec, MixingSpec):
        return spec
    if isinstance(spec, dict):
        return MixingSpec.from_dict(spec)
    return MixingSpec.load(spec)


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class DataService:
    """Start the data service for a mixing spec (see the module docstring).

    Args:
        spec: a :class:`~bytescale.data.mixing.MixingSpec`, a dict, or a JSON/TOML file.
        tokens_per_batch, seed: override the spec's.
        engine: ``"local"`` or ``"ray"``.
        workers: source workers per raw-text source (a source's ``workers`` overrides it).
        prefetch: global batches prepared ahead of the furthest client.
        standby: idle workers kept ready to replace a dead one (local engine).
        state: a client ``state_dict()`` to resume from.
        timeout: seconds a client waits for an answer before raising.

    A missing input, an unreadable tokenizer or an empty source raises here, at start.
    """

    def __init__(self, spec: SpecLike, tokens_per_batch: Optional[int] = None, seed: Optional[int] = None,
                 engine: str = "local", workers: int = 1, prefetch: int = 4, standby: int = 1,
                 state: Optional[Dict[str, Any]] = None, timeout: float = 120.0,
                 ray_address: Optional[str] = None) -> None:
        self.spec = _as_spec(spec)
        self.tokens_per_batch = int(tokens_per_batch or self.spec.tokens_per_batch or 0)
        if self.tokens_per_batch <= 0:
            raise ValueError("DataService: tokens_per_batch must be given (argument or spec)")
        self.seed = int(self.spec.seed if seed is None else seed)
        if workers < 1 or prefetch < 0 or standby < 0:
            raise ValueError(f"DataService: workers >= 1, prefetch >= 0, standby >= 0 (got {workers}, {prefetch}, {standby})")
        self.engine, self.timeout = engine, float(timeout)
        self._closed = False
        if engine == "local":
            self._start_local(workers, prefetch, standby, state)
        elif engine == "ray":
            from .ray_engine import start_ray_service

            self._ray = start_ray_service(self.spec, self.tokens_per_batch, self.seed, workers, prefetch, state,
                                          ray_address)
            self.address = self._ray.address
        else:
            raise ValueError(f"DataService: unknown engine {engine!r} (choose 'local' or 'ray')")

    def _start_local(self, workers: int, prefetch: int, standby: int, state) -> None:
        from .local_engine import coordinator_main

        self._dir = tempfile.mkdtemp(prefix="bytescale-data-", dir=_shm_root())
        os.chmod(self._dir, 0o700)
        sock = os.path.join(self._dir, "service.sock")
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self._proc = ctx.Process(target=coordinator_main, name="bytescale-data-coordinator",
                                 args=(self.spec, self.tokens_per_batch, self.seed, workers, prefetch, standby,
                                       sock, self._dir, child, self._conn, state))
        self._proc.start()
        child.close()
        if not self._conn.poll(self.timeout):
            self._cleanup()
            raise TimeoutError(f"DataService: the coordinator did not start within {self.timeout:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            msg = ("error", f"the coordinator exited with code {self._proc.exitcode}", "")
        if msg[0] == "error":
            self._cleanup()
            log.debug("coordinator traceback:\n%s", msg[2])
            raise RuntimeError(f"DataService: {msg[1]}")
        self.address = f"local:{sock}"

    def client(self) -> BatchSource:
        """A new client (one per rank); in another process use :func:`connect` with ``address``."""
        return connect(self.address, self.timeout)

    def worker_pids(self) -> Dict[str, Any]:
        """Local engine: ``{"workers": {(source, j): pid}, "standby": [pid]}`` (for fault tests)."""
        if self.engine != "local":
            raise RuntimeError("worker_pids: local engine only")
        with self._lock:
            self._conn.send(("pids",))
            if not self._conn.poll(self.timeout):
                raise TimeoutError("DataService: no answer from the coordinator")
            return self._conn.recv()

    def _cleanup(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self._proc.join(timeout=5.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def close(self) -> None:
        """Stop workers and coordinator; remove the shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.engine == "local":
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._conn.close()
            self._cleanup()
        else:
            self._ray.close()

    def __enter__(self) -> "DataService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class ServiceClient:
    """A :class:`~bytescale.data.source.BatchSource` over a local-engine service (one per rank).

    Token ranges are read straight from shared memory: the chunk file a worker wrote, or the
    token store's mapping; only the pages of the requested ranges are touched.
    """

    def __init__(self, path: str, timeout: float = 120.0) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as e:
            raise ConnectionError(f"data service at {path}: cannot connect ({e.strerror})") from e
        self._conn = mpc.Connection(sock.detach())
        self._dir = os.path.dirname(path)
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        info = self._call(("hello",), "info")[1]
        self.fingerprint: str = info["fingerprint"]
        # the spec's source names and longest document (None: unbounded), for HDPLoader's oversize check
        self.source_names, self.longest = info.get("names"), info.get("longest")
        self._bases = info["bases"]
        self._store_paths = {int(k): v for k, v in info["stores"].items()}
        self._stores: Dict[int, Any] = {}
        self._state: Dict[str, Any] = info["start"]
        self._recent: "OrderedDict[int, Dict[int, Any]]" = OrderedDict()  # step -> {sid: loc}
        self._maps: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self._closed = False

    def _call(self, msg, expect: str):
        with self._lock:
            self._conn.send(msg)
            if not self._conn.poll(self.timeout):
                raise TimeoutError(f"data service: no answer to {msg[0]!r} within {self.timeout:.0f} s")
            try:
                reply = self._conn.recv()
            except EOFError:
                raise ConnectionError("data service: the coordinator closed the connection") from None
        if reply[0] == "error":
            raise RuntimeError(f"data service: {reply[1]}")
        if reply[0] != expect:
            raise RuntimeError(f"data service: expected {expect!r}, got {reply[0]!r}")
        return reply

    def next_batch(self) -> GlobalBatch:
        _, batch, after, locs = self._call(("batch", int(self._state["step"])), "batch")
        self._recent[batch.step] = {sid: loc for sid, loc in zip(batch.sample_ids, locs)}
        while len(self._recent) > 4:
            self._recent.popitem(last=False)
        self._state = after
        return batch

    def _source_of(self, sid: int) -> int:
        s = int(np.searchsorted(self._bases, sid, side="right")) - 1
        if not 0 <= s < len(self._bases) - 1 or sid < 0:
            raise IndexError(f"data service: sample id {sid} out of range [0, {self._bases[-1]})")
        return s

    def tokens(self, sample_id: int, start: int, end: int) -> torch.Tensor:
        s = self._source_of(sample_id)
        if s in self._store_paths:
            st = self._stores.get(s)
            if st is None:
                from .token_store import TokenStore

                st = self._stores[s] = TokenStore(self._store_paths[s])
            return st.tokens(sample_id - self._bases[s], start, end)
        loc = None
        for locs in reversed(self._recent.values()):
            loc = locs.get(sample_id)
            if loc is not None:
                break
        for attempt in range(3):
            if loc is None:
                loc = self._call(("locate", sample_id), "loc")[1]
            if not (0 <= start <= end <= loc.length):
                raise IndexError(f"data service: range [{start}, {end}) outside document {sample_id} of length {loc.length}")
            try:
                arr = self._map(loc.chunk, loc.dtype)
            except FileNotFoundError:  # freed since: ask again
                loc = None
                continue
            return torch.from_numpy(arr[loc.offset + start:loc.offset + end].astype(np.int64))
        raise RuntimeError(f"data service: document {sample_id}'s tokens keep disappearing")

    def _map(self, chunk: str, dtype: str) -> np.ndarray:
        arr = self._maps.get(chunk)
        if arr is None:
            path = os.path.join(self._dir, chunk)
            arr = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
            self._maps[chunk] = arr
            while len(self._maps) > 64:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(chunk)
        return arr

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "service", "fingerprint": self.fingerprint, "sampler": dict(self._state)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("kind") != "service":
            raise ValueError(f"ServiceClient: not a data service state (kind {state.get('kind')!r})")
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"ServiceClient: the state was saved with another spec, data, seed or token budget "
                             f"(fingerprint {state.get('fingerprint')} != {self.fingerprint})")
        self._call(("seek", state), "ok")
        self._state = dict(state["sampler"])
        self._recent.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._lock:
                self._conn.send(("bye",))
        except OSError:
            pass
        self._conn.close()
        self._maps.clear()


def connect(address: str, timeout: float = 120.0) -> BatchSource:
    """A client of the service at ``address`` (``DataService.address``), from any process."""
    kind, _, where = address.partition(":")
    if kind == "local":
        return ServiceClient(where, timeout)
    if kind == "ray":
        from .ray_engine import RayServiceClient

        return RayServiceClient(where, timeout)
    raise ValueError(f"connect: unknown service address {address!r}")


def open_batch_source(data: Optional[str] = None, data_spec: Optional[str] = None, *, tokens_per_batch: int,
                      seed: int = 0, address: Optional[str] = None, **service_kwargs) -> "tuple[BatchSource, Optional[DataService]]":
    """What ``--data DIR`` / ``--data-spec FILE`` select: (batch source, service to close or None).

    ``data``: a token store, read in process (:class:`DatasetSource`). ``data_spec``: a mixing
    spec served by a new :class:`DataService` (or the running one at ``address``).
    """
    if (data is None) == (data_spec is None):
        raise ValueError("open_batch_source: give exactly one of data (a token store) and data_spec (a mixing spec)")
    if data is not None:
        from .token_store import TokenStore

        return DatasetSource(TokenStore(data), tokens_per_batch, seed), None
    if address is not None:
        return connect(address), None
    svc = DataService(data_spec, tokens_per_batch=tokens_per_batch, seed=seed, **service_kwargs)
    return svc.client(), svc
