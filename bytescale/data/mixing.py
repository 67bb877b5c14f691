"""The declarative mixing spec and the deterministic global-batch sampler built on it.

A spec lists sources (a token store, raw text inputs tokenized on the fly, or the python-packages
corpus), each with a weight and a length filter, plus an optional length curriculum, the global
batch token budget and the seed. It is read from a dict, a JSON file or a TOML file::

    # mix.toml
    tokens_per_batch = 65536
    seed = 0
    [[sources]]
    name = "code"
    store = "/data/code"            # a token store (prepare's output or Megatron .bin/.idx)
    weight = 0.7
    max_length = 131072             # documents outside [min_length, max_length] are skipped
    [[sources]]
    name = "web"
    text = ["/data/web/*.jsonl"]    # raw inputs, tokenized on the fly by the source workers
    tokenizer = "bytes"             # or a local HF tokenizer path
    weight = 0.3
    workers = 2
    [[curriculum]]                  # sequence-length warm-up: documents are cut to max_length
    until_step = 1000
    max_length = 8192

Sampling (:class:`MixingSampler`) is a pure function of (spec, seed, tokens per batch, document
lengths): every source walks its own permutation of its documents, one per epoch (seeded by
(seed, source index, epoch)); the next document comes from the source whose token share lags its
weight the most (ties: lowest index), so token shares follow the weights; documents are added
until the next one would exceed the budget (a batch holds at least one document), and that one
opens the next batch. The state is (step, per-source stream position, per-source tokens drawn):
independent of world size, worker count and timing.
"""
from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .source import GlobalBatch

__all__ = ["SourceSpec", "CurriculumStage", "MixingSpec", "MixingSampler", "LengthNotReady", "spec_fingerprint"]


@dataclass(frozen=True)
class SourceSpec:
    """One source: exactly one of ``store``, ``text`` or ``python_packages``."""

    name: str
    store: Optional[str] = None
    text: Tuple[str, ...] = ()
    python_packages: Optional[Dict[str, Any]] = None  # {max_packages, max_bytes, max_doc_bytes}
    tokenizer: str = "bytes"
    text_field: str = "text"
    weight: float = 1.0
    min_length: int = 1
    max_length: Optional[int] = None
    workers: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", (self.text,) if isinstance(self.text, str) else tuple(self.text))
        object.__setattr__(self, "weight", float(self.weight))
        kinds = [self.store is not None, bool(self.text), self.python_packages is not None]
        if sum(kinds) != 1:
            raise ValueError(f"source {self.name!r}: give exactly one of store, text, python_packages")
        if not self.weight > 0:
            raise ValueError(f"source {self.name!r}: weight must be positive, got {self.weight}")
        if self.min_length < 1 or (self.max_length is not None and self.max_length < self.min_length):
            raise ValueError(f"source {self.name!r}: bad length filter [{self.min_length}, {self.max_length}]")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"source {self.name!r}: workers must be >= 1")

    @property
    def kind(self) -> str:
        return "store" if self.store is not None else "text"

    def accepts(self, length: int) -> bool:
        return length >= self.min_length and (self.max_length is None or length <= self.max_length)


@dataclass(frozen=True)
class CurriculumStage:
    """Until step ``until_step`` (exclusive; None: forever) documents are cut to ``max_length``."""

    until_step: Optional[int]
    max_length: int


@dataclass(frozen=True)
class MixingSpec:
    """Sources, weights, filters, curriculum, token budget and seed: the whole data recipe."""

    sources: Tuple[SourceSpec, ...]
    tokens_per_batch: Optional[int] = None
    seed: int = 0
    curriculum: Tuple[CurriculumStage, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("mixing spec: no source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"mixing spec: duplicate source names {names}")
        if self.tokens_per_batch is not None and self.tokens_per_batch <= 0:
            raise ValueError(f"mixing spec: tokens_per_batch must be positive, got {self.tokens_per_batch}")
        prev = -1
        for i, st in enumerate(self.curriculum):
            if st.max_length < 1:
                raise ValueError(f"mixing spec: curriculum stage {i} max_length must be >= 1")
            if st.until_step is None and i != len(self.curriculum) - 1:
                raise ValueError("mixing spec: only the last curriculum stage may omit until_step")
            if st.until_step is not None and st.until_step <= prev:
                raise ValueError("mixing spec: curriculum until_step must increase")
            prev = st.until_step if st.until_step is not None else prev

    @classmethod
    def from_dict(cls, d: Dict[str, Any], base_dir: Optional[Path] = None) -> "MixingSpec":
        """From a dict; relative paths resolve against ``base_dir``; text globs are expanded."""
        known = {"sources", "tokens_per_batch", "seed", "curriculum"}
        if set(d) - known:
            raise ValueError(f"mixing spec: unknown keys {sorted(set(d) - known)} (known: {sorted(known)})")
        srcs = []
        for i, s in enumerate(d.get("sources", [])):
            s = dict(s)
            s.setdefault("name", f"source{i}")
            fields = set(SourceSpec.__dataclass_fields__)
            if set(s) - fields:
                raise ValueError(f"mixing spec: source {s['name']!r} has unknown keys {sorted(set(s) - fields)}")
            if s.get("store") is not None:
                s["store"] = str(_resolve(s["store"], base_dir))
            if s.get("text"):
                items = [s["text"]] if isinstance(s["text"], str) else list(s["text"])
                paths: List[str] = []
                for t in items:
                    p = str(_resolve(t, base_dir))
                    hits = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
                    if not hits:
                        raise FileNotFoundError(f"mixing spec: source {s['name']!r}: no file matches {t}")
                    paths += hits
                s["text"] = tuple(paths)
            if s.get("tokenizer") not in (None, "bytes", "byte"):
                s["tokenizer"] = str(_resolve(s["tokenizer"], base_dir))
            srcs.append(SourceSpec(**s))
        cur = tuple(CurriculumStage(c.get("until_step"), int(c["max_length"])) for c in d.get("curriculum", []))
        return cls(tuple(srcs), d.get("tokens_per_batch"), int(d.get("seed", 0)), cur)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "MixingSpec":
        """From a ``.json`` or ``.toml`` file."""
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"mixing spec {p}: no such file")
        if p.suffix == ".toml":
            import tomllib

            d = tomllib.loads(p.read_text())
        else:
            d = json.loads(p.read_text())
        return cls.from_dict(d, p.parent)

    def to_dict(self) -> Dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    def longest(self) -> Optional[int]:
        """The longest document the spec can yield: its sources' ``max_length`` bounds, or a
        curriculum that caps the whole run (None: unbounded)."""
        maxes = [s.max_length for s in self.sources]
        longest = max(maxes) if all(m is not None for m in maxes) else None
        if self.curriculum and self.curriculum[-1].until_step is None:
            cap = max(st.max_length for st in self.curriculum)
            longest = min(longest, cap) if longest else cap
        return longest

    def cap(self, step: int) -> Optional[int]:
        """The curriculum's length cap at ``step`` (None: no cap)."""
        for st in self.curriculum:
            if st.until_step is None or step < st.until_step:
                return st.max_length
        return None


def _resolve(p: str, base: Optional[Path]) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() or base is None else base / q


class LengthNotReady(Exception):
    """The sampler needs the length of a document not tokenized yet."""

    def __init__(self, source: int, position: int) -> None:
        super().__init__(f"source {source}: length at stream position {position} not known yet")
        self.source, self.position = source, position


class MixingSampler:
    """Deterministic, resumable global batches over several sources (see the module docstring).

    Args:
        spec: the mixing spec.
        counts: number of documents of each source (known before any tokenization).
        tokens_per_batch, seed: the budget and seed (default: the spec's).

    :meth:`next_batch` takes ``length_of(source, position, local_id) -> int`` (``-1`` for a
    malformed document, which is skipped) and returns the batch, committing the state only if every
    length it needed was known (:class:`LengthNotReady` otherwise, the state unchanged). Sample ids
    are ``bases[source] + local id``: stable across runs and world sizes.
    """

    def __init__(self, spec: MixingSpec, counts: Sequence[int], tokens_per_batch: Optional[int] = None,
                 seed: Optional[int] = None) -> None:
        if len(counts) != len(spec.sources):
            raise ValueError("MixingSampler: one document count per source")
        for s, n in zip(spec.sources, counts):
            if n <= 0:
                raise ValueError(f"MixingSampler: source {s.name!r} has no document")
        self.spec = spec
        self.budget = int(tokens_per_batch if tokens_per_batch is not None else (spec.tokens_per_batch or 0))
        if self.budget <= 0:
            raise ValueError("MixingSampler: tokens_per_batch must be given (argument or spec) and positive")
        self.seed = int(spec.seed if seed is None else seed)
        self.counts = [int(n) for n in counts]
        self.bases = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64).tolist()
        w = np.asarray([s.weight for s in spec.sources], dtype=np.float64)
        self.weights = (w / w.sum()).tolist()
        self._perms: Dict[Tuple[int, int], np.ndarray] = {}
        self.step = 0
        self.positions = [0] * len(counts)
        self.drawn = [0] * len(counts)

    # -- stream of each source -------------------------------------------------------------------
    def local_id(self, source: int, position: int) -> int:
        """The document at ``position`` of a source's stream (epoch = position // count)."""
        epoch, off = divmod(position, self.counts[source])
        key = (source, epoch)
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) > 4 * len(self.counts):
                self._perms.clear()
            perm = np.random.default_rng([self.seed, source, epoch]).permutation(self.counts[source])
            self._perms[key] = perm
        return int(perm[off])

    def upcoming(self, source: int, start: int, count: int) -> List[Tuple[int, int]]:
        """(position, local id) of ``count`` stream positions from ``start``."""
        return [(p, self.local_id(source, p)) for p in range(start, start + count)]

    # -- batches ---------------------------------------------------------------------------------
    def next_batch(self, length_of: Callable[[int, int, int], int]) -> GlobalBatch:
        pos, drawn = list(self.positions), list(self.drawn)
        cap = self.spec.cap(self.step)
        ids: List[int] = []
        lens: List[int] = []
        srcs: List[int] = []
        total = 0
        rejected = [0] * len(pos)
        while True:
            T = float(sum(drawn))
            s = max(range(len(pos)), key=lambda i: (self.weights[i] * T - drawn[i], -i))
            lid = self.local_id(s, pos[s])
            n = int(length_of(s, pos[s], lid))
            if n <= 0 or not self.spec.sources[s].accepts(n):
                pos[s] += 1
                rejected[s] += 1
                if rejected[s] >= 2 * self.counts[s]:  # such a run of positions spans a whole epoch
                    raise RuntimeError(f"MixingSampler: source {self.spec.sources[s].name!r}: no document in a "
                                       "whole epoch passes its length filter or is well formed")
                continue
            rejected[s] = 0
            n = min(n, cap) if cap is not None else n
            if ids and total + n > self.budget:
                break
            ids.append(self.bases[s] + lid)
            lens.append(n)
            srcs.append(s)
            total += n
            drawn[s] += n
            pos[s] += 1
        batch = GlobalBatch(self.step, tuple(ids), tuple(lens), tuple(srcs))
        self.positions, self.drawn, self.step = pos, drawn, self.step + 1
        return batch

    def split(self, sample_id: int) -> Tuple[int, int]:
        """(source, local id) of a sample id."""
        s = int(np.searchsorted(self.bases, sample_id, side="right")) - 1
        if not 0 <= s < len(self.counts) or sample_id < 0:
            raise IndexError(f"sample id {sample_id} out of range [0, {self.bases[-1]})")
        return s, sample_id - self.bases[s]

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "positions": list(self.positions), "drawn": list(self.drawn)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if len(state["positions"]) != len(self.counts):
            raise ValueError(f"MixingSampler: state has {len(state['positions'])} sources, spec has {len(self.counts)}")
        self.step = int(state["step"])
        self.positions = [int(p) for p in state["positions"]]
        self.drawn = [int(t) for t in state["drawn"]]


def spec_fingerprint(spec: MixingSpec, counts: Sequence[int], tokens_per_batch: int, seed: int) -> str:
    """What a checkpoint must match to resume: the spec, the data sizes, the budget, the seed."""
    d = spec.to_dict()
    for src in d["sources"]:
        src.pop("workers", None)  # how many processes serve a source does not change its batches
    blob = json.dumps([d, list(map(int, counts)), int(tokens_per_batch), int(seed)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
