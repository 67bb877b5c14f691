"""The static DP x CP baseline, for side-by-side comparisons with HDP.

The baseline is what Megatron-LM / TransformerEngine style static context parallelism does: one
CP degree for the whole run, sized for the longest sequence (the smallest power of two with
``cp * capacity >= longest``), ``world // cp`` data-parallel replicas, and EVERY sequence sharded
(zig-zag, ring attention) over its replica's CP group. Each replica packs sequences first-fit
into micro-batches of ``cp * capacity`` tokens; micro-batches are dealt to replicas round-robin in
order of decreasing size.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..planner.types import DocRef, MicroBatchPlan

__all__ = ["static_cp_degree", "static_cp_plan", "StaticPlan"]


def static_cp_degree(longest: int, capacity: int, world_size: int) -> int:
    cp = 1
    while cp * capacity < longest:
        cp *= 2
    if cp > world_size:
        raise ValueError(
            f"static CP baseline: the longest sequence ({longest} tokens) needs CP degree {cp} "
            f"at capacity {capacity}, more than the world size {world_size}"
        )
    return cp


class StaticPlan:
    """A step's static DP x CP plan; the same interface as :class:`bytescale.planner.Plan`."""

    strategy = "static"

    def __init__(self, lengths: Sequence[int], world_size: int, cp: int,
                 per_replica: List[List[List[int]]]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.world_size = world_size
        self.cp = cp
        self.per_replica = per_replica

    def num_micro_batches(self, rank: Optional[int] = None):
        counts = np.array([len(self.per_replica[r // self.cp]) for r in range(self.world_size)])
        return counts if rank is None else int(counts[rank])

    def micro_batches(self, rank: int, sample_ids: Optional[Sequence[int]] = None) -> List[MicroBatchPlan]:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"StaticPlan.micro_batches: rank {rank} outside [0, {self.world_size})")
        rep, pos = divmod(rank, self.cp)
        ring = tuple(range(rep * self.cp, (rep + 1) * self.cp))
        out = []
        for i, members in enumerate(self.per_replica[rep]):
            docs = tuple(DocRef(s, -1 if sample_ids is None else int(sample_ids[s]), int(self.lengths[s]))
                         for s in members)
            if self.cp == 1:
                out.append(MicroBatchPlan(rank, i, local=docs))
            else:
                # the CP group's members run the same micro-batches: the last one ends them all
                out.append(MicroBatchPlan(rank, i, sharded=docs, ring=ring, ring_pos=pos, ring_id=i,
                                          ring_is_last_on_all=i == len(self.per_replica[rep]) - 1))
        return out

    def lockstep_micro_batches(self, rank: int, sample_ids: Optional[Sequence[int]] = None) -> List[MicroBatchPlan]:
        """Lockstep slots: every rank padded with empty micro-batches to the largest count (the
        members of a CP group always share their slots)."""
        mine = self.micro_batches(rank, sample_ids)
        total = int(self.num_micro_batches().max()) if self.world_size else 0
        return mine + [MicroBatchPlan(rank, k) for k in range(len(mine), total)]

    @property
    def imbalance(self) -> float:
        """Predicted max / mean rank time: the baseline makes no prediction (NaN)."""
        return float("nan")

    def ring_sizes(self):
        """Batch position -> ranks it is sharded over (every sequence, when cp > 1)."""
        return {i: self.cp for i in range(len(self.lengths))} if self.cp > 1 else {}

    def to_bytes(self) -> bytes:
        return repr((self.lengths.tolist(), self.world_size, self.cp, self.per_replica)).encode()

    def summary(self) -> str:
        mbs = self.num_micro_batches()
        return (f"plan[static] ranks={self.world_size} cp={self.cp} replicas={self.world_size // self.cp} "
                f"micro-batches/rank min={int(mbs.min())} max={int(mbs.max())}")


def static_cp_plan(lengths: Sequence[int], world_size: int, capacity: int,
                   cp: Optional[int] = None) -> StaticPlan:
    """Plan one global batch the static DP x CP way (see module docstring)."""
    lengths = [int(n) for n in lengths]
    deg = cp or static_cp_degree(max(lengths), capacity, world_size)
    if world_size % deg:
        raise ValueError(f"static CP baseline: CP degree {deg} does not divide world size {world_size}")
    bin_cap = deg * capacity
    bins: List[List[int]] = []
    loads: List[int] = []
    for sid in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[sid]
        for b, load in enumerate(loads):
            if load + n <= bin_cap:
                bins[b].append(sid)
                loads[b] += n
                break
        else:
            bins.append([sid])
            loads.append(n)
    replicas = world_size // deg
    per_replica: List[List[List[int]]] = [[] for _ in range(replicas)]
    for b, members in enumerate(bins):
        per_replica[b % replicas].append(members)
    return StaticPlan(lengths, world_size, deg, per_replica)
