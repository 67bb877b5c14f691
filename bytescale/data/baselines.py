"""Static DP x CP baseline plans, for side-by-side comparisons with HDP.

The baseline is what Megatron-LM / TransformerEngine style static context parallelism does: one
CP degree for the whole run, sized for the longest sequence (the smallest power of two with
``cp * capacity >= longest``), ``world // cp`` data-parallel replicas, and EVERY sequence sharded
(zig-zag, ring attention) over its replica's CP group. Each replica packs sequences first-fit
into micro-batches of ``cp * capacity`` tokens; micro-batches are dealt to replicas round-robin in
order of decreasing size.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

from .loader import MicroBatchSpec, SequenceSpec

__all__ = ["static_cp_degree", "static_cp_plan_fn"]


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


def static_cp_plan_fn(world_size: int, capacity: int, cp: int | None = None) -> Callable:
    """A ``plan_fn`` for :class:`~bytescale.data.loader.HDPLoader` implementing the baseline."""

    def plan_fn(lengths: Sequence[int]) -> Tuple[dict, Callable[[int], List[MicroBatchSpec]]]:
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

        def specs_for_rank(rank: int) -> List[MicroBatchSpec]:
            rep, pos = divmod(rank, deg)
            group = tuple(range(rep * deg, (rep + 1) * deg))
            out = []
            for members in per_replica[rep]:
                seqs = [SequenceSpec(s, lengths[s], deg, pos) for s in members]
                if deg == 1:
                    out.append(MicroBatchSpec(local=seqs, sharded=[]))
                else:
                    out.append(MicroBatchSpec(local=[], sharded=seqs, group=group))
            return out

        info = {"cp": deg, "replicas": replicas, "micro_batches": [len(p) for p in per_replica]}
        return info, specs_for_rank

    return plan_fn
