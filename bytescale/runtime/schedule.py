"""One step's schedule on one rank: the plan's slots turned into one list of operations.

The schedule is decided in one place, :func:`schedule_kind`, from the job's mesh and model, and
built each step by :func:`build_schedule` from the step's plan; :class:`~bytescale.runtime.StepExecutor`
runs it and nothing else. Three kinds:

``flat``
    HDP: the rank's micro-batches in the plan's order, each one's forward then backward (the order
    the planner's replay assumes: a ring starts when all its members reach it).
``lockstep``
    Collectives inside every forward that all members of a group must join: FSDP2's parameter
    all-gather (the group is the world's HDP units, ``group`` 0) or expert parallelism's
    all-to-alls (blocks of ``group`` consecutive HDP units, ``Plan.group_lockstep``). Every member
    runs the same number of slots; a rank without a micro-batch in a slot runs a zero-token
    PADDING entry (it still joins the collectives); ring members meet in one slot.
``1f1b``
    Pipelines (``pp`` > 1): the plan gives each micro-batch a slot of its pipeline
    (``Plan.micro_batch_slots``) and every stage walks the 1F1B order of its pipeline's slots
    (``csrc/planner/pipeline.h``: ``w = min(P - 1 - p, S)`` warm-up forwards, then one forward
    and one backward in turn, then the cool-down backwards; empty slots skipped). A ring of
    ``d`` pipelines runs at every stage on those pipelines' units at the same slot, so its ring
    attention meets its members at the same point of their orders. The 1F1B order of ``S`` slots
    is a subsequence of that of any ``S' >= S``: every stage's operations embed in one canonical
    pipeline's acyclic dependency graph, so the schedule cannot hang. With FSDP2 or expert
    parallelism inside the stages (``padded``) every pipeline of a block (all of the stage's HDP
    units for FSDP2, ``group`` consecutive ones for EP) runs every slot up to the block's last,
    a padding entry (zero tokens, no transfer) where it has no micro-batch: then the members of a
    block run the same operations in the same order, so the collectives inside their forwards and
    backwards (FSDP2's all-gathers and reduce-scatters, EP's all-to-alls) always match; the
    padded order of ``S`` slots is still the 1F1B order of ``S`` slots, so the argument holds.

Each entry is a :class:`~bytescale.planner.MicroBatchPlan` carrying its ``slot`` (lockstep or
1F1B) and its token count, with ``ring_is_last_on_all`` as the schedule runs it (whether gradient
synchronisation may overlap the ring's backward, :class:`bytescale.HybridDataParallel`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Optional, Sequence, Tuple

from ..planner.types import MicroBatchPlan

__all__ = ["FLAT", "LOCKSTEP", "ONE_F_ONE_B", "ScheduleKind", "Schedule", "schedule_kind", "build_schedule",
           "pipeline_order"]

FLAT, LOCKSTEP, ONE_F_ONE_B = "flat", "lockstep", "1f1b"


@dataclass(frozen=True)
class ScheduleKind:
    """How this rank's steps are scheduled (decided once per job by :func:`schedule_kind`).

    ``group``: lockstep within blocks of this many HDP units (0: all of them). ``stages`` /
    ``stage``: the pipeline depth and this rank's stage (1F1B). ``padded``: 1F1B over every slot
    of the rank's block (FSDP2 or EP inside the stages), padding where the pipeline has none."""

    kind: str = FLAT
    group: int = 0
    stages: int = 1
    stage: int = 0
    padded: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (FLAT, LOCKSTEP, ONE_F_ONE_B):
            raise ValueError(f"ScheduleKind: kind must be one of {FLAT!r}, {LOCKSTEP!r}, {ONE_F_ONE_B!r}, "
                             f"got {self.kind!r}")
        if self.group < 0 or self.stages < 1 or not 0 <= self.stage < self.stages:
            raise ValueError(f"ScheduleKind: group {self.group} (>= 0), stage {self.stage} of {self.stages}")
        if self.kind == ONE_F_ONE_B and self.stages < 2:
            raise ValueError("ScheduleKind: a 1F1B schedule needs pp > 1 stages")

    def describe(self) -> str:
        if self.kind == LOCKSTEP:
            return f"lockstep over {'all HDP units' if not self.group else f'blocks of {self.group} HDP units'}"
        if self.kind == ONE_F_ONE_B:
            pad = ("" if not self.padded else
                   f", slots padded over {'all HDP units' if not self.group else f'blocks of {self.group} HDP units'}")
            return f"1F1B, stage {self.stage} of {self.stages}{pad}"
        return "flat"


def schedule_kind(mesh: Any, model: Any) -> ScheduleKind:
    """The one place that decides the schedule: pipelines (``mesh.pp`` > 1) run 1F1B; FSDP2
    (``model.fsdp``) runs lockstep over every HDP unit; expert parallelism (the model's
    ``ep_size``, else ``mesh.ep``) lockstep within its EP groups; both inside pipeline stages
    pad the 1F1B slots over those blocks; anything else flat."""
    pp = int(getattr(mesh, "pp", 1) or 1)
    module = getattr(model, "module", model)
    ep = int(getattr(module, "ep_size", 0) or getattr(mesh, "ep", 1) or 1)
    fsdp = bool(getattr(model, "fsdp", False))
    if pp > 1:
        return ScheduleKind(ONE_F_ONE_B, group=0 if fsdp else (ep if ep > 1 else 0), stages=pp,
                            stage=int(mesh.stage), padded=fsdp or ep > 1)
    if fsdp:
        return ScheduleKind(LOCKSTEP, group=0)
    if ep > 1:
        return ScheduleKind(LOCKSTEP, group=ep)
    return ScheduleKind(FLAT)


@dataclass(frozen=True)
class Schedule:
    """One rank's operations for one step.

    ``entries``: per position, the micro-batch plan it runs (its ``slot`` set for lockstep and
    1F1B; a padding entry has no document). ``source``: per position, the index of the rank's
    micro-batch in the plan's order (``Step.micro_batches``), -1 for padding. ``ops``: ``("F", j)``
    / ``("B", j)`` over positions, in the order to run them."""

    kind: ScheduleKind
    entries: Tuple[MicroBatchPlan, ...]
    source: Tuple[int, ...]
    ops: Tuple[Tuple[str, int], ...]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def padding(self) -> int:
        """How many padding entries (lockstep)."""
        return sum(1 for s in self.source if s < 0)


def pipeline_order(slots: Sequence[int], stages: int, stage: int) -> List[Tuple[str, int]]:
    """The operations of one stage: ``("F", k)`` / ``("B", k)`` for the micro-batch at position
    ``k`` of a pipeline whose micro-batches hold ``slots`` (increasing; gaps are empty slots), in
    1F1B order (``csrc/planner/pipeline.h``)."""
    from .. import _C

    slots = [int(s) for s in slots]
    if any(b <= a for a, b in zip(slots, slots[1:])) or any(s < 0 for s in slots):
        raise ValueError(f"pipeline_order: slots must be increasing and >= 0, got {slots}")
    if not slots:
        return []
    at = {s: k for k, s in enumerate(slots)}
    out = []
    for op in _C.planner.one_f_one_b(slots[-1] + 1, stages, stage):
        k = at.get(op // 2)
        if k is not None:
            out.append(("B" if op % 2 else "F", k))
    return out


def _flat_ops(n: int) -> Tuple[Tuple[str, int], ...]:
    return tuple(op for j in range(n) for op in (("F", j), ("B", j)))


def build_schedule(plan: Any, rank: int, kind: ScheduleKind,
                   micro_batches: Optional[Sequence[MicroBatchPlan]] = None,
                   sample_ids: Optional[Sequence[int]] = None) -> Schedule:
    """Global rank ``rank``'s schedule of ``plan`` under ``kind``.

    ``micro_batches``: the rank's micro-batch plans in the plan's order (default:
    ``plan.micro_batches(rank, sample_ids)``); a flat schedule without a plan runs them as given.

    Raises:
        ValueError: the plan has no pipeline slots for a 1F1B schedule, was made for another depth,
            or does not divide into the lockstep group.
    """
    if micro_batches is None:
        if plan is None:
            raise ValueError("build_schedule: give the plan or the micro-batches")
        micro_batches = plan.micro_batches(rank, sample_ids)
    mine = tuple(micro_batches)
    if kind.kind == FLAT or plan is None:
        if kind.kind != FLAT:
            raise ValueError(f"build_schedule: a {kind.describe()} schedule needs the step's plan")
        return Schedule(kind, mine, tuple(range(len(mine))), _flat_ops(len(mine)))
    if kind.kind == ONE_F_ONE_B:
        plan.check_pp(kind.stages)
        slots = plan.micro_batch_slots(rank)
        if len(slots) != len(mine):
            raise ValueError(f"build_schedule: rank {rank} has {len(mine)} micro-batches, its plan {len(slots)} "
                             "pipeline slots")
        if kind.padded:
            return _padded_1f1b(plan, rank, kind, mine, slots)
        entries = tuple(replace(m, slot=int(s)) for m, s in zip(mine, slots))
        return Schedule(kind, entries, tuple(range(len(mine))),
                        tuple(pipeline_order(slots, kind.stages, kind.stage)))
    return _lockstep(plan, rank, kind, mine)


def _lockstep(plan: Any, rank: int, kind: ScheduleKind, mine: Tuple[MicroBatchPlan, ...]) -> Schedule:
    """Lockstep slots of ``rank``'s unit (``Plan.lockstep`` / ``Plan.group_lockstep``): each slot
    the plan's micro-batch there, or padding; only the slots its group runs."""
    import numpy as np

    units = plan.units
    unit = units.unit_of(rank)
    group = kind.group
    slots = np.asarray(plan.group_lockstep(group) if group else plan.lockstep())
    counts = (np.asarray(plan.group_slots(group)) if group else
              np.full(slots.shape[0], slots.shape[1], dtype=np.int64))
    rank_mb = np.asarray(plan.raw.rank_mb)
    base = int(rank_mb[unit])
    if len(mine) != int(rank_mb[unit + 1]) - base:
        raise ValueError(f"build_schedule: rank {rank} has {len(mine)} micro-batches, its plan "
                         f"{int(rank_mb[unit + 1]) - base}")
    entries, source = [], []
    for k in range(int(counts[unit])):
        m = int(slots[unit, k])
        if m < 0:
            entries.append(MicroBatchPlan(rank, k, slot=k))
            source.append(-1)
            continue
        mb = mine[m - base]
        # a ring's slot ends every member's step when it is each one's last slot
        last = bool(mb.ring) and all(k == int(counts[units.unit_of(r)]) - 1 for r in mb.ring)
        entries.append(replace(mb, slot=k, ring_is_last_on_all=last))
        source.append(m - base)
    return Schedule(kind, tuple(entries), tuple(source), _flat_ops(len(entries)))


def _block_counts(counts, group: int):
    """Per unit, the slot count of its block (the block's largest; ``group`` 0: one block)."""
    n = len(counts)
    if group and n % group:
        raise ValueError(f"build_schedule: group {group} does not divide the {n} HDP units")
    g = group or max(n, 1)
    return [max(counts[u // g * g:u // g * g + g]) for u in range(n)]


def _padded_1f1b(plan: Any, rank: int, kind: ScheduleKind, mine: Tuple[MicroBatchPlan, ...],
                 slots: List[int]) -> Schedule:
    """1F1B over every slot of the rank's block: the unit's micro-batch at its slot, padding in
    the gaps and up to the block's last slot."""
    import numpy as np

    units = plan.units
    rank_mb, mb_slot = np.asarray(plan.raw.rank_mb), np.asarray(plan.slots)
    own = [int(mb_slot[int(rank_mb[u + 1]) - 1]) + 1 if rank_mb[u + 1] > rank_mb[u] else 0
           for u in range(units.num_units)]
    block = _block_counts(own, kind.group)
    unit = units.unit_of(rank)
    at = {s: k for k, s in enumerate(slots)}
    entries, source = [], []
    for k in range(block[unit]):
        if k not in at:
            entries.append(MicroBatchPlan(rank, k, slot=k))
            source.append(-1)
            continue
        mb = mine[at[k]]
        last = bool(mb.ring) and all(k == block[units.unit_of(r)] - 1 for r in mb.ring)
        entries.append(replace(mb, slot=k, ring_is_last_on_all=last))
        source.append(at[k])
    return Schedule(kind, tuple(entries), tuple(source),
                    tuple(pipeline_order(list(range(block[unit])), kind.stages, kind.stage)))
