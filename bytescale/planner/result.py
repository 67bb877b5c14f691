"""The :class:`Plan` a planner call returns (a view of the C++ plan: arrays, per-rank micro-batches,
replays, lockstep slots)."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import _C
from .replay import PipelineReplay, Replay
from .types import DocRef, MicroBatchPlan
from .units import UnitMap

if TYPE_CHECKING:
    from ..parallel_dims import ParallelDims

__all__ = ["Plan"]


class Plan:
    """A step's plan (wraps the C++ Plan; its arrays are zero-copy read-only numpy views).

    Each rank's micro-batches are listed in execution order (local ones may sit between ring ones);
    every member lists a group's ring micro-batches in the same relative order (global ring id).
    """

    def __init__(self, cplan: "_C.planner.Plan", lengths: Optional[np.ndarray] = None,
                 units: Optional[UnitMap] = None, options: Optional["_C.planner.PlanOptions"] = None,
                 dims: Optional["ParallelDims"] = None) -> None:
        self._p = cplan
        self._options = options
        self.dims = dims
        """The job's :class:`~bytescale.parallel_dims.ParallelDims` when planned from them (else None)."""
        if lengths is None:  # every token is held exactly once: lengths are the segments' sums
            lengths = np.bincount(np.asarray(cplan.seg_seq), weights=np.asarray(cplan.seg_tokens),
                                  minlength=int(cplan.num_sequences)).astype(np.int64)
        self.lengths = lengths
        self.units = self.check_units(units, cplan.world_size)

    @staticmethod
    def check_units(units: Optional[UnitMap], world_size: int) -> UnitMap:
        """``units`` (default: one rank per unit) checked against a plan of ``world_size`` units."""
        if units is None:
            return UnitMap.identity(world_size)
        if not isinstance(units, UnitMap):
            raise TypeError(f"Plan: units must be a bytescale.planner.UnitMap, got {type(units).__name__}")
        if units.num_units != world_size:
            raise ValueError(f"Plan: the plan is for {world_size} HDP units but the unit map has "
                             f"{units.num_units} ({units.describe()})")
        return units

    def with_units(self, units: Optional[UnitMap]) -> "Plan":
        """The same plan over another map of its units to global ranks."""
        return Plan(self._p, self.lengths, units, self._options)

    # predictions (the default cost model's, or the profile's)
    @property
    def makespan(self) -> float:
        """Predicted synchronised step time (s): the plan replayed in the runtime's model."""
        return self._p.makespan

    @property
    def max_busy(self) -> float:
        """The busiest rank's sum of micro-batch costs (the step if no rank ever waited)."""
        return self._p.max_busy

    @property
    def imbalance(self) -> float:
        """Predicted step time / mean per-rank busy time."""
        return self._p.imbalance

    @property
    def lower_bound(self) -> float:
        """No plan can beat it: max(total work / total speed, largest indivisible piece), each
        sequence at its best ring size with communication (cost model's ``sharded_time``)."""
        return self._p.lower_bound

    @property
    def bound_parts(self) -> Dict[str, float]:
        """The lower bound's parts (seconds): ``work`` (total work / total speed), ``piece`` (the
        longest sequence at its best ring size) and ``waves`` (wide rings that cannot all run at
        once); ``lower_bound`` is their maximum."""
        p = self._p
        return {"work": p.bound_work, "piece": p.bound_piece, "waves": p.bound_waves}

    @property
    def bound_ratio(self) -> float:
        """``makespan / lower_bound`` (1.0 = provably optimal under the cost model)."""
        return self._p.makespan / self._p.lower_bound if self._p.lower_bound > 0 else 1.0

    @property
    def rank_cost(self) -> np.ndarray:
        """Per-rank busy time: the sum of the rank's micro-batch costs."""
        return self._p.rank_cost

    busy = rank_cost

    @property
    def rank_finish(self) -> np.ndarray:
        """When each rank finishes its last micro-batch (replayed)."""
        return self._p.rank_finish

    def idle(self, rank: Optional[int] = None) -> Union[float, np.ndarray]:
        """Idle time of ``rank`` (or of every rank): ``makespan - busy``, i.e. waits for ring
        partners plus the time after the rank's last micro-batch."""
        idle = self._p.rank_idle
        if rank is None:
            return idle
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside [0, {self.world_size})")
        return float(idle[rank])

    @property
    def world_size(self) -> int:
        return self._p.world_size

    @property
    def strategy(self) -> str:
        """The strategy that built this plan: ``"pow2"`` when ``"balanced"`` kept the power-of-two
        plan because it replays shorter."""
        return self._p.strategy

    # pipelines (pp > 1)
    @property
    def pp(self) -> int:
        """The pipeline depth the plan was made for (1: no pipeline parallelism)."""
        return int(self._p.pp)

    @property
    def pipelined(self) -> bool:
        """Whether the micro-batches carry pipeline slots (``pp`` > 1 or a ``pp-*`` strategy)."""
        return bool(self._p.pipelined)

    @property
    def slots(self) -> np.ndarray:
        """Per micro-batch (indexed like ``raw.mb_cost``) its 1F1B schedule slot in its pipeline:
        increasing along a pipeline's list (a gap is an empty slot), a ring's members hold it at
        the same slot. Empty for a plan without pipelines."""
        return self._p.mb_slot

    def micro_batch_slots(self, rank: int) -> List[int]:
        """The 1F1B slots of global rank ``rank``'s micro-batches (those of its unit, in the order of
        :meth:`micro_batches`); a pipeline's stage runs slot k's forward and backward where 1F1B
        puts slot k, skipping the empty slots between them. ValueError for a plan without slots."""
        if not self.pipelined:
            raise ValueError("Plan.micro_batch_slots: the plan has no pipeline slots (made with pp = 1 and a "
                             "strategy other than pp-balance / pp-lockstep)")
        unit = rank if self.units.is_identity else self.units.unit_of(rank)
        if not 0 <= unit < self.world_size:
            raise IndexError(f"Plan.micro_batch_slots: rank {rank} outside [0, {self.world_size})")
        rank_mb = self._p.rank_mb
        return self.slots[int(rank_mb[unit]):int(rank_mb[unit + 1])].tolist()

    def check_pp(self, stages: int) -> None:
        """Raises ValueError naming both depths when the plan was made for another pipeline depth
        than ``stages`` (what a runtime of ``stages`` stages calls before executing it)."""
        _C.planner.check_pipeline_depth(self._p, int(stages))

    def pipeline_replay(self, fwd: Optional[np.ndarray] = None, bwd: Optional[np.ndarray] = None,
                        p2p: Optional[Sequence[float]] = None) -> PipelineReplay:
        """Replays a pipelined plan under 1F1B: its own predictions by default, or per micro-batch
        and stage ``fwd`` / ``bwd`` seconds (``[micro-batches, stages]``) with per micro-batch
        stage-to-stage transfer seconds ``p2p`` (all three together).

        Raises:
            ValueError: the plan has no pipeline slots, or malformed durations.
        """
        if fwd is None and bwd is None and p2p is None:
            return PipelineReplay._wrap(_C.planner.pipeline_replay(self._p))
        if fwd is None or bwd is None or p2p is None:
            raise ValueError("pipeline_replay: give fwd, bwd and p2p together (or none of them)")
        arrs = [np.ascontiguousarray(x, dtype=np.float64).reshape(-1) for x in (fwd, bwd, p2p)]
        return PipelineReplay._wrap(_C.planner.pipeline_replay(self._p, *arrs))

    @property
    def bubble(self) -> float:
        """The pipelined step's idle share over every stage (:class:`PipelineReplay`); for a plan
        without pipelines, the idle share of the flat step (``idle().sum() / (world x makespan)``)."""
        if self.pipelined:
            return self.pipeline_replay().bubble
        m = self.makespan
        return float(np.asarray(self.idle()).sum() / (self.world_size * m)) if m > 0 else 0.0

    @property
    def raw(self) -> "_C.planner.Plan":
        """The C++ plan (flat arrays: rank_mb, mb_seg, mb_ring, ring_grp, grp_ranks, seg_seq, ...)."""
        return self._p

    def replay(self, durations: Optional[Sequence[float]] = None) -> Replay:
        """Replays the plan with per-micro-batch ``durations`` (indexed like ``raw.mb_cost``;
        default: the cost model's ``mb_cost``), e.g. measured or simulated times.

        Raises:
            ValueError: wrong number of durations, a negative/NaN duration, or an order that
                deadlocks (never for plans made by :func:`plan`).
        """
        d = None if durations is None else np.ascontiguousarray(durations, dtype=np.float64)
        return Replay._wrap(_C.planner.replay(self._p, d))

    def lockstep(self) -> np.ndarray:
        """FSDP2 lockstep slots: int64 ``[world_size, slots]`` of micro-batch indices (into the
        plan's flat micro-batch arrays), -1 for an empty padding slot. Ring members meet in the
        same slot; rings keep the plan's order, locals fill the remaining slots in order."""
        return _C.planner.lockstep(self._p)

    def lockstep_micro_batches(self, rank: int, sample_ids: Optional[Sequence[int]] = None,
                               group: int = 0) -> List[MicroBatchPlan]:
        """Global rank ``rank``'s micro-batches by lockstep slot (:meth:`lockstep`, slots of its
        unit): an empty :class:`MicroBatchPlan` for a padding slot; ``index`` is the slot.

        ``group`` > 0: the slots are agreed within blocks of ``group`` consecutive HDP units (the
        expert-parallel groups, :meth:`group_lockstep`) instead of the whole world."""
        unit = self.units.unit_of(rank)
        slots = self.group_lockstep(group) if group else self.lockstep()
        mine = self.micro_batches(rank, sample_ids)
        base = int(self._p.rank_mb[unit])
        count = _C.planner.group_slots(slots, group).tolist()

        def last_on_all(mb: MicroBatchPlan, k: int) -> bool:
            # ring members meet in one slot: it ends every member's step when it is each one's last
            return bool(mb.ring) and all(k == count[self.units.unit_of(r)] - 1 for r in mb.ring)

        return [MicroBatchPlan(rank, k) if m < 0 else
                replace(mine[int(m) - base], index=k, ring_is_last_on_all=last_on_all(mine[int(m) - base], k))
                for k, m in enumerate(slots[unit].tolist()) if k < count[unit]]

    def group_lockstep(self, group: int) -> np.ndarray:
        """Lockstep slots for expert parallelism: int64 ``[units, slots]`` as :meth:`lockstep`, but
        each block of ``group`` consecutive HDP units (an expert-parallel group, whose all-to-alls
        need all its members in every micro-batch) runs only up to its own last real slot; the
        columns past it are -1 for the block (:meth:`group_slots` gives each unit's count). Each
        unit's local micro-batches take its free slots costliest first (by ``mb_cost``; ties by
        index), so that a slot, which lasts as long as its slowest member, joins micro-batches of
        like cost.

        Every unit of a block runs the same number of slots; ring micro-batches keep their common
        slot on all members (so the rings of slot k and the all-to-alls of slot k never wait on one
        another across slots: no cycle, hence no hang). Raises ValueError when ``group`` does not
        divide the number of units.
        """
        return _C.planner.group_lockstep(self._p, int(group))

    def group_slots(self, group: int) -> np.ndarray:
        """Slots each unit runs under :meth:`group_lockstep` (the same within a block)."""
        return _C.planner.group_slots(self.group_lockstep(group), int(group))

    def ep_replay(self, group: int, durations: Optional[Sequence[float]] = None) -> Replay:
        """The plan replayed as expert parallelism runs it (``_C.planner.ep_replay`` on
        :meth:`group_lockstep`: EP blocks advance slot by slot together, a ring joins its members'
        blocks, a slot lasts as long as its slowest micro-batch); ``durations`` as in
        :meth:`replay`. Compare ``step_time`` with :meth:`replay`'s: the difference is what the EP
        rule costs on this plan."""
        d = None if durations is None else np.ascontiguousarray(durations, dtype=np.float64)
        return Replay._wrap(_C.planner.ep_replay(self._p, int(group), d))

    def num_micro_batches(self, rank: Optional[int] = None) -> Union[int, np.ndarray]:
        counts = np.diff(self._p.rank_mb)
        return counts if rank is None else int(counts[rank])

    def micro_batches(self, rank: int, sample_ids: Optional[Sequence[int]] = None) -> List[MicroBatchPlan]:
        """Global rank ``rank``'s micro-batches in execution order, read straight from the plan's
        arrays: those of its HDP unit, each ring over the ranks of its TP index (a pipelined
        plan's with their 1F1B ``slot``).

        ``sample_ids`` (the batch's dataset ids, by position) fills each document's ``sample_id``.
        """
        p = self._p
        if self.units.is_identity:
            if not 0 <= rank < p.world_size:
                raise IndexError(f"Plan.micro_batches: rank {rank} outside [0, {p.world_size})")
            unit, tp_index = rank, 0
        else:
            unit, tp_index = self.units.locate(rank)
        units = self.units
        lengths = self.lengths
        rank_mb, mb_seg = p.rank_mb, p.mb_seg
        seg_seq, seg_size, seg_pos = p.seg_seq, p.seg_ring_size, p.seg_ring_pos
        grp, ring_grp, ring_ids, ratio, cost = p.grp_ranks, p.ring_grp, p.mb_ring, p.mb_offload, p.mb_cost
        last_ring = self._last_ring_of_each_rank()
        slot = np.asarray(p.mb_slot) if self.pipelined else None
        out = []
        for i, m in enumerate(range(int(rank_mb[unit]), int(rank_mb[unit + 1]))):
            local, sharded, pos = [], [], 0
            for k in range(int(mb_seg[m]), int(mb_seg[m + 1])):
                bp = int(seg_seq[k])
                ref = DocRef(bp, -1 if sample_ids is None else int(sample_ids[bp]), int(lengths[bp]))
                if seg_size[k] > 1 or ring_ids[m] >= 0:
                    sharded.append(ref)
                    pos = int(seg_pos[k])
                else:
                    local.append(ref)
            rid = int(ring_ids[m])
            ring_units = [] if rid < 0 else grp[int(ring_grp[rid]):int(ring_grp[rid + 1])].tolist()
            ring = () if rid < 0 else units.ring(ring_units, tp_index)
            out.append(MicroBatchPlan(rank=rank, index=i, local=tuple(local), sharded=tuple(sharded),
                                      ring=ring, ring_pos=pos, ring_id=int(ring_ids[m]),
                                      offload_ratio=float(ratio[m]), predicted_time=float(cost[m]),
                                      ring_is_last_on_all=bool(ring) and all(last_ring[u] == rid for u in ring_units),
                                      slot=-1 if slot is None else int(slot[m])))
        return out

    def _last_ring_of_each_rank(self) -> List[int]:
        """Per HDP unit (the planner's ranks), the ring id of its last micro-batch (-1: a local
        one, -2: none)."""
        p = self._p
        rank_mb, ring_ids = np.asarray(p.rank_mb), np.asarray(p.mb_ring)
        return [int(ring_ids[rank_mb[r + 1] - 1]) if rank_mb[r + 1] > rank_mb[r] else -2
                for r in range(p.world_size)]

    def ring_sizes(self) -> Dict[int, int]:
        """Sequence index -> number of ranks it is sharded over (sharded sequences only)."""
        p = self._p
        sizes = np.asarray(p.seg_ring_size)
        sel = np.nonzero(sizes > 1)[0]
        return {int(k): int(v) for k, v in zip(np.asarray(p.seg_seq)[sel], sizes[sel])}

    def ring_reasons(self) -> List[Dict[str, Any]]:
        """Per sequence (batch order), why its ring has its size and offload ratio
        (csrc/planner/offload_rule.h): ``ranks``, ``ratio``, ``floor_memory`` (ranks without
        offloading), ``floor_offload`` (the paper's Eq. 3 minimum when offloading) and ``reason``:

        ``"local"`` (fits one rank), ``"memory"`` (the memory floor), ``"copy-hiding"`` (a smaller
        ring would need copies that do not hide under the sequence's compute), ``"step"`` (memory
        and copies allow a smaller ring but it would lengthen the step, or the strategy sized the
        ring by time) or ``"shape"`` (pow2's power-of-two rounding, static's CP degree).

        Raises:
            ValueError: the plan was not made by :func:`plan` (e.g. :meth:`from_bytes`): its
                options are unknown.
        """
        if self._options is None:
            raise ValueError("Plan.ring_reasons: this plan does not carry its planner options "
                             "(made by Plan.from_bytes?); plan with bytescale.plan(...)")
        rows = _C.planner.explain_rings(self._p, self.lengths.tolist(), self._options)
        return [{"ranks": r, "ratio": q, "floor_memory": fm, "floor_offload": fo, "reason": why}
                for r, q, fm, fo, why in rows]

    def to_bytes(self) -> bytes:
        return self._p.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Plan":
        return cls(_C.planner.Plan.from_bytes(data))

    def summary(self) -> str:
        mbs = self.num_micro_batches()
        rings = self.ring_sizes()
        where = (f"ranks={self.world_size}" if self.units.tp == 1 else
                 f"units={self.world_size} x tp={self.units.tp}")
        if self.pp > 1:
            where = f"pipelines of {self.pp} stages: {where} (bubble {self.bubble:.3f})"
        return (f"plan[{self.strategy}] {where} micro-batches/{'rank' if self.units.tp == 1 else 'unit'} "
                f"min={int(mbs.min()) if len(mbs) else 0} max={int(mbs.max()) if len(mbs) else 0} "
                f"sharded={len(rings)} ring sizes={sorted(rings.values(), reverse=True)[:8]} "
                f"predicted step={self.makespan * 1e3:.2f} ms (busiest rank {self.max_busy * 1e3:.2f} ms, "
                f"lower bound {self.lower_bound * 1e3:.2f} ms, x{self.bound_ratio:.3f}) "
                f"imbalance={self.imbalance:.3f}")

    def __repr__(self) -> str:
        return self.summary()
