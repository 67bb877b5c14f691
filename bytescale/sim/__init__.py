"""A step simulator driven by the real planner: what would HDP buy on this data and this cluster?

    python -m bytescale.sim --corpus byted --model llama-7b --gpus 1024 --gpus-per-node 8 \\
        --context 2M --strategy all --json sim.json --png sim.png

or from Python::

    from bytescale.sim import simulate_batch
    results = simulate_batch(lengths, "llama-7b", gpus=1024, strategies=["static", "hdp-full"])
    results[1].step_time_s, results[1].tokens_per_s, results[1].mfu, results[1].breakdown()

One concept per module: :mod:`~bytescale.sim.cluster` (ClusterSpec, presets),
:mod:`~bytescale.sim.model` (model shapes -> the planner's cost model), :mod:`~bytescale.sim.strategies`
(static, pow2, hdp, hdp-offload, hdp-balance, hdp-full -> flat schedules),
:mod:`~bytescale.sim.engine` (micro-batch durations, the C++ replay, gradient sync, data stall),
:mod:`~bytescale.sim.report` (table, timeline PNG). Every number is a prediction of a stated model
(module docstrings); ``benchmarks/validate_sim.py`` compares it with measured CPU runs.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from .cluster import CLUSTERS, ClusterSpec, cluster
from .engine import SimResult, micro_batch_times, simulate
from .model import (FWD_SHARE, MODELS, ModelShape, check_pp, check_tp, cost_model, default_capacity, model_shape,
                    p2p_terms, planner_cost)
from .report import table, timeline_png
from .strategies import PP_STRATEGIES, STRATEGIES, Schedule, build_schedule, split_at_context

__all__ = ["CLUSTERS", "ClusterSpec", "cluster", "MODELS", "ModelShape", "model_shape", "cost_model",
           "default_capacity", "planner_cost", "STRATEGIES", "PP_STRATEGIES", "Schedule", "build_schedule", "split_at_context", "SimResult",
           "simulate", "micro_batch_times", "simulate_batch", "table", "timeline_png"]


def simulate_batch(lengths: Union[Sequence[int], np.ndarray], model: Union[str, ModelShape] = "llama-7b",
                   gpus: int = 1024, gpus_per_node: int = 8,
                   strategies: Sequence[str] = tuple(STRATEGIES),
                   cluster_spec: Union[str, ClusterSpec] = "h100-nvlink-ib400",
                   capacity: Optional[int] = None, efficiency: float = 0.4,
                   profile: Optional[str] = None, cost: Any = None,
                   grad_bytes: Optional[float] = None, tp: int = 1, pp: int = 1, ep: int = 1) -> List[SimResult]:
    """Simulates one step of the global batch ``lengths`` under each of ``strategies``.

    ``cluster_spec``: a preset name (resized to ``gpus``/``gpus_per_node``) or a ClusterSpec used as
    is. ``tp``: tensor parallelism, the GPUs of one HDP unit (inside a node; the planner plans
    ``gpus / tp`` units). ``capacity``: tokens per micro-batch per unit (default: what fits, see
    :func:`default_capacity`). ``cost``: a ready CostModel of one unit's compute (else derived from
    the model and cluster, or read from ``profile``); the planner plans with it plus the TP
    collectives (:func:`planner_cost`). ``pp``: pipeline stages (1F1B; ``pp`` must divide the
    layers; the planner plans ``gpus / (tp x pp)`` pipelines, ``cost`` is then one stage's).
    ``ep``: expert parallelism over blocks of ``ep`` units (an MoE model; the all-to-alls and the
    EP lockstep priced as in :mod:`~bytescale.sim.engine`; not with ``pp``).
    Raises ValueError on bad input, naming it.
    """
    shape = model_shape(model) if isinstance(model, str) else model
    cl = cluster(cluster_spec, gpus, gpus_per_node) if isinstance(cluster_spec, str) else cluster_spec
    check_tp(shape, cl, tp)
    pipes = check_pp(shape, cl, tp, pp)
    cm = cost if cost is not None else cost_model(shape, cl, efficiency, profile, tp, pp)
    pcm = planner_cost(cm, shape, cl, tp)
    cap = capacity if capacity is not None else default_capacity(shape, cl, cm, tp, pp)
    pipeline = None
    if pp > 1:
        per_token, bw, lat = p2p_terms(shape, cl, tp, pp)
        pipeline = {"fwd_share": FWD_SHARE, "p2p_bytes_per_token": per_token, "p2p_bw": bw, "p2p_latency": lat}
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        raise ValueError("the global batch is empty")
    if (lens < 1).any():
        k = int(np.argmax(lens < 1))
        raise ValueError(f"sequence {k} has length {int(lens[k])}; lengths must be >= 1")
    tokens = int(lens.sum())
    sum_sq = float((lens.astype(np.float64) ** 2).sum())
    plans: Dict[Any, Any] = {}
    out = []
    for name in strategies:
        sched = build_schedule(name, lens, pipes, cap, pcm, plans, pp, pipeline)
        res = simulate(sched, cl, shape, cm, tokens, sum_sq, grad_bytes, tp=tp, ep=ep)
        res.info["capacity"] = cap
        if pp > 1:
            res.info["stage_layers"] = shape.layers // pp
        out.append(res)
    return out
