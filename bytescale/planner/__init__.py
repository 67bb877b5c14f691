"""Python face of the C++ HDP planner (csrc/planner/).

    plan = bytescale.plan(lengths, world_size=64, capacity=16384)
    plan.makespan                  # predicted synchronised step time (s)
    plan.makespan / plan.lower_bound
    plan.idle()                    # per-rank idle time (waiting for ring partners + tail)
    plan.micro_batches(rank)       # this rank's micro-batches (MicroBatchPlan), in execution order
    plan.replay(durations)         # the same plan replayed with other micro-batch durations

The step model (the flat replay, the lockstep slots and their expert-parallel form, the 1F1B order
and replay) is C++ (csrc/planner/replay.h, pipeline.h), bound once in ``bytescale._C.planner`` for
plans and for schedules built elsewhere (``_C.planner.Schedule``, e.g. the simulator's).

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

from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from .. import _C
from ..parallel_dims import ParallelDims
from .cost import CostModel, load_cost_model
from .inputs import (OFFLOAD_RULES, _PIPELINE_KEYS, _check_each, _lengths_array, _options,  # noqa: F401
                     _positive_int, stage_layers, static_cp_degree)
from .replay import PipelineReplay, Replay
from .result import Plan
from .types import DocRef, MicroBatchPlan
from .units import UnitMap

__all__ = ["CostModel", "Plan", "DocRef", "MicroBatchPlan", "PipelineReplay", "Replay", "UnitMap",
           "load_cost_model", "plan", "profile", "stage_layers", "static_cp_degree", "longest_document",
           "documents_fit"]


def plan(
    lengths: Union[Sequence[int], np.ndarray],
    world_size: Union[int, UnitMap, ParallelDims],
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
    peer_budget: int = 4,
) -> Plan:
    """Plan one global batch.

    The plan minimises the synchronised step time (``Plan.makespan``): each rank runs its
    micro-batches in the plan's order, a ring micro-batch starts when all its members are free.

    Args:
        lengths: sequence lengths (integers >= 1; integral floats accepted), in batch order;
            plans refer to positions.
        world_size: HDP ranks (an integer >= 1), a :class:`UnitMap` (HDP units of TP ranks: the
            plan is over its units and carries it), or the job's
            :class:`~bytescale.parallel_dims.ParallelDims` (the units of one stage and ``pp`` from
            it; the plan carries it as :attr:`Plan.dims`, which the executors compare with their
            mesh's once).
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
        peer_budget: K, the most distinct ring neighbours a rank may have over the whole run
            (default 4; 0: unbounded, the plans of the planner before the budget, byte for
            byte). NCCL keeps point-to-point buffers per peer for good, so this bounds their
            memory at any scale: rings are intervals of the unit order (the ranks of a node
            together), members ordered a, a+2, a+4, ..., a+3, a+1, so a unit's neighbours are
            always among u-2 .. u+2 (csrc/planner/peer_budget.h). 1..3 raise ValueError.
    Raises:
        ValueError: bad input, naming the index/field and value (a length that is not an integer
            >= 1, a NaN or negative cost coefficient, world size 0, a sequence needing more ranks
            than exist, a static CP degree that does not divide the world, pp < 1, an unknown
            pipeline option, speed/memory multipliers with a pp-* strategy, ...).
    """
    dims = world_size if isinstance(world_size, ParallelDims) else None
    if dims is not None:  # the units of one stage and the depth, from the job's one statement of them
        if pp not in (1, dims.pp):
            raise ValueError(f"plan: pp={pp} contradicts the ParallelDims' pp={dims.pp}; give one")
        world_size, pp = (dims.units(0) if dims.tp > 1 else dims.hdp), dims.pp
    units = world_size if isinstance(world_size, UnitMap) else None
    arr = _lengths_array(lengths)
    opts = _options(units.num_units if units else world_size, capacity, strategy, offload, cost, speed, memory,
                    static_cp, pp, pipeline, offload_rule, peer_budget)
    p = Plan(_C.planner.make_plan(arr, opts), arr, units, opts, dims=dims)
    if verify:
        p.raw.verify(arr.tolist(), opts)
    return p


from .profile import profile  # noqa: E402  (measures this cost model on a device)
from .feasibility import documents_fit, longest_document  # noqa: E402  (the feasibility rule)
