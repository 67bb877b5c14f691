"""The strategies the simulator compares, each turned into one flat :class:`Schedule`.

In the paper's ablation order (each adds one idea to the previous):

============  =======================================================================================
static        DP x CP, one CP degree sized for the longest sequence (the smallest power of two with
              ``cp x capacity >= longest``), every sequence sharded over its replica's CP group
              (``bytescale.plan(strategy="static")``, the runtime's own baseline)
pow2          Megatron-style dynamic CP: each long sequence on a power-of-two group, token-balanced
              (``bytescale.plan(strategy="pow2")``)
hdp           HDP with dynamic communication only: any-integer ring sizes, memory-driven, token-
              balanced (the paper's Alg. 1, ``strategy="naive"``)
hdp-offload   + selective activation offloading (``offload=True``: Eq. 3 under the step's clock, a
              ring shrinks only where the step does not grow)
hdp-offload-eq3  the same with the paper's literal Eq. 3 (``offload_rule="paper-eq3"``: every long
              sequence on its Eq. 3 minimum ring), for the ablation
hdp-balance   + the balance scheduler (bytescale's sync-aware ``strategy="balanced"``, offloading on)
hdp-full      + remote data loading: the same plan, the data-loading stall overlapped
============  =======================================================================================

The paper's own rows before the balance scheduler (:data:`LOCKSTEP_STRATEGIES`): without it every
rank runs the same number of micro-batches in lockstep, gradient-accumulation style (a slot ends
when its slowest rank does), which is what the balance scheduler removes:

=====================  ==============================================================================
hdp-lockstep           ``hdp``'s plan (``naive``), every rank's micro-batches in world lockstep slots
hdp-offload-lockstep   ``hdp-offload``'s plan in world lockstep slots
=====================  ==============================================================================

With pipeline parallelism (``pp`` > 1) every strategy plans PIPELINES (the HDP units of one stage)
with the stage's cost model and gets 1F1B slots (static: DP x CP x TP x PP, each CP group's
micro-batches through its pipelines; the HDP strategies: DP-Balance's per-pipeline order, rings
aligned at common slots), and two more compare pipeline schedules (:data:`PP_STRATEGIES`):

==============  =====================================================================================
lockstep        Megatron-LM's dynamic CP with PP: every pipeline the same slots (``"pp-lockstep"``)
hdp-pp-balance  HDP + PP-Balance (the paper's Alg. 2), offloading, remote loading (``"pp-balance"``)
==============  =====================================================================================

A :class:`Schedule` holds the planner's schedule view (``layout``, ``bytescale._C.planner.Schedule``:
a plan's own ``rank_mb``, ``mb_ring``, ``ring_grp``, ``grp_ranks`` and 1F1B slots, which the
planner's step model replays; see csrc/planner/replay.h) plus what the engine prices per
micro-batch: the tokens this rank holds, its share of the attention work (sum of s^2 / ring size
over its documents), the ring size, the offload ratio and the number of documents.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

__all__ = ["STRATEGIES", "PP_STRATEGIES", "LOCKSTEP_STRATEGIES", "Schedule", "build_schedule", "schedule_from_plan", "static_schedule", "split_at_context"]

# name -> (planner strategy or "static", offload (False, True = the "step" rule, or a rule's name),
# loader model)
STRATEGIES: Dict[str, Tuple[str, Union[bool, str], str]] = {
    "static": ("static", False, "local"),
    "pow2": ("pow2", False, "global"),
    "hdp": ("naive", False, "global"),
    "hdp-offload": ("naive", True, "global"),
    "hdp-offload-eq3": ("naive", "paper-eq3", "global"),
    "hdp-balance": ("balanced", True, "global"),
    "hdp-full": ("balanced", True, "remote"),
}

# the paper's rows before the balance scheduler: the plan of the named strategy in world lockstep
LOCKSTEP_STRATEGIES: Dict[str, str] = {"hdp-lockstep": "hdp", "hdp-offload-lockstep": "hdp-offload"}

# the pipeline schedules' comparison (any pp; part of "all" when pp > 1)
PP_STRATEGIES: Dict[str, Tuple[str, bool, str]] = {
    "lockstep": ("pp-lockstep", False, "global"),
    "hdp-pp-balance": ("pp-balance", True, "remote"),
}


@dataclass(frozen=True, eq=False)
class Schedule:
    """One step's schedule: the planner's schedule view plus per-micro-batch work.

    ``layout`` is a ``bytescale._C.planner.Schedule`` (csrc/planner/replay.h ScheduleView): a plan's
    own arrays (:func:`schedule_from_plan`, no copy) or arrays built by hand
    (:meth:`from_arrays`); the engine replays it with the planner's step model. ``rank_mb``,
    ``mb_ring``, ``ring_grp``, ``grp_ranks``, ``world``, ``pp`` and ``mb_slot`` read it.

    ``loader``: ``"local"`` (each data-parallel replica reads only its share, prefetched),
    ``"global"`` (every node reads the whole global batch to learn its lengths before planning;
    not overlapped) or ``"remote"`` (loader servers, one planner, ranks pull their slices,
    prefetched: the paper's remote data loading).
    """

    strategy: str
    layout: Any               # bytescale._C.planner.Schedule (world = pipelines when pp > 1)
    mb_tokens: np.ndarray     # float64 [M]: tokens this rank holds in the micro-batch
    mb_attn: np.ndarray       # float64 [M]: sum over its documents of s^2 / ring size
    mb_ring_size: np.ndarray  # int64 [M]: 1 for a local micro-batch
    mb_offload: np.ndarray    # float64 [M]: offload ratio r
    mb_docs: np.ndarray       # int64 [M]: documents (or pieces) in the micro-batch
    loader: str
    planner_step: float = float("nan")  # the planner's own prediction (its cost model), seconds
    info: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arrays(cls, strategy: str, world: int, rank_mb: Any, mb_ring: Any, ring_grp: Any, grp_ranks: Any,
                    pp: int = 1, mb_slot: Any = None, **work: Any) -> "Schedule":
        """A schedule built outside the planner: the replay's arrays (csrc/planner/replay.h; with
        ``pp`` > 1 a 1F1B ``mb_slot`` per micro-batch) and the per-micro-batch work (the other
        fields). ValueError when the arrays do not form a schedule."""
        from .. import _C

        layout = _C.planner.Schedule(world, np.asarray(rank_mb, dtype=np.int64), np.asarray(mb_ring, dtype=np.int64),
                                     np.asarray(ring_grp, dtype=np.int64), np.asarray(grp_ranks, dtype=np.int32),
                                     None if mb_slot is None else np.asarray(mb_slot, dtype=np.int64), pp)
        return cls(strategy=strategy, layout=layout, **work)

    @property
    def world(self) -> int:
        """Ranks (HDP units), or pipelines when ``pp`` > 1."""
        return int(self.layout.world_size)

    @property
    def rank_mb(self) -> np.ndarray:
        """int64 [world + 1]: rank r's micro-batches are [rank_mb[r], rank_mb[r + 1])."""
        return self.layout.rank_mb

    @property
    def mb_ring(self) -> np.ndarray:
        """int64 [M]: the ring of each micro-batch, -1 = local."""
        return self.layout.mb_ring

    @property
    def ring_grp(self) -> np.ndarray:
        """int64 [rings + 1]: ring k's group is grp_ranks[ring_grp[k] .. ring_grp[k + 1])."""
        return self.layout.ring_grp

    @property
    def grp_ranks(self) -> np.ndarray:
        return self.layout.grp_ranks

    @property
    def pp(self) -> int:
        """Pipeline stages (1: none)."""
        return int(self.layout.stages) if self.layout.pipelined else 1

    @property
    def mb_slot(self) -> Optional[np.ndarray]:
        """int64 [M]: each micro-batch's 1F1B slot in its pipeline (None without pipelines)."""
        return self.layout.mb_slot if self.layout.pipelined else None

    @property
    def num_micro_batches(self) -> int:
        return int(self.mb_ring.shape[0])

    @property
    def mb_rank(self) -> np.ndarray:
        """The rank of each micro-batch."""
        return np.repeat(np.arange(self.world), np.diff(self.rank_mb))

    def ring_node_hops(self, gpus_per_node: int) -> np.ndarray:
        """int64 [rings]: the hops of each ring, in its member order (the last member's next is
        the first), whose two ends sit on different nodes (ranks ``r // gpus_per_node``). A ring
        of the planner's peer budget (intervals, hops of <= 2 positions) over k nodes has about 2
        per node boundary it spans; a ring inside one node has none."""
        n = self.ring_grp.shape[0] - 1
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        grp = np.asarray(self.ring_grp, dtype=np.int64)
        node = np.asarray(self.grp_ranks, dtype=np.int64) // gpus_per_node
        nxt = np.arange(node.size) + 1
        sizes = np.diff(grp)
        nonempty = sizes > 0
        nxt[grp[1:][nonempty] - 1] = grp[:-1][nonempty]  # the wrap-around hop
        cross = (node != node[nxt]).astype(np.int64) if node.size else np.zeros(0, np.int64)
        out = np.zeros(n, dtype=np.int64)
        out[nonempty] = np.add.reduceat(cross, grp[:-1][nonempty]) if cross.size else 0
        return out

    def ring_crosses_nodes(self, gpus_per_node: int) -> np.ndarray:
        """bool [rings]: does some hop of the ring, in its member order, leave its node? (A ring
        advances at its slowest hop: one network hop prices the whole ring on the network.)"""
        return self.ring_node_hops(gpus_per_node) > 0


def split_at_context(lengths: np.ndarray, context: int) -> np.ndarray:
    """Documents longer than ``context`` cut into consecutive pieces of at most ``context``
    tokens (no token dropped), as ``python -m bytescale.train`` does with ``--max-length``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    if lengths.size == 0 or lengths.max() <= context:
        return lengths
    pieces = -(-lengths // context)
    out = np.full(int(pieces.sum()), context, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    out[last] = lengths - (pieces - 1) * context
    return out


def schedule_from_plan(name: str, plan: Any, lengths: np.ndarray, loader: str) -> Schedule:
    """The schedule of a :class:`bytescale.planner.Plan` of ``lengths`` (any strategy/options):
    the plan's own schedule view plus the work its micro-batches price."""
    from .. import _C

    p = plan.raw
    M = int(p.num_micro_batches)
    mb_seg = np.asarray(p.mb_seg, dtype=np.int64)
    seg_len = lengths[np.asarray(p.seg_seq)].astype(np.float64)
    seg_len *= seg_len
    seg_len /= np.asarray(p.seg_ring_size)
    docs = np.diff(mb_seg)
    if M and docs.all():  # reduceat sums each micro-batch's segments (none is empty)
        attn = np.add.reduceat(seg_len, mb_seg[:-1])
    else:
        attn = np.bincount(np.repeat(np.arange(M), docs), weights=seg_len, minlength=M)
    mb_ring = np.asarray(p.mb_ring, dtype=np.int64)
    ring_grp = np.asarray(p.ring_grp, dtype=np.int64)
    sizes = np.diff(ring_grp)
    ring_size = np.where(mb_ring >= 0, sizes[np.maximum(mb_ring, 0)] if sizes.size else 1, 1).astype(np.int64)
    return Schedule(
        strategy=name, layout=_C.planner.Schedule(p), mb_tokens=np.asarray(p.mb_tokens, dtype=np.float64),
        mb_attn=attn, mb_ring_size=ring_size, mb_offload=np.asarray(p.mb_offload, dtype=np.float64), mb_docs=docs,
        loader=loader, planner_step=float(plan.makespan),
        info={"rings": int(p.num_rings), "max_ring": int(sizes.max()) if sizes.size else 1,
              "planner_bound": float(plan.lower_bound)})


def static_schedule(lengths: np.ndarray, world: int, capacity: int, cp: Optional[int] = None,
                    cost: Any = None, pp: int = 1, pipeline: Optional[Dict[str, float]] = None) -> Schedule:
    """The static DP x CP baseline's schedule: the planner's ``static`` strategy (``cp``: its CP
    degree, default sized for the longest sequence; ``cost``: the cost model of the planner's own
    prediction; ``pp``/``pipeline``: pipelines, see :func:`bytescale.planner.plan`)."""
    from ..planner import plan as make_plan

    lengths = np.asarray(lengths, dtype=np.int64)
    p = make_plan(lengths, world, capacity, strategy="static", cost=cost, static_cp=cp, pp=pp, pipeline=pipeline)
    sizes = np.asarray(p.raw.seg_ring_size)
    deg = int(sizes.max()) if sizes.size else (cp or 1)
    sched = schedule_from_plan("static", p, lengths, "local")
    sched.info.update(cp=deg, dp=world // deg)
    return sched


def build_schedule(name: str, lengths: np.ndarray, world: int, capacity: int, cost: Any,
                   plans: Optional[Dict[Tuple[str, Union[bool, str]], Any]] = None, pp: int = 1,
                   pipeline: Optional[Dict[str, float]] = None) -> Schedule:
    """The schedule of strategy ``name`` (:data:`STRATEGIES` or :data:`PP_STRATEGIES`) for one
    global batch; with ``pp`` > 1, ``world`` counts pipelines and ``cost`` is one stage's
    (``pipeline``: the planner's transfer terms, :func:`bytescale.planner.plan`).

    ``plans`` caches planner results by (planner strategy, offload) so that hdp-balance and
    hdp-full share one plan. Raises ValueError for an unknown strategy or a batch that does not fit
    (e.g. a sequence needing more ranks than exist).
    """
    if name in LOCKSTEP_STRATEGIES:
        if pp > 1:
            raise ValueError(f"strategy {name!r} is for pp = 1 (with pipelines use lockstep)")
        sched = build_schedule(LOCKSTEP_STRATEGIES[name], lengths, world, capacity, cost, plans)
        return replace(sched, strategy=name, info={**sched.info, "lockstep": True})
    table = {**STRATEGIES, **PP_STRATEGIES}
    if name not in table:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(list(table) + list(LOCKSTEP_STRATEGIES))} "
                         "or all")
    kind, offload, loader = table[name]
    lengths = np.asarray(lengths, dtype=np.int64)
    if kind == "static":
        return static_schedule(lengths, world, capacity, cost=cost, pp=pp, pipeline=pipeline)
    from ..planner import plan as make_plan

    key = (kind, offload)
    if plans is not None and key in plans:
        p = plans[key]
    else:
        rule = offload if isinstance(offload, str) else "step"
        p = make_plan(lengths, world, capacity, strategy=kind, offload=bool(offload), cost=cost,
                      pp=pp, pipeline=pipeline, offload_rule=rule)
        if plans is not None:
            plans[key] = p
    return schedule_from_plan(name, p, lengths, loader)
