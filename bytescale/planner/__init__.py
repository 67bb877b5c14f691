"""Python face of the C++ HDP planner (csrc/planner/).

    plan = bytescale.plan(lengths, world_size=64, capacity=16384)
    plan.imbalance                 # predicted max/mean rank time
    plan.micro_batches(rank)       # this rank's micro-batches (MicroBatchPlan), in execution order

Strategies: ``"balanced"`` (ours: time-balanced, D(s) chosen by cost as well as memory, speed-aware
LPT for short sequences), ``"naive"`` (the paper's Alg. 1: memory-driven, token-balanced) and
``"pow2"`` (Megatron-style dynamic CP: D rounded up to a power of two) for comparison.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import _C

from .types import DocRef, MicroBatchPlan

__all__ = ["CostModel", "Plan", "DocRef", "MicroBatchPlan", "load_cost_model", "plan", "profile"]

CostModel = _C.planner.CostModel


def load_cost_model(source: Union[str, os.PathLike, Dict[str, Any], None] = None) -> CostModel:
    """A cost model from a JSON profile path, a dict of coefficients, or the defaults (None)."""
    if source is None:
        return CostModel()
    if isinstance(source, dict):
        return CostModel.from_json(json.dumps(source))
    with open(source) as f:
        return CostModel.from_json(f.read())


class Plan:
    """A step's plan (wraps the C++ Plan; its arrays are zero-copy read-only numpy views)."""

    def __init__(self, cplan: "_C.planner.Plan", lengths: Optional[np.ndarray] = None) -> None:
        self._p = cplan
        if lengths is None:  # every token is held exactly once: lengths are the segments' sums
            lengths = np.bincount(np.asarray(cplan.seg_seq), weights=np.asarray(cplan.seg_tokens),
                                  minlength=int(cplan.num_sequences)).astype(np.int64)
        self.lengths = lengths

    # predictions
    @property
    def imbalance(self) -> float:
        """Predicted max / mean rank time."""
        return self._p.imbalance

    @property
    def makespan(self) -> float:
        return self._p.makespan

    @property
    def lower_bound(self) -> float:
        """max(total work / total speed, largest indivisible piece) under the cost model."""
        return self._p.lower_bound

    @property
    def rank_cost(self) -> np.ndarray:
        return self._p.rank_cost

    @property
    def world_size(self) -> int:
        return self._p.world_size

    @property
    def strategy(self) -> str:
        return self._p.strategy

    @property
    def raw(self) -> "_C.planner.Plan":
        """The C++ plan (flat arrays: rank_mb, mb_seg, mb_grp, seg_seq, ...)."""
        return self._p

    def num_micro_batches(self, rank: Optional[int] = None) -> Union[int, np.ndarray]:
        counts = np.diff(self._p.rank_mb)
        return counts if rank is None else int(counts[rank])

    def micro_batches(self, rank: int, sample_ids: Optional[Sequence[int]] = None) -> List[MicroBatchPlan]:
        """Rank ``rank``'s micro-batches in execution order, read straight from the plan's arrays.

        ``sample_ids`` (the batch's dataset ids, by position) fills each document's ``sample_id``.
        """
        p = self._p
        if not 0 <= rank < p.world_size:
            raise IndexError(f"Plan.micro_batches: rank {rank} outside [0, {p.world_size})")
        lengths = self.lengths
        rank_mb, mb_seg, mb_grp = p.rank_mb, p.mb_seg, p.mb_grp
        seg_seq, seg_size, seg_pos = p.seg_seq, p.seg_ring_size, p.seg_ring_pos
        grp, ring_ids, ratio, cost = p.grp_ranks, p.mb_ring, p.mb_offload, p.mb_cost
        out = []
        for i, m in enumerate(range(int(rank_mb[rank]), int(rank_mb[rank + 1]))):
            local, sharded, pos = [], [], 0
            for k in range(int(mb_seg[m]), int(mb_seg[m + 1])):
                bp = int(seg_seq[k])
                ref = DocRef(bp, -1 if sample_ids is None else int(sample_ids[bp]), int(lengths[bp]))
                if seg_size[k] > 1 or mb_grp[m + 1] > mb_grp[m]:
                    sharded.append(ref)
                    pos = int(seg_pos[k])
                else:
                    local.append(ref)
            ring = tuple(int(r) for r in grp[int(mb_grp[m]):int(mb_grp[m + 1])])
            out.append(MicroBatchPlan(rank=rank, index=i, local=tuple(local), sharded=tuple(sharded),
                                      ring=ring, ring_pos=pos, ring_id=int(ring_ids[m]),
                                      offload_ratio=float(ratio[m]), predicted_time=float(cost[m])))
        return out

    def ring_sizes(self) -> Dict[int, int]:
        """Sequence index -> number of ranks it is sharded over (sharded sequences only)."""
        p = self._p
        out: Dict[int, int] = {}
        for k in range(len(p.seg_seq)):
            if p.seg_ring_size[k] > 1:
                out[int(p.seg_seq[k])] = int(p.seg_ring_size[k])
        return out

    def to_bytes(self) -> bytes:
        return self._p.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Plan":
        return cls(_C.planner.Plan.from_bytes(data))

    def summary(self) -> str:
        mbs = self.num_micro_batches()
        rings = self.ring_sizes()
        return (f"plan[{self.strategy}] ranks={self.world_size} micro-batches/rank "
                f"min={int(mbs.min()) if len(mbs) else 0} max={int(mbs.max()) if len(mbs) else 0} "
                f"sharded={len(rings)} ring sizes={sorted(rings.values(), reverse=True)[:8]} "
                f"predicted imbalance={self.imbalance:.3f} makespan={self.makespan * 1e3:.2f} ms "
                f"lower bound={self.lower_bound * 1e3:.2f} ms")

    def __repr__(self) -> str:
        return self.summary()


def _options(world_size: int, capacity: int, strategy: str, offload: bool, cost: Any,
             speed: Optional[Sequence[float]], memory: Optional[Sequence[float]]) -> "_C.planner.PlanOptions":
    o = _C.planner.PlanOptions()
    o.world_size = int(world_size)
    o.capacity = int(capacity)
    o.strategy = strategy
    o.offload = bool(offload)
    o.cost = cost if isinstance(cost, CostModel) else load_cost_model(cost)
    if speed is not None:
        o.speed = [float(x) for x in speed]
    if memory is not None:
        o.memory = [float(x) for x in memory]
    return o


def plan(
    lengths: Sequence[int],
    world_size: int,
    capacity: int,
    strategy: str = "balanced",
    offload: bool = False,
    cost: Any = None,
    speed: Optional[Sequence[float]] = None,
    memory: Optional[Sequence[float]] = None,
    verify: bool = False,
) -> Plan:
    """Plan one global batch.

    Args:
        lengths: sequence lengths (positive ints), in batch order; plans refer to positions.
        world_size: HDP ranks.
        capacity: tokens per micro-batch per rank (before ``memory`` multipliers).
        strategy: "balanced" | "naive" | "pow2".
        offload: let long sequences offload activations (paper Eq. 3) to use fewer ranks.
        cost: a CostModel, a JSON profile path, a dict of coefficients, or None (defaults).
        speed: per-rank relative speeds (heterogeneous clusters).
        memory: per-rank capacity multipliers.
        verify: re-check every invariant in C++ after planning (tests, debugging).
    Raises:
        ValueError: bad input (non-positive lengths, a sequence needing more ranks than exist, ...).
    """
    arr = np.ascontiguousarray(np.asarray(lengths, dtype=np.int64).reshape(-1))
    opts = _options(world_size, capacity, strategy, offload, cost, speed, memory)
    p = Plan(_C.planner.make_plan(arr, opts), arr)
    if verify:
        p.raw.verify(arr.tolist(), opts)
    return p


from .profile import profile  # noqa: E402  (measures this cost model on a device)
