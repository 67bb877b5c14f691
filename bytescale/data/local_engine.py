"""The data service's local engine: a coordinator process, source worker processes, shared memory.

Processes (all forked, none imports anything new):

* the **coordinator** (one per service) runs a single-threaded event loop over a Unix socket
  (clients), pipes to its workers and a pipe to the process that started the service (it exits
  when that process goes away). It owns the :class:`~bytescale.data.book.BatchBook`.
* **source workers** (``workers`` per raw-text source) tokenize the documents the book asks for
  (a few per request, to the least busy worker) into chunk files in a private tmpfs directory
  (``/dev/shm``: shared memory), and report lengths and offsets. Token-store sources need no
  worker: clients map the store's ``.bin`` themselves (the page cache is the shared memory).
* **standby** workers idle until a worker dies; then one takes over its role, the coordinator
  resends the dead worker's outstanding requests, and a new standby is forked. Chunks the dead
  worker completed stay valid; nothing is lost or repeated because batches are a pure function of
  the sampler state and document lengths.

Clients (:class:`~bytescale.data.service.ServiceClient`) ask for batch metadata by step and read
token ranges directly from the chunk files or the store.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import traceback
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .book import BatchBook
from .mixing import MixingSpec, spec_fingerprint
from .token_store import TokenStore, dtype_for_vocab

log = logging.getLogger("bytescale.data.service")
REQUEST_DOCS = 2  # documents per tokenize request


def open_sources(spec: MixingSpec) -> Tuple[List[Any], List[Optional[np.ndarray]], List[Any], List[str]]:
    """(store or RawCorpus, store lengths or None, tokenizer or None, chunk dtype) per source.
    Raises a clear error for a missing input, an unreadable tokenizer or an empty source."""
    from .records import RawCorpus
    from .tokenizer import load_tokenizer

    objs, lengths, toks, dtypes = [], [], [], []
    for s in spec.sources:
        if s.store is not None:
            st = TokenStore(s.store)
            objs.append(st)
            lengths.append(np.asarray(st.lengths))
            toks.append(None)
            dtypes.append(str(st.dtype))
        else:
            tok = load_tokenizer(s.tokenizer)
            if s.python_packages is not None:
                from .corpora import python_packages

                opts = dict(s.python_packages)
                mdb = opts.pop("max_doc_bytes", None)
                corpus = RawCorpus(packages=python_packages(**opts), max_doc_bytes=mdb)
            else:
                corpus = RawCorpus(s.text, s.text_field)
            objs.append(corpus)
            lengths.append(None)
            toks.append(tok)
            dtypes.append(dtype_for_vocab(tok.vocab_size).name)
        if len(objs[-1]) == 0:
            raise RuntimeError(f"data service: source {s.name!r} has no document")
    return objs, lengths, toks, dtypes


# -- workers ------------------------------------------------------------------------------------
def _worker_main(conn, corpora, toks, dtypes, shm_dir: str, uid: str, role: Optional[Tuple[int, int]]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if role is None:  # standby: wait for a role
            msg = conn.recv()
            if msg[0] != "activate":
                return
            role = msg[1]
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                return
            _, req, s, items = msg
            out, arrays, errors, off = [], [], [], 0
            for p, lid in items:
                rec = corpora[s].record(lid)
                if rec.error is not None:
                    errors.append((lid, f"{rec.origin}: {rec.error}"))
                    out.append((p, lid, -1, 0))
                    continue
                ids = toks[s].encode(rec.text)
                arrays.append(np.asarray(ids, dtype=dtypes[s]))
                out.append((p, lid, len(ids), off))
                off += len(ids)
            name = f"{uid}-r{req}.tok"
            tmp = os.path.join(shm_dir, name + ".tmp")
            with open(tmp, "wb") as f:
                for a in arrays:
                    f.write(a.tobytes())
            os.replace(tmp, os.path.join(shm_dir, name))
            conn.send(("done", req, s, name, out, errors))
    except (EOFError, OSError, KeyboardInterrupt):  # the service is closing
        return


class _Coordinator:
    def __init__(self, spec: MixingSpec, tokens_per_batch: int, seed: int, workers: int, prefetch: int,
                 standby: int, sock_path: str, shm_dir: str, parent, state: Optional[Dict[str, Any]]) -> None:
        self.spec, self.shm_dir, self.parent = spec, shm_dir, parent
        self.corpora, lengths, self.toks, self.dtypes = open_sources(spec)
        counts = [len(c) for c in self.corpora]
        self.fingerprint = spec_fingerprint(spec, counts, tokens_per_batch, seed)
        self.book = BatchBook(spec, counts, tokens_per_batch, seed, lengths, prefetch)
        if state is not None:
            self._check(state)
            self.book.seek(state["sampler"])
        self.initial = self.book.sampler.state_dict()
        self.ctx = mp.get_context("fork")
        self.nworkers = {s: (spec.sources[s].workers or workers) for s in self.book.text}
        self.workers: Dict[Tuple[int, int], Tuple[Any, Any]] = {}  # role -> (process, conn)
        self.standbys: List[Tuple[Any, Any]] = []
        self.outstanding: Dict[int, Tuple[Tuple[int, int], tuple]] = {}  # req -> (role, msg)
        self.locates: Dict[int, List[Tuple[Any, int]]] = {}  # req -> [(client conn, sid)]
        self.n_spawned = 0
        self.req = 0
        self.logged: set = set()
        for s, n in self.nworkers.items():
            for j in range(n):
                self.workers[(s, j)] = self._fork((s, j))
        if self.book.text:
            for _ in range(standby):
                self.standbys.append(self._fork(None))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path)
        self.listener.listen(64)
        self.clients: Dict[Any, int] = {}  # conn -> cursor (next step it asks for)
        self.pending: Dict[Any, int] = {}  # conn -> step it waits for
        self.stores = {i: str(c.prefix) for i, c in enumerate(self.corpora) if isinstance(c, TokenStore)}

    def _check(self, state: Dict[str, Any]) -> None:
        if state.get("kind") != "service" or state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"data service: the state was saved with another spec, data, seed or token budget "
                             f"(fingerprint {state.get('fingerprint')} != {self.fingerprint})")

    def _fork(self, role):
        a, b = self.ctx.Pipe()
        self.n_spawned += 1
        p = self.ctx.Process(target=_worker_main, daemon=True,
                             args=(b, self.corpora, self.toks, self.dtypes, self.shm_dir, f"w{self.n_spawned}", role))
        p.start()
        b.close()
        return p, a

    def _send_requests(self) -> None:
        """Small requests (a few documents each, so the first lengths come back early), each to
        the worker of that source with the fewest documents outstanding."""
        for s, items in self.book.wanted():
            for k in range(0, len(items), REQUEST_DOCS):
                load = {j: 0 for j in range(self.nworkers[s])}
                for role, msg in self.outstanding.values():
                    if role[0] == s:
                        load[role[1]] += len(msg[3])
                j = min(load, key=lambda j: (load[j], j))
                self._request((s, j), items[k:k + REQUEST_DOCS])

    def _request(self, role, items) -> int:
        self.req += 1
        msg = ("tokenize", self.req, role[0], items)
        self.outstanding[self.req] = (role, msg)
        self.workers[role][1].send(msg)
        return self.req

    def _replace(self, role) -> None:
        proc, conn = self.workers[role]
        conn.close()
        if not self.standbys:
            self.standbys.append(self._fork(None))
        new = self.standbys.pop(0)
        new[1].send(("activate", role))
        self.workers[role] = new
        resend = [msg for r, msg in self.outstanding.values() if r == role]
        log.warning("data service: source worker %s (pid %s) died (exit %s); standby pid %s took over, "
                    "resending %d requests", role, proc.pid, proc.exitcode, new[0].pid, len(resend))
        for msg in resend:
            new[1].send(msg)
        self.standbys.append(self._fork(None))

    def _advance(self) -> None:
        if self.clients:
            self.book.produce(max(self.clients.values()) + self.book.prefetch)
        for c, step in list(self.pending.items()):
            self.book.produce(step)
        self._send_requests()
        for c, step in list(self.pending.items()):
            self._answer(c, step)
        for cid in self.book.collect(list(self.clients.values())):
            try:
                os.unlink(os.path.join(self.shm_dir, cid))
            except FileNotFoundError:
                pass

    def _answer(self, c, step: int) -> None:
        try:
            got = self.book.get(step)
        except KeyError as e:
            self.pending.pop(c, None)
            return self._send(c, ("error", str(e)))
        if got is not None:
            self.pending.pop(c, None)
            self._send(c, ("batch", got.batch, got.after, got.locations))
        else:
            self.pending[c] = step

    def _send(self, c, msg) -> None:
        try:
            c.send(msg)
        except OSError:
            self._drop(c)

    def _drop(self, c) -> None:
        self.clients.pop(c, None)
        self.pending.pop(c, None)
        c.close()

    def _on_client(self, c, msg) -> None:
        kind = msg[0]
        if kind == "hello":
            self.clients[c] = int(self.initial["step"])
            self._send(c, ("info", {"fingerprint": self.fingerprint, "stores": self.stores,
                                    "start": self.initial, "bases": self.book.sampler.bases,
                                    "names": [src.name for src in self.spec.sources],
                                    "longest": self.spec.longest()}))
        elif kind == "batch":
            self.clients[c] = msg[1]
            self._answer(c, msg[1])
        elif kind == "seek":
            try:
                self._check(msg[1])
                same = self.book.seek(msg[1]["sampler"])
                if not same:
                    log.info("data service: rewound to step %d", msg[1]["sampler"]["step"])
                self.clients[c] = int(msg[1]["sampler"]["step"])
                self._send(c, ("ok",))
            except (ValueError, KeyError) as e:
                self._send(c, ("error", str(e)))
        elif kind == "locate":
            s, lid = self.book.sampler.split(msg[1])
            loc = self.book.locs[s].get(lid)
            if loc is not None:
                self._send(c, ("loc", loc))
            else:
                n = self.nworkers[s]
                req = self._request((s, lid % n), [(-1, lid)])
                self.locates.setdefault(req, []).append((c, msg[1]))
        elif kind == "bye":
            self._drop(c)
        else:
            self._send(c, ("error", f"unknown request {kind!r}"))

    def _on_worker(self, role, msg) -> None:
        _, req, s, name, items, errors = msg
        for lid, what in errors:
            if (s, lid) not in self.logged:  # once per document, not once per epoch
                self.logged.add((s, lid))
                log.warning("data service: skipped %s", what)
        if self.outstanding.pop(req, None) is None:
            return
        self.book.on_tokenized(s, name, items, self.dtypes[s])
        for c, sid in self.locates.pop(req, []):
            self.book.chunks[name].last_step = max(self.clients.values(), default=0)
            lid = self.book.sampler.split(sid)[1]
            loc = self.book.locs[s].get(lid)
            self._send(c, ("loc", loc) if loc is not None else ("error", f"document {sid} is malformed"))

    def _on_parent(self, msg) -> bool:
        if msg[0] == "pids":
            self.parent.send({"workers": {r: p.pid for r, (p, _) in self.workers.items()},
                              "standby": [p.pid for p, _ in self.standbys]})
        return msg[0] != "close"

    def run(self) -> None:
        while True:
            conns = [self.listener, self.parent, *self.clients]
            by_conn = {w[1]: r for r, w in self.workers.items()}
            by_sentinel = {w[0].sentinel: r for r, w in self.workers.items()}
            ready = mpc.wait(conns + list(by_conn) + list(by_sentinel), timeout=1.0)
            for obj in ready:
                if obj is self.listener:
                    sock, _ = self.listener.accept()
                    self.clients[mpc.Connection(sock.detach())] = 0
                elif obj is self.parent:
                    try:
                        if not self._on_parent(self.parent.recv()):
                            return
                    except EOFError:
                        return
                elif obj in by_conn or obj in by_sentinel:
                    role = by_conn.get(obj, by_sentinel.get(obj))
                    proc, conn = self.workers[role]
                    if obj is not conn and obj is not proc.sentinel:
                        continue  # a replaced worker's
                    try:
                        while conn.poll():
                            self._on_worker(role, conn.recv())
                        if obj is conn:
                            continue
                    except (EOFError, OSError):
                        pass
                    if proc.is_alive():
                        proc.kill()
                    proc.join(timeout=1.0)
                    self._replace(role)
                elif obj in self.clients:
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        self._drop(obj)
                        continue
                    self._on_client(obj, msg)
            self._advance()

    def shutdown(self) -> None:
        """Stop the workers (stateless: one still busy after a second is killed)."""
        procs = list(self.workers.values()) + self.standbys
        for p, c in procs:
            try:
                c.send(("stop",))
            except OSError:
                pass
        mpc.wait([p.sentinel for p, _ in procs], timeout=1.0)
        for p, _ in procs:
            if p.is_alive():
                p.kill()
            p.join()
        self.listener.close()


def coordinator_main(spec: MixingSpec, tokens_per_batch, seed, workers, prefetch, standby, sock_path, shm_dir,
                     parent, host_end, state) -> None:
    """Entry point of the coordinator process: report ("ready", pid) or ("error", message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host_end.close()  # so that the host's exit reads as EOF here
    try:
        coord = _Coordinator(spec, tokens_per_batch, seed, workers, prefetch,
                             standby, sock_path, shm_dir, parent, state)
    except Exception as e:  # reported to the caller, which raises it
        parent.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    parent.send(("ready", os.getpid()))
    try:
        coord.run()
    finally:
        coord.shutdown()
