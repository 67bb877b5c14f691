"""The micro-batch contract: one rank's micro-batch as the planner made it, the same object from
the plan to the loader, the runtime and the attention kernel.

Built straight from the C++ plan's flat arrays (:meth:`bytescale.planner.Plan.micro_batches`),
frozen, and serialisable (:meth:`MicroBatchPlan.to_bytes`) so it can cross processes (a data
service sending each rank its micro-batches). Its :attr:`~MicroBatchPlan.layout` is the attention
layout; the token order it implies (local documents whole, then each sharded document's two
zig-zag chunks) is the order the loader materialises.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Sequence, Tuple

from ..attention import zigzag
from ..attention.layout import Layout

__all__ = ["DocRef", "MicroBatchPlan"]

_FORMAT = "bytescale.MicroBatchPlan/2"
_FORMATS = (_FORMAT, "bytescale.MicroBatchPlan/1")  # /1: before ``slot`` (it reads as -1)


@dataclass(frozen=True)
class DocRef:
    """One document of a micro-batch.

    ``batch_pos``: position in the step's global batch (what the planner indexes);
    ``sample_id``: stable id in the dataset (-1 until the plan is bound to a batch);
    ``length``: the document's full length in tokens.
    """

    batch_pos: int
    sample_id: int
    length: int


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch of one rank, in the rank's execution order (``index``).

    ``local``: whole documents. ``sharded``: documents sharded zig-zag over ``ring`` (ordered global
    ranks), this rank at ``ring_pos``; ``ring_id`` is the ring's place in the step's one global ring
    order (-1 for a local micro-batch). ``offload_ratio``: share of the micro-batch's activations
    to move to host memory (paper Eq. 3). ``predicted_time``: the planner's cost-model time (s).
    ``slot``: its slot in the step's schedule (a pipeline's 1F1B slot, set by the planner for a
    pipelined plan; a lockstep slot, set by :func:`bytescale.runtime.schedule.build_schedule`), -1
    for none. ``ring_is_last_on_all``: a ring micro-batch that EVERY member of its ring runs as its last
    micro-batch of the step. Gradient sync may then start during its backward (on one NCCL stream
    every member queues it at the same point between the ring's exchanges); when some member still
    has micro-batches after the ring, it must wait for the backward's end, or the gradient
    all-reduce and the ring's exchanges form a cycle (:class:`bytescale.HybridDataParallel`).
    """

    rank: int
    index: int
    local: Tuple[DocRef, ...] = ()
    sharded: Tuple[DocRef, ...] = ()
    ring: Tuple[int, ...] = ()
    ring_pos: int = 0
    ring_id: int = -1
    offload_ratio: float = 0.0
    predicted_time: float = 0.0
    ring_is_last_on_all: bool = False
    slot: int = -1

    def __post_init__(self) -> None:
        if self.sharded and not self.ring:
            raise ValueError(f"MicroBatchPlan: rank {self.rank} micro-batch {self.index} has sharded "
                             "documents but no ring")
        if self.ring and (not 0 <= self.ring_pos < len(self.ring) or self.ring[self.ring_pos] != self.rank):
            raise ValueError(f"MicroBatchPlan: rank {self.rank} is not at position {self.ring_pos} of "
                             f"ring {list(self.ring)}")
        if not 0.0 <= self.offload_ratio <= 1.0:
            raise ValueError(f"MicroBatchPlan: offload_ratio {self.offload_ratio} outside [0, 1]")

    @property
    def is_ring(self) -> bool:
        return bool(self.ring)

    @property
    def is_empty(self) -> bool:
        """A padding slot (lockstep schedules): no document."""
        return not self.local and not self.sharded

    @property
    def documents(self) -> Tuple[DocRef, ...]:
        """Every document, in token order (local first)."""
        return self.local + self.sharded

    @cached_property
    def num_tokens(self) -> int:
        """Tokens this rank holds in the micro-batch (computed once)."""
        n = len(self.ring)
        return sum(d.length for d in self.local) + sum(
            zigzag.local_tokens(d.length, n, self.ring_pos) for d in self.sharded)

    def token_ranges(self) -> Tuple[Tuple[DocRef, int, int], ...]:
        """(document, start, end) ranges of the tokens this rank holds, in token order."""
        out = [(d, 0, d.length) for d in self.local]
        n = len(self.ring)
        for d in self.sharded:
            out.extend((d, a, b) for a, b in zigzag.local_ranges(d.length, n, self.ring_pos))
        return tuple(out)

    def layout(self, bf16_grad_comm: bool = False) -> Layout:
        """The attention layout of this micro-batch."""
        return Layout(tuple(d.length for d in self.local), tuple(d.length for d in self.sharded),
                      self.ring, self.ring_pos, bf16_grad_comm)

    def bind(self, sample_ids: Sequence[int]) -> "MicroBatchPlan":
        """The same plan with every document's ``sample_id`` set from the batch's ids (by position)."""
        def b(docs):
            return tuple(replace(d, sample_id=int(sample_ids[d.batch_pos])) for d in docs)

        return replace(self, local=b(self.local), sharded=b(self.sharded))

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["format"] = _FORMAT
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "MicroBatchPlan":
        try:
            d = json.loads(bytes(data).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"MicroBatchPlan.from_bytes: not a serialised micro-batch plan ({e})") from None
        if not isinstance(d, dict) or d.pop("format", None) not in _FORMATS:
            raise ValueError(f"MicroBatchPlan.from_bytes: expected format {_FORMAT!r}")
        try:
            docs = {k: tuple(DocRef(**x) for x in d.pop(k)) for k in ("local", "sharded")}
            mb = cls(ring=tuple(d.pop("ring")), **docs, **d)
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"MicroBatchPlan.from_bytes: malformed fields ({e})") from None
        mb._check_types()
        return mb

    def _check_types(self) -> None:
        """Every field of the right type and range (what the constructor does not re-check on the
        planner's hot path): for plans that crossed a process boundary."""
        def bad(field: str, value) -> None:
            raise ValueError(f"MicroBatchPlan.from_bytes: {field} = {value!r} is invalid")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for name in ("rank", "index", "ring_pos"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, getattr(self, name))
        for name in ("ring_id", "slot"):
            if not is_int(getattr(self, name)) or getattr(self, name) < -1:
                bad(name, getattr(self, name))
        if not all(is_int(r) and r >= 0 for r in self.ring) or len(set(self.ring)) != len(self.ring):
            bad("ring", self.ring)
        if not isinstance(self.ring_is_last_on_all, bool):
            bad("ring_is_last_on_all", self.ring_is_last_on_all)
        for name in ("offload_ratio", "predicted_time"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                bad(name, v)
        for kind, docs in (("local", self.local), ("sharded", self.sharded)):
            for j, doc in enumerate(docs):
                if not is_int(doc.batch_pos) or doc.batch_pos < 0:
                    bad(f"{kind}[{j}].batch_pos", doc.batch_pos)
                if not is_int(doc.sample_id) or doc.sample_id < -1:
                    bad(f"{kind}[{j}].sample_id", doc.sample_id)
                if not is_int(doc.length) or doc.length < 1:
                    bad(f"{kind}[{j}].length", doc.length)
