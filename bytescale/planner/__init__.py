"""Python face of the C++ HDP planner (csrc/planner/).

    plan = bytescale.plan(lengths, world_size=64, capacity=16384)
    plan.makespan                  # predicted synchronised step time (s)
    plan.makespan / plan.lower_bound
    plan.idle()                    # per-rank idle time (waiting for ring partners + tail)
    plan.micro_batches(rank)       # this rank's micro-batches (MicroBatchPlan), in execution order
    plan.replay(durations)         # the same plan replayed with other micro-batch durations

The model of a step (the runtime executes exactly this, and the planner optimises it): every rank
runs its micro-batches in the plan's order; a local micro-batch starts when its rank is free; a ring
micro-batch starts only when all members of its group are free and ends on all of them together.

With tensor parallelism the planner's ranks are HDP *units* (:class:`UnitMap`): a plan carries the
map from unit to global ranks, ``plan.micro_batches(rank)`` takes a GLOBAL rank and returns its
unit's micro-batches with each ring translated to the ranks of that rank's TP index. Everything
indexed by rank in the plan's arrays (``idle``, ``rank_cost``, ``num_micro_batches``,
``world_size``) is indexed by unit.

Strategies: ``"balanced"`` (ours, sync-aware: rings placed on a timeline of when ranks become free,
any-integer ring sizes chosen by cost, short sequences fitted into the waits and tails; never worse
than pow2 under the replay; small instances refined by a budgeted search over list schedules),
``"naive"`` (the paper's Alg. 1: memory-driven, token-balanced),
``"pow2"`` (Megatron-style dynamic CP: D rounded up to a power of two) and ``"static"`` (the static
DP x CP baseline: one CP degree, :func:`static_cp_degree` or ``static_cp``, every sequence sharded
over its replica's CP group, several sequences packed into one ring micro-batch) for comparison.
Every strategy returns the same :class:`Plan`.

Pipeline parallelism (``pp=P`` > 1, csrc/planner/pipeline.h): the plan's ranks are PIPELINES of HDP
units (the units of one stage; pipeline ``h`` is unit ``h`` of every stage), the cost model's
``layers`` are one stage's (:func:`stage_layers`), and every micro-batch carries a schedule slot
(:attr:`Plan.slots`): each stage runs its pipeline's slots under 1F1B, a ring micro-batch sits at the
same slot on all its member pipelines. ``plan.makespan`` is then the 1F1B replay's step, bubbles
included (:meth:`Plan.pipeline_replay`). Strategies ``"pp-balance"`` (the paper's PP-Balance: one
length level per pipeline, cheaper levels get more micro-batches, all pipelines end together) and
``"pp-lockstep"`` (Megatron's lockstep slots: every pipeline the same count) plan for pipelines;
the other strategies keep their per-pipeline order, slotted.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import _C

from .types import DocRef, MicroBatchPlan
from .units import UnitMap

__all__ = ["CostModel", "Plan", "DocRef", "MicroBatchPlan", "PipelineReplay", "Replay", "UnitMap",
           "load_cost_model", "plan", "profile", "stage_layers", "static_cp_degree", "schedule_lockstep",
           "sort_local_slots", "ep_slot_replay", "longest_document", "documents_fit"]

CostModel = _C.planner.CostModel


def load_cost_model(source: Union[str, os.PathLike, Dict[str, Any], None] = None) -> CostModel:
    """A cost model from a JSON profile path, a dict of coefficients, or the defaults (None).

    Missing coefficients keep their defaults; a malformed profile (bad JSON, a coefficient that is
    not a number, NaN, infinite or negative) raises ValueError naming the file or the field.
    """
    if source is None:
        return CostModel()
    if isinstance(source, dict):
        try:
            text = json.dumps(source)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cost model: the coefficients {source!r} are not JSON numbers ({e})") from None
        return CostModel.from_json(text)
    with open(source, "rb") as f:
        raw = f.read()
    try:
        return CostModel.from_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cost model profile {os.fspath(source)!r}: {e}") from None


@dataclass(frozen=True)
class Replay:
    """A plan replayed in the runtime's model of a step (:meth:`Plan.replay`).

    ``start``/``end``: per micro-batch (indexed like ``Plan.raw.mb_cost``); ``rank_finish``: end of
    each rank's last micro-batch; ``rank_busy``: time inside micro-batches; ``rank_idle``:
    ``step_time - rank_busy``; ``step_time``: the step's end (max of ``rank_finish``). Arrays are
    read-only float64.
    """

    start: np.ndarray
    end: np.ndarray
    rank_finish: np.ndarray
    rank_busy: np.ndarray
    rank_idle: np.ndarray
    step_time: float

    @classmethod
    def _wrap(cls, r: "_C.planner.ReplayResult") -> "Replay":
        return cls(r.mb_start, r.mb_end, r.rank_finish, r.rank_busy, r.rank_idle, float(r.step_time))


@dataclass(frozen=True)
class PipelineReplay:
    """A pipelined plan replayed under 1F1B (:meth:`Plan.pipeline_replay`).

    ``fwd_start`` ... ``bwd_end``: float64 ``[micro-batches, stages]`` (micro-batches indexed like
    ``Plan.raw.mb_cost``); ``pipe_finish``: per pipeline, the end of its last operation;
    ``stage_busy``: ``[pipelines, stages]`` time inside operations; ``step_time``: the latest
    finish; ``bubble``: the idle share of the step over every stage of every pipeline (pipeline
    warm-up and cool-down, waits for ring partners and transfers, pipelines ending early).
    """

    fwd_start: np.ndarray
    fwd_end: np.ndarray
    bwd_start: np.ndarray
    bwd_end: np.ndarray
    pipe_finish: np.ndarray
    stage_busy: np.ndarray
    step_time: float
    bubble: float

    @classmethod
    def _wrap(cls, r: "_C.planner.PipelineReplay") -> "PipelineReplay":
        H, P = int(r.pipelines), int(r.stages)
        return cls(*(np.asarray(a).reshape(-1, P) for a in (r.fwd_start, r.fwd_end, r.bwd_start, r.bwd_end)),
                   np.asarray(r.pipe_finish), np.asarray(r.stage_busy).reshape(H, P), float(r.step_time),
                   float(r.bubble))


class Plan:
    """A step's plan (wraps the C++ Plan; its arrays are zero-copy read-only numpy views).

    Each rank's micro-batches are listed in execution order (local ones may sit between ring ones);
    every member lists a group's ring micro-batches in the same relative order (global ring id).
    """

    def __init__(self, cplan: "_C.planner.Plan", lengths: Optional[np.ndarray] = None,
                 units: Optional[UnitMap] = None, options: Optional["_C.planner.PlanOptions"] = None) -> None:
        self._p = cplan
        self._options = options
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
        count = [self._group_slots(slots, u, group) for u in range(slots.shape[0])]

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
        unit's local micro-batches take its free slots longest first (:func:`sort_local_slots`),
        so that a slot, which lasts as long as its slowest member, joins micro-batches of like
        cost.

        Every unit of a block runs the same number of slots; ring micro-batches keep their common
        slot on all members (so the rings of slot k and the all-to-alls of slot k never wait on one
        another across slots: no cycle, hence no hang). Raises ValueError when ``group`` does not
        divide the number of units.
        """
        n = self.units.num_units
        if group < 1 or n % group:
            raise ValueError(f"Plan.group_lockstep: group {group} does not divide the {n} HDP units")
        return sort_local_slots(self.lockstep(), np.asarray(self._p.mb_ring), np.asarray(self._p.mb_cost))

    def group_slots(self, group: int) -> np.ndarray:
        """Slots each unit runs under :meth:`group_lockstep` (the same within a block)."""
        slots = self.group_lockstep(group)
        return np.array([self._group_slots(slots, u, group) for u in range(slots.shape[0])], dtype=np.int64)

    def ep_replay(self, group: int, durations: Optional[Sequence[float]] = None) -> Replay:
        """The plan replayed as expert parallelism runs it (:func:`ep_slot_replay` on
        :meth:`group_lockstep`); ``durations`` as in :meth:`replay`. Compare ``step_time`` with
        :meth:`replay`'s: the difference is what the EP rule costs on this plan."""
        p = self._p
        d = np.asarray(p.mb_cost if durations is None else durations, dtype=np.float64)
        return ep_slot_replay(self.group_lockstep(group), group, np.asarray(p.rank_mb), np.asarray(p.mb_ring), d)

    @staticmethod
    def _group_slots(slots: np.ndarray, unit: int, group: int) -> int:
        if not group:
            return slots.shape[1]
        b = unit // group * group
        used = np.nonzero((slots[b:b + group] >= 0).any(axis=0))[0]
        return int(used[-1]) + 1 if used.size else 0

    def num_micro_batches(self, rank: Optional[int] = None) -> Union[int, np.ndarray]:
        counts = np.diff(self._p.rank_mb)
        return counts if rank is None else int(counts[rank])

    def micro_batches(self, rank: int, sample_ids: Optional[Sequence[int]] = None) -> List[MicroBatchPlan]:
        """Global rank ``rank``'s micro-batches in execution order, read straight from the plan's
        arrays: those of its HDP unit, each ring over the ranks of its TP index.

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
                                      ring_is_last_on_all=bool(ring) and all(last_ring[u] == rid for u in ring_units)))
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


def _positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, or a ValueError naming it (bools and non-integral numbers too)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"plan(): {name} must be an integer >= 1, got {value!r}")
    return int(value)


_MAX_LENGTH = 1 << 40  # the C++ planner's limit


def _check_each(values: Sequence[Any]) -> np.ndarray:
    """The slow path: every value must be an int (not a bool) or an integral float in range."""
    out = np.empty(len(values), dtype=np.int64)
    for k, x in enumerate(values):
        ok = isinstance(x, (int, np.integer, float, np.floating)) and not isinstance(x, (bool, np.bool_))
        if ok and isinstance(x, (float, np.floating)):
            ok = math.isfinite(x) and float(x).is_integer()
        if not ok or not 1 <= x <= _MAX_LENGTH:
            raise ValueError(f"plan(): sequence {k} has length {x!r} (lengths[{k}]); lengths must "
                             f"be integers in [1, 2^40]")
        out[k] = int(x)
    return out


def _lengths_array(lengths: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """The lengths as a contiguous int64 array, after checking every value is an integer >= 1.

    Checked before any conversion (a cast to int64 would truncate 1.5 to 1 and NaN to garbage);
    integral floats (``2.0``) are accepted. Raises ValueError naming the first bad index and value.
    """
    if isinstance(lengths, np.ndarray):
        arr = lengths.reshape(-1)
    else:
        seq = list(lengths)
        if not seq:
            return np.zeros(0, dtype=np.int64)
        if not all(issubclass(t, (int, float, np.integer, np.floating)) and not issubclass(t, (bool, np.bool_))
                   for t in set(map(type, seq))):
            return _check_each(seq)
        arr = np.asarray(seq)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind in "iu":
        bad = (arr < 1) | (arr > _MAX_LENGTH)
    elif kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr < 1) | (arr != np.floor(arr)) | (arr > _MAX_LENGTH)
    else:  # bools, strings, objects, complex numbers, ...
        return _check_each(arr.tolist())
    if bad.any():
        k = int(np.argmax(bad))
        raise ValueError(f"plan(): sequence {k} has length {arr[k].item()!r} (lengths[{k}]); "
                         f"lengths must be integers in [1, 2^40]")
    return np.ascontiguousarray(arr.astype(np.int64))


def static_cp_degree(longest: int, capacity: int, world_size: int) -> int:
    """The static DP x CP baseline's CP degree: the smallest power of two ``cp`` with
    ``cp * capacity >= longest`` (C++, ``csrc/planner/static_cp.cpp``).

    Raises:
        ValueError: the degree exceeds ``world_size`` (naming the values), or a bad argument.
    """
    if isinstance(longest, (bool, np.bool_)) or not isinstance(longest, (int, np.integer)) or longest < 0:
        raise ValueError(f"static_cp_degree: longest must be an integer >= 0, got {longest!r}")
    return int(_C.planner.static_cp_degree(int(longest), _positive_int("capacity", capacity),
                                           _positive_int("world_size", world_size)))


def stage_layers(layers: int, pp: int) -> int:
    """Layers of one pipeline stage when ``layers`` are cut into ``pp`` equal stages (the cost
    model's ``layers`` for a plan with ``pp`` stages).

    Raises:
        ValueError: ``pp`` does not divide ``layers`` (naming both), or either is < 1.
    """
    return int(_C.planner.stage_layers(_positive_int("layers", layers), _positive_int("pp", pp)))


_PIPELINE_KEYS = ("fwd_share", "p2p_bytes_per_token", "p2p_bw", "p2p_latency")


OFFLOAD_RULES = ("step", "paper-eq3")


def _options(world_size: int, capacity: int, strategy: str, offload: bool, cost: Any,
             speed: Optional[Sequence[float]], memory: Optional[Sequence[float]],
             static_cp: Optional[int] = None, pp: int = 1,
             pipeline: Optional[Dict[str, float]] = None,
             offload_rule: str = "step") -> "_C.planner.PlanOptions":
    if offload_rule not in OFFLOAD_RULES:
        raise ValueError(f"plan(): offload_rule must be one of {OFFLOAD_RULES}, got {offload_rule!r}")
    o = _C.planner.PlanOptions()
    o.offload_rule = offload_rule
    o.pp = _positive_int("pp", pp)
    for k, v in (pipeline or {}).items():
        if k not in _PIPELINE_KEYS:
            raise ValueError(f"plan(): unknown pipeline option {k!r} (expected {', '.join(_PIPELINE_KEYS)})")
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"plan(): pipeline option {k} must be a number, got {v!r}")
        setattr(o, "pp_" + k, float(v))
    o.world_size = _positive_int("world_size", world_size)
    o.capacity = _positive_int("capacity", capacity)
    o.strategy = strategy
    if static_cp is not None:
        o.static_cp = _positive_int("static_cp", static_cp)
    o.offload = bool(offload)
    o.cost = cost if isinstance(cost, CostModel) else load_cost_model(cost)
    if speed is not None:
        o.speed = [float(x) for x in speed]
    if memory is not None:
        o.memory = [float(x) for x in memory]
    return o


def plan(
    lengths: Union[Sequence[int], np.ndarray],
    world_size: Union[int, UnitMap],
    capacity: int,
    strategy: str = "balanced",
    offload: bool = False,
    cost: Any = None,
    speed: Optional[Sequence[float]] = None,
    memory: Optional[Sequence[float]] = None,
    verify: bool = False,
    static_cp: Optional[int] = None,
    pp: int = 1,
    pipeline: Optional[Dict[str, float]] = None,
    offload_rule: str = "step",
) -> Plan:
    """Plan one global batch.

    The plan minimises the synchronised step time (``Plan.makespan``): each rank runs its
    micro-batches in the plan's order, a ring micro-batch starts when all its members are free.

    Args:
        lengths: sequence lengths (integers >= 1; integral floats accepted), in batch order;
            plans refer to positions.
        world_size: HDP ranks (an integer >= 1), or a :class:`UnitMap` (HDP units of TP ranks: the
            plan is over its units and carries it).
        capacity: tokens per micro-batch per rank, or per unit (before ``memory`` multipliers;
            integer >= 1).
        strategy: "balanced" | "naive" | "pow2" | "static" | "pp-balance" | "pp-lockstep".
        offload: let long sequences offload activations to use fewer ranks: the paper's Eq. 3
            sets how few (memory, and copies hidden under the sequence's compute) and, under the
            default ``offload_rule="step"``, a ring shrinks only where the plan's step does not
            grow: the plan never replays longer than the same strategy without offloading.
            :meth:`Plan.ring_reasons` says per sequence which constraint set its ring size.
        cost: a CostModel, a JSON profile path, a dict of coefficients, or None (defaults).
        speed: per-rank relative speeds (heterogeneous clusters).
        memory: per-rank capacity multipliers.
        verify: re-check every invariant in C++ after planning (tests, debugging).
        static_cp: strategy "static" only: the CP degree (must divide ``world_size``; default: the
            smallest power of two holding the batch's longest sequence at the smallest capacity).
        pp: pipeline depth (stages). With ``pp`` > 1, ``world_size`` counts pipelines (the HDP
            units of one stage), ``cost.layers`` is one stage's (:func:`stage_layers`), and
            ``capacity`` is tokens per micro-batch per unit of a stage; the plan carries slots and
            its makespan is the 1F1B step (module docstring).
        pipeline: the pipeline replay's terms: ``fwd_share`` (the forward's share of a stage's
            forward + backward, default 1/3), ``p2p_bytes_per_token`` (activation bytes per token
            sent between stages, default 8192), ``p2p_bw`` (bytes/s, default 50e9) and
            ``p2p_latency`` (s, default 1e-5).
        offload_rule: ``"step"`` (default, above) or ``"paper-eq3"``: the paper's literal Eq. 3,
            kept for the ablation: naive and pow2 put every long sequence on its Eq. 3 minimum
            ring whatever that does to the step (a 2M-token sequence on 16 ranks whose ring then
            is the step).
    Raises:
        ValueError: bad input, naming the index/field and value (a length that is not an integer
            >= 1, a NaN or negative cost coefficient, world size 0, a sequence needing more ranks
            than exist, a static CP degree that does not divide the world, pp < 1, an unknown
            pipeline option, speed/memory multipliers with a pp-* strategy, ...).
    """
    units = world_size if isinstance(world_size, UnitMap) else None
    arr = _lengths_array(lengths)
    opts = _options(units.num_units if units else world_size, capacity, strategy, offload, cost, speed, memory,
                    static_cp, pp, pipeline, offload_rule)
    p = Plan(_C.planner.make_plan(arr, opts), arr, units, opts)
    if verify:
        p.raw.verify(arr.tolist(), opts)
    return p


def schedule_lockstep(world: int, rank_mb: np.ndarray, mb_ring: np.ndarray, ring_grp: np.ndarray,
                      grp_ranks: np.ndarray) -> np.ndarray:
    """:meth:`Plan.lockstep` for a schedule given as raw arrays (the simulator's): int64
    ``[world, slots]``. Rings take the slot where a replay with one time unit per ring micro-batch
    (and none per local one) starts them; each rank's locals fill its free slots in order."""
    mb_ring = np.ascontiguousarray(mb_ring, dtype=np.int64)
    rank_mb = np.ascontiguousarray(rank_mb, dtype=np.int64)
    unit = (mb_ring >= 0).astype(np.float64)
    rep = _C.planner.replay_schedule(world, rank_mb, mb_ring, np.ascontiguousarray(ring_grp, dtype=np.int64),
                                     np.ascontiguousarray(grp_ranks, dtype=np.int32), unit)
    ring_start = np.rint(np.asarray(rep.mb_start)).astype(np.int64)
    slot_of = np.full(len(mb_ring), -1, dtype=np.int64)
    total = 0
    for r in range(world):
        lo, hi = int(rank_mb[r]), int(rank_mb[r + 1])
        taken = {int(ring_start[m]) for m in range(lo, hi) if mb_ring[m] >= 0}
        for m in range(lo, hi):
            if mb_ring[m] >= 0:
                slot_of[m] = ring_start[m]
        k = 0
        for m in range(lo, hi):
            if mb_ring[m] >= 0:
                continue
            while k in taken:
                k += 1
            slot_of[m] = k
            k += 1
        total = max([total, k] + [t + 1 for t in taken])
    out = np.full((world, total), -1, dtype=np.int64)
    for r in range(world):
        for m in range(int(rank_mb[r]), int(rank_mb[r + 1])):
            out[r, slot_of[m]] = m
    return out


def sort_local_slots(slots: np.ndarray, mb_ring: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """``slots`` with each row's local micro-batches (``mb_ring`` -1) permuted over the slots they
    occupy, costliest first (ties by index); ring slots and padding stay. Local micro-batches have
    no partner, so any order of them is a valid schedule."""
    out = np.array(slots, dtype=np.int64, copy=True)
    for row in out:
        pos = [k for k, m in enumerate(row) if m >= 0 and mb_ring[m] < 0]
        mbs = sorted((int(row[k]) for k in pos), key=lambda m: (-float(cost[m]), m))
        row[pos] = mbs
    return out


def ep_slot_replay(slots: np.ndarray, group: int, rank_mb: np.ndarray, mb_ring: np.ndarray,
                   durations: np.ndarray) -> Replay:
    """Replay of lockstep ``slots`` (``[units, slots]``, -1 = padding) under expert parallelism
    with EP blocks of ``group`` consecutive units: a block's units advance slot by slot together
    (their all-to-alls join every member in every layer; a block stops after its own last real
    slot), a ring joins its members' blocks for its slot, and a slot lasts as long as the slowest
    micro-batch among the units it joins (a padding slot costs nothing itself but waits).
    ``rank_finish`` is each unit's end. Raises ValueError on bad durations or group."""
    d = np.asarray(durations, dtype=np.float64)
    n_units = slots.shape[0]
    if group < 1 or n_units % group:
        raise ValueError(f"ep_slot_replay: group {group} does not divide the {n_units} HDP units")
    if d.shape != (len(mb_ring),) or not np.all(np.isfinite(d)) or np.any(d < 0):
        raise ValueError(f"ep_slot_replay: need {len(mb_ring)} finite durations >= 0")
    counts = [Plan._group_slots(slots, u, group) for u in range(n_units)]
    unit_of = np.repeat(np.arange(n_units), np.diff(np.asarray(rank_mb)))
    ready, busy = np.zeros(n_units), np.zeros(n_units)
    start, end = np.zeros(len(d)), np.zeros(len(d))
    for k in range(slots.shape[1]):
        parent = list(range(n_units // group))  # blocks joined by this slot's rings

        def find(b: int) -> int:
            while parent[b] != b:
                parent[b] = parent[parent[b]]
                b = parent[b]
            return b

        members: Dict[int, List[int]] = {}
        for u in range(n_units):
            m = int(slots[u, k])
            if m >= 0 and k < counts[u] and mb_ring[m] >= 0:
                members.setdefault(int(mb_ring[m]), []).append(u)
        for us in members.values():
            for u in us[1:]:
                parent[find(u // group)] = find(us[0] // group)
        comp: Dict[int, List[int]] = {}
        for u in range(n_units):
            if k < counts[u]:
                comp.setdefault(find(u // group), []).append(u)
        for us in comp.values():
            t0 = max(ready[u] for u in us)
            mbs = [int(slots[u, k]) for u in us if slots[u, k] >= 0]
            t1 = t0 + max((d[m] for m in mbs), default=0.0)
            for m in mbs:
                start[m], end[m] = t0, t1
                busy[unit_of[m]] += d[m]
            for u in us:
                ready[u] = t1
    step = float(ready.max()) if n_units else 0.0
    return Replay(start, end, ready, busy, step - busy, step)


from .profile import profile  # noqa: E402  (measures this cost model on a device)
from .feasibility import documents_fit, longest_document  # noqa: E402  (the feasibility rule)
