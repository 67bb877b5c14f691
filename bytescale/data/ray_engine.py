"""The data service's Ray engine: Ray actors as coordinator and source workers.

Same batches and API as the local engine (:mod:`bytescale.data.local_engine`), for sources on
other machines of a Ray cluster:

* a **coordinator** actor owns the :class:`~bytescale.data.book.BatchBook` and answers clients'
  batch requests (metadata only);
* per raw-text source, ``workers`` **source actors** tokenize the documents the book asks for
  and keep the tokens in memory until the book frees them; per token store, one **store actor**
  opens the store where it lives and serves ranges;
* clients (:class:`RayServiceClient`, one per rank) call the actor that holds a document for just
  the token range they need.

A killed source actor is restarted by Ray (``max_restarts=-1``: the standby) and its pending
calls retried; tokens it held are tokenized again on demand, so nothing is lost or repeated.
Actors take no CPU reservation (``num_cpus=0``) so a small cluster fits them all.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .book import BatchBook
from .mixing import MixingSpec, spec_fingerprint
from .source import GlobalBatch

__all__ = ["start_ray_service", "RayServiceClient"]


def _ray():
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("engine='ray' needs the 'ray' package (pip install ray)") from e
    return ray


class _SourceWorker:
    """Tokenizes documents of one raw-text source; holds their tokens by chunk."""

    def __init__(self, spec: MixingSpec, s: int) -> None:
        from .local_engine import open_sources

        one = MixingSpec((spec.sources[s],), spec.tokens_per_batch, spec.seed)
        objs, _, toks, dtypes = open_sources(one)
        self.corpus, self.tok, self.dtype = objs[0], toks[0], dtypes[0]
        self.chunks: Dict[str, np.ndarray] = {}
        self.n = 0

    def count(self) -> int:
        return len(self.corpus)

    def tokenize(self, prefix: str, items: List[Tuple[int, int]]):
        out, arrays, errors, off = [], [], [], 0
        for p, lid in items:
            rec = self.corpus.record(lid)
            if rec.error is not None:
                errors.append((lid, f"{rec.origin}: {rec.error}"))
                out.append((p, lid, -1, 0))
                continue
            ids = np.asarray(self.tok.encode(rec.text), dtype=self.dtype)
            arrays.append(ids)
            out.append((p, lid, len(ids), off))
            off += len(ids)
        self.n += 1
        name = f"{prefix}-{uuid.uuid4().hex[:8]}-{self.n}"
        self.chunks[name] = np.concatenate(arrays) if arrays else np.zeros(0, self.dtype)
        return name, out, errors

    def read(self, chunk: str, a: int, b: int, lid: int, start: int, end: int) -> np.ndarray:
        arr = self.chunks.get(chunk)
        if arr is not None:
            return np.array(arr[a:b])
        rec = self.corpus.record(lid)  # lost with a restart, or freed: tokenize again
        return np.asarray(self.tok.encode(rec.text), dtype=self.dtype)[start:end]

    def free(self, chunks: List[str]) -> None:
        for c in chunks:
            self.chunks.pop(c, None)


class _StoreServer:
    """Serves token ranges of a token store from the node that holds it."""

    def __init__(self, path: str) -> None:
        from .token_store import TokenStore

        self.store = TokenStore(path)

    def lengths(self) -> np.ndarray:
        return np.asarray(self.store.lengths)

    def read(self, lid: int, a: int, b: int) -> np.ndarray:
        return np.array(self.store.array(lid, a, b))


class _Coordinator:
    def __init__(self, spec: MixingSpec, tokens_per_batch: int, seed: int, workers: int, prefetch: int,
                 namespace: str, state: Optional[Dict[str, Any]]) -> None:
        ray = _ray()
        self.ray, self.ns = ray, namespace
        self.spec = spec
        self.stores: Dict[int, Any] = {}
        self.workers: Dict[int, List[Any]] = {}
        counts: List[int] = []
        lengths: List[Optional[np.ndarray]] = []
        for s, src in enumerate(spec.sources):
            if src.store is not None:
                a = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(_StoreServer).options(
                    name=f"src{s}", namespace=namespace).remote(src.store)
                self.stores[s] = a
                lengths.append(ray.get(a.lengths.remote()))
                counts.append(len(lengths[-1]))
            else:
                n = src.workers or workers
                cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(_SourceWorker)
                self.workers[s] = [cls.options(name=f"src{s}-w{j}", namespace=namespace).remote(spec, s) for j in range(n)]
                lengths.append(None)
                counts.append(ray.get(self.workers[s][0].count.remote()))
                ray.get([w.count.remote() for w in self.workers[s]])
        self.fingerprint = spec_fingerprint(spec, counts, tokens_per_batch, seed)
        self.book = BatchBook(spec, counts, tokens_per_batch, seed, lengths, prefetch)
        if state is not None:
            self._check(state)
            self.book.seek(state["sampler"])
        self.initial = self.book.sampler.state_dict()
        self.pending: Dict[Any, Tuple[int, int]] = {}  # ref -> (source, worker)
        self.cursors: Dict[str, int] = {}
        self.owner: Dict[str, int] = {}  # chunk -> worker index
        self.logged: set = set()

    def _check(self, state: Dict[str, Any]) -> None:
        if state.get("kind") != "service" or state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"data service: the state was saved with another spec, data, seed or token budget "
                             f"(fingerprint {state.get('fingerprint')} != {self.fingerprint})")

    def info(self) -> Dict[str, Any]:
        return {"fingerprint": self.fingerprint, "start": self.initial, "bases": self.book.sampler.bases,
                "stores": sorted(self.stores), "workers": {s: len(w) for s, w in self.workers.items()},
                "namespace": self.ns, "names": [src.name for src in self.spec.sources],
                "longest": self.spec.longest()}

    def _dispatch(self) -> None:
        """Small requests, each to the source's actor with the fewest requests pending."""
        from .local_engine import REQUEST_DOCS

        for s, items in self.book.wanted():
            for k in range(0, len(items), REQUEST_DOCS):
                load = {j: 0 for j in range(len(self.workers[s]))}
                for s2, j in self.pending.values():
                    if s2 == s:
                        load[j] += 1
                j = min(load, key=lambda j: (load[j], j))
                self.pending[self.workers[s][j].tokenize.remote(f"s{s}w{j}", items[k:k + REQUEST_DOCS])] = (s, j)

    def _collect(self, wait: bool) -> None:
        if not self.pending:
            return
        done, _ = self.ray.wait(list(self.pending), num_returns=1 if wait else len(self.pending),
                                timeout=None if wait else 0)
        for ref in done:
            s, j = self.pending.pop(ref)
            name, items, errors = self.ray.get(ref)
            for lid, what in errors:
                if (s, lid) not in self.logged:  # once per document, not once per epoch
                    self.logged.add((s, lid))
                    logging.getLogger("bytescale.data.service").warning("data service: skipped %s", what)
            self.owner[name] = j
            self.book.on_tokenized(s, name, items, "")  # tokens travel as arrays: no dtype needed

    def batch(self, client: str, step: int):
        self.cursors[client] = step
        while True:
            self._collect(wait=False)
            self.book.produce(max(self.cursors.values()) + self.book.prefetch)
            self.book.produce(step)
            self._dispatch()
            got = self.book.get(step)
            if got is not None:
                break
            self._collect(wait=True)
        freed = self.book.collect(list(self.cursors.values()))
        by_worker: Dict[Tuple[int, int], List[str]] = {}
        for cid in freed:
            s = int(cid[1:cid.index("w")])
            by_worker.setdefault((s, self.owner.pop(cid, 0)), []).append(cid)
        for (s, j), cids in by_worker.items():
            self.workers[s][j].free.remote(cids)
        locs = tuple(None if l is None else (l.chunk, l.offset, l.length, self.owner.get(l.chunk, 0))
                     for l in got.locations)
        return got.batch, got.after, locs

    def seek(self, client: str, state: Dict[str, Any]) -> bool:
        self._check(state)
        self.cursors[client] = int(state["sampler"]["step"])
        return self.book.seek(state["sampler"])

    def bye(self, client: str) -> None:
        self.cursors.pop(client, None)


class _Handle:
    def __init__(self, coord, namespace: str, actors: List[Any]) -> None:
        self.coord, self.namespace = coord, namespace
        self.address = f"ray:{namespace}"

    def close(self) -> None:
        ray = _ray()
        info = ray.get(self.coord.info.remote())
        for s in info["stores"]:
            ray.kill(ray.get_actor(f"src{s}", namespace=self.namespace))
        for s, n in info["workers"].items():
            for j in range(n):
                ray.kill(ray.get_actor(f"src{s}-w{j}", namespace=self.namespace))
        ray.kill(self.coord)


def start_ray_service(spec: MixingSpec, tokens_per_batch: int, seed: int, workers: int, prefetch: int,
                      state: Optional[Dict[str, Any]], ray_address: Optional[str]) -> _Handle:
    """Create the actors in the current Ray cluster (``ray.init(ray_address)`` if none yet)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=True)
    ns = f"bytescale-data-{uuid.uuid4().hex[:12]}"
    coord = ray.remote(num_cpus=0)(_Coordinator).options(name="coordinator", namespace=ns).remote(
        spec, tokens_per_batch, seed, workers, prefetch, ns, state)
    try:
        ray.get(coord.info.remote())
    except Exception as e:
        cause = getattr(e, "cause", None) or e
        raise RuntimeError(f"DataService (ray): {type(cause).__name__}: {cause}") from None
    return _Handle(coord, ns, [])


class RayServiceClient:
    """A :class:`~bytescale.data.source.BatchSource` over a Ray-engine service (one per rank)."""

    def __init__(self, namespace: str, timeout: float = 120.0) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address="auto")
        self.ray, self.ns, self.timeout = ray, namespace, float(timeout)
        self.coord = ray.get_actor("coordinator", namespace=namespace)
        self.id = uuid.uuid4().hex
        info = ray.get(self.coord.info.remote(), timeout=self.timeout)
        self.fingerprint = info["fingerprint"]
        self.source_names, self.longest = info.get("names"), info.get("longest")  # HDPLoader's oversize check
        self._bases = info["bases"]
        self._stores = {s: ray.get_actor(f"src{s}", namespace=namespace) for s in info["stores"]}
        self._workers = {int(s): [ray.get_actor(f"src{s}-w{j}", namespace=namespace) for j in range(n)]
                         for s, n in info["workers"].items()}
        self._state = info["start"]
        self._recent: Dict[int, Dict[int, tuple]] = {}

    def next_batch(self) -> GlobalBatch:
        batch, after, locs = self.ray.get(self.coord.batch.remote(self.id, int(self._state["step"])),
                                          timeout=self.timeout)
        self._recent[batch.step] = dict(zip(batch.sample_ids, locs))
        for k in [k for k in self._recent if k < batch.step - 3]:
            del self._recent[k]
        self._state = after
        return batch

    def tokens(self, sample_id: int, start: int, end: int) -> torch.Tensor:
        s = int(np.searchsorted(self._bases, sample_id, side="right")) - 1
        if not 0 <= s < len(self._bases) - 1 or sample_id < 0:
            raise IndexError(f"data service: sample id {sample_id} out of range [0, {self._bases[-1]})")
        lid = sample_id - self._bases[s]
        if s in self._stores:
            arr = self.ray.get(self._stores[s].read.remote(lid, start, end), timeout=self.timeout)
            return torch.from_numpy(arr.astype(np.int64))
        loc = next((l[sample_id] for l in reversed(list(self._recent.values())) if sample_id in l), None)
        workers = self._workers[s]
        if loc is None:
            ref = workers[lid % len(workers)].read.remote("", 0, 0, lid, start, end)
        else:
            chunk, off, n, j = loc
            if not 0 <= start <= end <= n:
                raise IndexError(f"data service: range [{start}, {end}) outside document {sample_id} of length {n}")
            ref = workers[j].read.remote(chunk, off + start, off + end, lid, start, end)
        return torch.from_numpy(np.asarray(self.ray.get(ref, timeout=self.timeout)).astype(np.int64))

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "service", "fingerprint": self.fingerprint, "sampler": dict(self._state)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("kind") != "service" or state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"RayServiceClient: the state was saved with another spec, data, seed or token budget "
                             f"(fingerprint {state.get('fingerprint')} != {self.fingerprint})")
        self.ray.get(self.coord.seek.remote(self.id, state), timeout=self.timeout)
        self._state = dict(state["sampler"])
        self._recent.clear()

    def close(self) -> None:
        try:
            self.coord.bye.remote(self.id)
        except Exception:
            pass
