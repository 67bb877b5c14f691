"""Prices a :class:`~bytescale.sim.strategies.Schedule` on a cluster and replays it.

Per micro-batch on one rank (all times per layer, then x layers; a1, b1, g, a2, b2 from the cost
model, :mod:`bytescale.sim.model`):

* compute: ``a1 x attn + b1 x tokens + g`` where ``attn`` is the rank's share of the attention work
  (sum of s^2 / ring size) and ``tokens`` the tokens it holds (``g`` once per micro-batch: one
  varlen kernel call per layer);
* ring communication (ring size d > 1): ``d - 1`` ring steps, each moving this rank's K/V shard
  forward and K/V plus their gradients backward (3 transfers of ``kv_bytes x tokens`` at the link's
  bandwidth, plus 3 latencies). The link is NVLink when no hop of the ring, in its actual member
  order, leaves a node (``Schedule.ring_node_hops``), the inter-node link otherwise (a ring
  advances at its slowest hop). Under the planner's peer budget a ring is an interval of ranks, so
  a ring that fits a node stays on NVLink. Each step overlaps with that step's
  attention block (``a1 x attn / d``); what compute does not cover is exposed:
  ``(d-1) x max(0, step_comm - a1 attn / d)``; where the cluster has a measured price of ring
  micro-batches (``ring_a1 x attn + ring_b1 x tokens + (ring_step_s + ring_doc_step_s x docs) x
  d + ring_call_s``, :class:`ClusterSpec`), their compute is that instead;
* offloading (ratio r, chosen by the planner with Eq. 3): ``r x Act(tokens)`` bytes go to the host
  during the forward (hidden under the forward, a third of the compute) and come back during the
  backward (hidden under the other two thirds); what does not fit is exposed;
* tensor parallelism (``tp`` > 1; :mod:`bytescale.sim.model`): a schedule's rank is an HDP unit of
  ``tp`` GPUs of one node, every GPU of a unit running the unit's micro-batches in lockstep (so a
  unit's times are one GPU's); the cost model is one GPU's share, the TP collectives
  (``tp_comm``: per token and per micro-batch, :func:`~bytescale.sim.model.tp_comm_time`) are
  exposed; a ring of d units is ``tp`` rings in parallel, one per TP index, each GPU moving its
  local K/V heads over its own link (NVLink when the units share a node).

* pipeline parallelism (``Schedule.pp`` = P > 1; :mod:`bytescale.sim.model`): a schedule's rank is
  a PIPELINE (the unit at each of P stages, each stage ``layers / P`` layers, ``cost`` one stage's);
  the prices above are one stage's and the same at every stage; a micro-batch's forward is
  ``FWD_SHARE`` of it, its backward the rest; between stages its activations (forward) and their
  gradients (backward) cross one link (:func:`~bytescale.sim.model.p2p_terms`). The C++ 1F1B
  replay (``bytescale._C.planner.pipeline_replay`` of ``Schedule.layout``, csrc/planner/pipeline.h) runs every
  stage's warm-up, steady state and cool-down over the schedule's slots, a ring at every stage on
  its member pipelines at once; the bubble is idle time. Ring links are judged on the first
  stage's units.

The micro-batch durations go to the planner's C++ replay of the schedule's view
(``bytescale._C.planner.replay(Schedule.layout, durations)``, csrc/planner/replay.h): every
rank runs its micro-batches in order, a ring micro-batch starts when all its members are free, and
the waiting is idle time (so is a ring member's wait for the ring's slowest member: zig-zag
shards can differ by a token). After the last micro-batch: the gradient synchronisation (a ring
all-reduce of bf16 gradients over all ranks, each GPU its TP shard over the units, not overlapped
with compute: conservative, the same for every strategy). Before the first: the data-loading stall (``Schedule.loader``): ``global``
costs ``global batch tokens x 4 bytes / loader_bw`` (every node reads the whole batch to learn its
lengths before the plan exists), ``local`` and ``remote`` are prefetched under the previous step.

Expert parallelism (``ep`` > 1, an MoE shape): each micro-batch's MoE layers add four all-to-alls
per layer (dispatch and combine, forward and backward), each moving ``top_k x hidden x 2`` bytes
per token of which ``(ep-1)/ep`` leave the GPU, plus ``ep - 1`` latencies, on NVLink when an EP
block of ``ep`` units fits a node, else on the inter-node link; they are counted as exposed
communication (no overlap). The schedule then runs in EP lockstep (``bytescale._C.planner.ep_replay``,
the planner's step model: its lockstep slots, locals longest first as the loader orders them): a
block's units advance slot by slot together, a ring joins its members' blocks, and padding slots
wait. Gradients: each GPU all-reduces its dense parameters and 1/ep of the experts.

Per rank, ``compute + exposed_comm + tp_comm + offload + idle + grad_sync + data_stall +
step_overhead == step_time`` (``step_overhead``: a stated fixed per-step cost such as the optimizer step, 0 unless
given).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .cluster import ClusterSpec
from .model import FWD_SHARE, ModelShape, check_pp, check_tp, gpu_params, p2p_terms, tp_comm_time
from .strategies import Schedule

__all__ = ["SimResult", "simulate", "micro_batch_times", "ep_comm_time", "check_ep", "BYTES_PER_TOKEN_READ"]

BYTES_PER_TOKEN_READ = 4.0  # int32 token ids (bytescale's token store)


@dataclass(frozen=True, eq=False)
class SimResult:
    """One strategy's simulated step. Arrays are per rank, an HDP unit of ``tp`` GPUs (``compute``
    ... ``idle``, ``tp_comm``) or per micro-batch (``mb_start``, ``mb_end``, ``mb_comm``,
    ``mb_compute``, ``mb_offload``, ``mb_tp_comm``)."""

    strategy: str
    step_time_s: float
    tokens: int
    tokens_per_s: float
    mfu: float
    compute: np.ndarray
    exposed_comm: np.ndarray
    offload: np.ndarray
    idle: np.ndarray
    grad_sync_s: float
    data_stall_s: float
    step_overhead_s: float
    mb_start: np.ndarray
    mb_end: np.ndarray
    mb_compute: np.ndarray
    mb_comm: np.ndarray
    mb_offload: np.ndarray
    schedule: Schedule
    tp_comm: np.ndarray = field(default_factory=lambda: np.zeros(0))
    mb_tp_comm: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tp: int = 1
    info: Dict[str, Any] = field(default_factory=dict)
    pp: int = 1
    bubble: float = 0.0  # pp > 1: idle share of the micro-batch phase over every stage (1F1B replay)

    @property
    def world(self) -> int:
        """HDP ranks (units of ``tp`` GPUs), or pipelines of ``pp`` such units."""
        return self.schedule.world

    @property
    def gpus(self) -> int:
        return self.schedule.world * self.tp * self.pp

    def breakdown(self) -> Dict[str, float]:
        """Seconds per step, averaged over ranks (they sum to ``step_time_s``)."""
        tpc = float(self.tp_comm.mean()) if self.tp_comm.size else 0.0
        return {"compute_s": float(self.compute.mean()), "exposed_comm_s": float(self.exposed_comm.mean()),
                "tp_comm_s": tpc, "offload_s": float(self.offload.mean()), "idle_s": float(self.idle.mean()),
                "grad_sync_s": self.grad_sync_s, "data_stall_s": self.data_stall_s,
                "step_overhead_s": self.step_overhead_s}

    def to_dict(self) -> Dict[str, Any]:
        """The JSON record of the strategy (CLI ``--json``)."""
        b = self.breakdown()
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "tokens": self.tokens, "breakdown": b,
                "breakdown_share": {k: v / self.step_time_s if self.step_time_s > 0 else 0.0 for k, v in b.items()},
                "per_rank": {"compute_s": _stats(self.compute), "exposed_comm_s": _stats(self.exposed_comm),
                             "tp_comm_s": _stats(self.tp_comm), "offload_s": _stats(self.offload),
                             "idle_s": _stats(self.idle)},
                "tp": self.tp, "pp": self.pp, "bubble": self.bubble, "gpus": self.gpus,
                "micro_batches": self.schedule.num_micro_batches,
                "micro_batches_per_rank_max": int(np.diff(self.schedule.rank_mb).max()) if self.world else 0,
                # the layout: sequences (and tokens) in local micro-batches, i.e. not sharded
                "local_sequences": int(self.schedule.mb_docs[self.schedule.mb_ring < 0].sum()),
                "local_tokens": float(self.schedule.mb_tokens[self.schedule.mb_ring < 0].sum()),
                **{k: (None if isinstance(v, float) and v != v else v) for k, v in self.info.items()}}


def _stats(x: np.ndarray) -> Dict[str, float]:
    return {"min": float(x.min()), "mean": float(x.mean()), "max": float(x.max())} if x.size else {}


def micro_batch_times(s: Schedule, cl: ClusterSpec, cost: Any, tp: int = 1,
                      tp_comm: Tuple[float, float] = (0.0, 0.0)) -> Dict[str, np.ndarray]:
    """Per micro-batch ``compute``, exposed ``comm``, exposed ``offload`` and ``tp_comm`` seconds
    (module doc). ``tp``: GPUs per rank (unit); ``tp_comm``: the TP collectives' (seconds per token,
    seconds per micro-batch) per layer."""
    L = float(cost.layers)
    attn = cost.a1 * s.mb_attn
    layer = attn + cost.b1 * s.mb_tokens + cost.g * (s.mb_tokens > 0)
    ring = s.mb_ring >= 0
    if ring.any() and cl.measured_ring:
        # ring micro-batches at the cluster's measured price (ClusterSpec.ring_* fields)
        layer = layer.copy()
        d = s.mb_ring_size[ring]
        layer[ring] = (cl.ring_a1 * s.mb_attn[ring] + cl.ring_b1 * s.mb_tokens[ring]
                       + (cl.ring_step_s + cl.ring_doc_step_s * s.mb_docs[ring]) * d + cl.ring_call_s)
    compute = L * layer
    tpc = L * (tp_comm[0] * s.mb_tokens + tp_comm[1] * (s.mb_tokens > 0))
    comm = np.zeros_like(compute)
    if ring.any():
        crosses = s.ring_crosses_nodes(max(1, cl.gpus_per_node // tp))[s.mb_ring[ring]]
        bw = np.where(crosses, cl.inter_bw, cl.intra_bw)
        lat = np.where(crosses, cl.inter_latency, cl.intra_latency)
        d = s.mb_ring_size[ring].astype(np.float64)
        step_comm = 3.0 * (lat + cost.kv_bytes_per_token * s.mb_tokens[ring] / bw)
        comm[ring] = L * (d - 1) * np.maximum(0.0, step_comm - attn[ring] / d)
    off = np.zeros_like(compute)
    has = s.mb_offload > 0
    if has.any():
        act = cost.a2 * s.mb_tokens[has] + cost.b2
        copy = s.mb_offload[has] * act / cl.host_bw
        busy = layer[has] + tpc[has] / L  # copies run beside the compute and the TP collectives
        off[has] = L * (np.maximum(0.0, copy - busy / 3.0) + np.maximum(0.0, copy - 2.0 * busy / 3.0))
    return {"compute": compute, "comm": comm, "offload": off, "tp_comm": tpc}


def ep_comm_time(shape: ModelShape, cl: ClusterSpec, tp: int, ep: int) -> Tuple[float, float]:
    """The MoE all-to-alls of one layer, forward and backward, on one GPU: (seconds per token,
    seconds per micro-batch); (0, 0) at ep = 1 (module docstring)."""
    if ep == 1:
        return 0.0, 0.0
    inside = ep * tp <= cl.gpus_per_node
    bw, lat = (cl.intra_bw, cl.intra_latency) if inside else (cl.inter_bw, cl.inter_latency)
    return 4.0 * (ep - 1) / ep * shape.top_k * shape.hidden * 2.0 / bw, 4.0 * (ep - 1) * lat


def check_ep(shape: ModelShape, units: int, ep: int) -> None:
    """Raise ValueError naming the values when ``ep`` cannot shard the model's experts over
    blocks of ``units`` HDP units."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be an integer >= 1, got {ep!r}")
    if ep == 1:
        return
    if not shape.experts:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model; {shape.name} is dense")
    if shape.experts % ep:
        raise ValueError(f"ep={ep} does not divide the {shape.experts} experts of {shape.name}")
    if units % ep:
        raise ValueError(f"ep={ep} does not divide the {units} HDP units")


def _per_rank(s: Schedule, x: np.ndarray) -> np.ndarray:
    return np.bincount(s.mb_rank, weights=x, minlength=s.world)


def simulate(s: Schedule, cl: ClusterSpec, shape: ModelShape, cost: Any, tokens: int,
             sum_sq: float, grad_bytes: Optional[float] = None, step_overhead_s: float = 0.0,
             tp: int = 1, ep: int = 1) -> SimResult:
    """Simulates one step of schedule ``s`` (module docstring). ``tokens``/``sum_sq``: the global
    batch's tokens and sum of squared document lengths (for tokens/s and MFU); ``grad_bytes``:
    bytes each GPU all-reduces per step (default: bf16 gradients of its parameters, its TP shard);
    ``step_overhead_s``: a fixed per-step cost outside the micro-batches (the optimizer step,
    gradient clipping; 0 by default: negligible next to a large model's step, measured by
    ``benchmarks/validate_sim.py`` for its CPU runs); ``tp``: GPUs per HDP unit (a rank of ``s``),
    ``cost`` being one unit's compute (:func:`~bytescale.sim.model.cost_model` with the same tp);
    ``ep``: expert parallelism over blocks of ``ep`` units (module docstring)."""
    from .. import _C

    check_tp(shape, cl, tp)
    check_ep(shape, s.world, ep)
    pp = s.pp
    if pp > 1:
        check_pp(shape, cl, tp, pp)
        if ep > 1:
            raise ValueError(f"ep={ep} with {pp} pipeline stages is not modelled; simulate one of them")
        if s.mb_slot is None or s.mb_slot.shape != s.mb_ring.shape:
            raise ValueError(f"schedule for {pp} stages without a slot per micro-batch")
    if s.world * tp * pp > cl.gpus:
        raise ValueError(f"schedule for {s.world} {'pipelines' if pp > 1 else 'ranks'}"
                         + (f" of {tp} GPUs" if tp > 1 else "") + (f" x {pp} stages" if pp > 1 else "")
                         + f" on a cluster of {cl.gpus} devices")
    t = micro_batch_times(s, cl, cost, tp, tp_comm_time(shape, cl, tp))
    if ep > 1:
        per_token, per_call = ep_comm_time(shape, cl, tp, ep)
        t["comm"] = t["comm"] + float(shape.layers) * (per_token * s.mb_tokens + per_call * (s.mb_tokens > 0))
    dur = t["compute"] + t["comm"] + t["tp_comm"] + t["offload"]
    bubble = 0.0
    if pp > 1:
        per_token, bw, lat = p2p_terms(shape, cl, tp, pp)
        p2p = lat + per_token * s.mb_tokens / bw
        fwd = np.repeat(FWD_SHARE * dur, pp)
        bwd = np.repeat(dur, pp) - fwd
        prep = _C.planner.pipeline_replay(s.layout, fwd, bwd, np.ascontiguousarray(p2p))
        bubble = float(prep.bubble)
        rep_step = float(prep.step_time)
        # the first stage's view: a micro-batch from its forward to its backward there
        rep_start = np.asarray(prep.fwd_start).reshape(-1, pp)[:, 0]
        rep_end = np.asarray(prep.bwd_end).reshape(-1, pp)[:, 0]
    else:
        d = np.ascontiguousarray(dur)
        if ep > 1 or s.info.get("lockstep"):
            # EP: blocks of ep units in lockstep, locals costliest first in their free slots; the
            # paper's rows before its balance scheduler: the whole world in lockstep
            rep = _C.planner.ep_replay(s.layout, ep if ep > 1 else s.world, d, d)
        else:
            rep = _C.planner.replay(s.layout, d)
        rep_start, rep_end, rep_step = np.asarray(rep.mb_start), np.asarray(rep.mb_end), float(rep.step_time)
    if grad_bytes is None:
        grad_bytes = 2.0 * gpu_params(shape, tp, pp)
        if ep > 1:  # each GPU holds 1/ep of the experts (their gradients sum over ranks holding the same)
            grad_bytes -= 2.0 * shape.layers * 3 * shape.hidden * shape.ffn * shape.experts / tp * (1 - 1 / ep)
    sync = cl.allreduce_time(grad_bytes, s.world, max(1, cl.gpus_per_node // tp))
    stall = 0.0
    if s.loader == "global":
        stall = tokens * BYTES_PER_TOKEN_READ / cl.loader_bw
    if not step_overhead_s >= 0:
        raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s!r}")
    step = rep_step + sync + stall + step_overhead_s
    flops = shape.flops(tokens, sum_sq)
    comp, comm, off = _per_rank(s, t["compute"]), _per_rank(s, t["comm"]), _per_rank(s, t["offload"])
    tpc = _per_rank(s, t["tp_comm"])
    # idle = waiting for ring partners (including a ring's faster members waiting for its slowest
    # one, which the replay counts as busy) + the tail after the rank's last micro-batch
    idle = rep_step - (comp + comm + tpc + off)
    return SimResult(
        strategy=s.strategy, step_time_s=step, tokens=int(tokens),
        tokens_per_s=tokens / step if step > 0 else float("inf"),
        mfu=flops / (step * s.world * tp * pp * cl.peak_flops) if step > 0 else 0.0,
        pp=pp, bubble=bubble,
        compute=comp, exposed_comm=comm, offload=off, idle=idle, grad_sync_s=sync, data_stall_s=stall,
        step_overhead_s=float(step_overhead_s),
        mb_start=rep_start + stall, mb_end=rep_end + stall,
        mb_compute=t["compute"], mb_comm=t["comm"], mb_offload=t["offload"], schedule=s,
        tp_comm=tpc, mb_tp_comm=t["tp_comm"], tp=tp,
        info={"planner_predicted_step_s": s.planner_step, "replay_step_s": rep_step, "ep": ep,
              **({"p2p_s": float(p2p.sum())} if pp > 1 else {}),
              **s.info})
