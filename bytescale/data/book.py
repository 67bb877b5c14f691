"""The engine-independent core of the data service: which global batches come next, from metadata.

:class:`BatchBook` drives a :class:`~bytescale.data.mixing.MixingSampler` with the document
lengths it has: read from a token store's index, or reported by the source workers that tokenize
raw documents ahead of the sampler (:meth:`wanted` says which stream positions to tokenize next;
:meth:`on_tokenized` records lengths and where the tokens are). Batches are produced ahead of the
clients (prefetch) and kept by step, so every client (rank) reads identical metadata whatever its
pace. Everything here is a pure function of (spec, seed, budget, data): lengths of a stream
position and tokens of a document never change, so a lost worker's requests are simply sent again,
and seeking to a saved state reproduces the batches that followed it.

Chunks (the unit in which workers hand over tokens) are freed once every document in them has been
consumed by the sampler and every client has moved two steps past the last batch that used them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .mixing import LengthNotReady, MixingSampler, MixingSpec
from .source import GlobalBatch

__all__ = ["BatchBook", "Produced", "Location"]


@dataclass(frozen=True)
class Location:
    """Where a tokenized document lives: ``chunk`` (engine-specific id), offset, length, dtype."""

    chunk: str
    offset: int
    length: int
    dtype: str


@dataclass
class Produced:
    batch: GlobalBatch
    before: Dict[str, Any]
    after: Dict[str, Any]
    locations: Tuple[Optional[Location], ...]  # None for documents of a token store


@dataclass
class _Chunk:
    source: int
    max_position: int
    last_step: int = -1
    lids: Set[int] = field(default_factory=set)


class BatchBook:
    """Produce global batches ahead, from lengths; see the module docstring.

    Args:
        spec, counts, tokens_per_batch, seed: as for :class:`MixingSampler`.
        store_lengths: per source, the int64 lengths array of a token store, or None for a
            source tokenized on the fly.
        prefetch: batches kept ready beyond the furthest client.
        keep: produced batches kept behind the slowest client (for late readers and seeks).
    """

    def __init__(self, spec: MixingSpec, counts: Sequence[int], tokens_per_batch: int, seed: int,
                 store_lengths: Sequence[Optional[np.ndarray]], prefetch: int = 4, keep: int = 64) -> None:
        self.sampler = MixingSampler(spec, counts, tokens_per_batch, seed)
        self.store_lengths = list(store_lengths)
        self.text = [i for i, l in enumerate(self.store_lengths) if l is None]
        self.prefetch, self.keep = int(prefetch), int(keep)
        n = len(counts)
        self.known: List[Dict[int, int]] = [dict() for _ in range(n)]  # position -> length (-1: bad)
        self.locs: List[Dict[int, Location]] = [dict() for _ in range(n)]  # local id -> location
        self.requested = [0] * n
        self.needed = [0] * n
        self.docs_per_batch = [8.0] * n
        self.batches: Dict[int, Produced] = {}
        self.chunks: Dict[str, _Chunk] = {}
        self.first_step = self.sampler.step

    # -- producing -------------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        return self.sampler.step

    def _length_of(self, s: int, position: int, lid: int) -> int:
        lengths = self.store_lengths[s]
        if lengths is not None:
            return int(lengths[lid])
        n = self.known[s].get(position)
        if n is None:
            self.needed[s] = max(self.needed[s], position + 1)
            raise LengthNotReady(s, position)
        if n > 0 and lid not in self.locs[s]:  # tokens freed since: tokenize again
            self.needed[s] = max(self.needed[s], position + 1)
            self.requested[s] = min(self.requested[s], position)
            del self.known[s][position]
            raise LengthNotReady(s, position)
        return n

    def produce(self, upto_step: int) -> None:
        """Produce batches up to ``upto_step`` (inclusive) as far as the known lengths allow."""
        while self.sampler.step <= upto_step:
            before = self.sampler.state_dict()
            try:
                batch = self.sampler.next_batch(self._length_of)
            except LengthNotReady:
                return
            locs = []
            for sid, s in zip(batch.sample_ids, batch.sources):
                if self.store_lengths[s] is not None:
                    locs.append(None)
                    continue
                loc = self.locs[s][sid - self.sampler.bases[s]]
                self.chunks[loc.chunk].last_step = batch.step
                locs.append(loc)
            self.batches[batch.step] = Produced(batch, before, self.sampler.state_dict(), tuple(locs))
            counts = np.bincount(np.asarray(batch.sources, dtype=np.int64), minlength=len(self.known))
            for s in self.text:
                self.docs_per_batch[s] = 0.7 * self.docs_per_batch[s] + 0.3 * float(counts[s])
                pos = self.sampler.positions[s]
                for p in [p for p in self.known[s] if p < pos]:
                    del self.known[s][p]

    def wanted(self) -> List[Tuple[int, List[Tuple[int, int]]]]:
        """(source, [(position, local id)]) to tokenize next; marks them requested."""
        out = []
        for s in self.text:
            ahead = max(16, int(math.ceil(self.docs_per_batch[s] * (self.prefetch + 1))) + 4)
            target = max(self.sampler.positions[s] + ahead, self.needed[s] + 4)
            start = max(self.requested[s], self.sampler.positions[s])
            if start < target:
                out.append((s, self.sampler.upcoming(s, start, target - start)))
                self.requested[s] = target
        return out

    def on_tokenized(self, s: int, chunk: str, items: Sequence[Tuple[int, int, int, int]], dtype: str) -> None:
        """A worker tokenized ``items`` = (position or -1, local id, length or -1, offset) into ``chunk``."""
        c = self.chunks.setdefault(chunk, _Chunk(s, -1))
        for p, lid, n, off in items:
            if p >= 0:
                self.known[s][p] = n
                c.max_position = max(c.max_position, p)
            if n > 0:
                self.locs[s][lid] = Location(chunk, off, n, dtype)
                c.lids.add(lid)

    # -- clients ---------------------------------------------------------------------------------
    def get(self, step: int) -> Optional[Produced]:
        if step < self.first_step:
            raise KeyError(f"step {step} is before the first step this service holds ({self.first_step}); "
                           "load a state to rewind")
        return self.batches.get(step)

    def seek(self, state: Dict[str, Any]) -> bool:
        """Make ``state`` (a sampler state) the next position; False if this rewound the book."""
        step = int(state["step"])
        held = self.batches.get(step)
        if held is not None and held.before == state:
            return True
        if self.sampler.state_dict() == state:
            return True
        self.sampler.load_state_dict(state)
        self.batches.clear()
        self.first_step = step
        for s in self.text:
            self.requested[s] = self.needed[s] = self.sampler.positions[s]
            self.known[s] = {p: n for p, n in self.known[s].items() if p >= self.sampler.positions[s]}
        return False

    def collect(self, cursors: Sequence[int]) -> List[str]:
        """Drop batches and chunks no client can need (``cursors``: next step of each client);
        returns the freed chunk ids."""
        if not cursors:
            return []
        low = min(cursors)
        for step in [k for k in self.batches if k < low - self.keep]:
            del self.batches[step]
        self.first_step = max(self.first_step, min(self.batches, default=self.sampler.step))
        freed = []
        for cid, c in list(self.chunks.items()):
            consumed = c.max_position < self.sampler.positions[c.source] and self.requested[c.source] > c.max_position
            if consumed and c.last_step < low - 2:
                freed.append(cid)
                del self.chunks[cid]
                for lid in c.lids:
                    if self.locs[c.source].get(lid) is not None and self.locs[c.source][lid].chunk == cid:
                        del self.locs[c.source][lid]
        return freed
