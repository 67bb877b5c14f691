"""Lockstep slots and the expert-parallel replay over raw schedule arrays (the Python ports of the
C++ replay that :class:`~bytescale.planner.Plan` and the simulator use)."""
from __future__ import annotations

from typing import Dict, List

import numpy as np

from .. import _C
from .replay import Replay

__all__ = ["schedule_lockstep", "sort_local_slots", "ep_slot_replay", "group_slots"]


def group_slots(slots: np.ndarray, unit: int, group: int) -> int:
    """Slots the EP block of ``group`` units holding ``unit`` runs (its last used slot + 1; every
    slot when ``group`` is 0)."""
    if not group:
        return slots.shape[1]
    b = unit // group * group
    used = np.nonzero((slots[b:b + group] >= 0).any(axis=0))[0]
    return int(used[-1]) + 1 if used.size else 0


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
    counts = [group_slots(slots, u, group) for u in range(n_units)]
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
