"""Configuration in one place: the options of the planner, the loader, the runtime and the mesh,
and the list of environment knobs.

Training scripts fill these (``python -m bytescale.train`` derives its option sections from these
fields: their help, choices and bounds live here, in each field's metadata); every other API takes
them rather than loose keyword arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Tuple

if TYPE_CHECKING:
    from .parallel_dims import ParallelDims

__all__ = ["PlannerConfig", "LoaderConfig", "RuntimeConfig", "ParallelConfig", "ENV_KNOBS", "option"]

STRATEGIES = ("balanced", "naive", "pow2", "static", "pp-balance", "pp-lockstep")
OVERSIZE = ("split", "skip", "error")


def option(default: Any = None, help: str = "", choices: Optional[Tuple[Any, ...]] = None,
           min: Optional[float] = None, required: bool = False):
    """A config field with its help text, choices and lower bound (read by ``bytescale.train``'s
    option parser and ``--help``)."""
    meta = {"help": help, "choices": choices, "min": min}
    return field(metadata=meta) if required else field(default=default, metadata=meta)


@dataclass(frozen=True)
class PlannerConfig:
    """How each step's global batch is assigned to ranks (:func:`bytescale.plan`).

    capacity: tokens per micro-batch per rank (before ``memory`` multipliers).
    strategy: "balanced" (ours), "naive" (paper Alg. 1), "pow2" (Megatron-style dynamic CP) or
        "static" (the DP x CP baseline: one CP degree for every sequence, ``static_cp`` or the
        smallest power of two holding the step's longest sequence); for pipelines also
        "pp-balance" (the paper's PP-Balance) and "pp-lockstep" (Megatron's lockstep slots); all
        are C++ planner strategies returning the same :class:`bytescale.planner.Plan`.
    pp: pipeline stages (``bytescale.init_mesh(pp=P)``): the plan is over one stage's units,
        every micro-batch gets a 1F1B slot and ``makespan`` is the pipelined step.
    offload: let long sequences offload activations (paper Eq. 3) to use fewer ranks, never
        lengthening the step (not with "static": the baseline does not offload).
    offload_rule: "step" (Eq. 3 under the step's clock, default) or "paper-eq3" (the paper's
        literal Eq. 3, for the ablation); see :func:`bytescale.plan`.
    cost: a CostModel, a JSON profile path, a dict of coefficients, or None (defaults).
    speed, memory: per-rank relative speed and capacity multipliers (heterogeneous clusters).
    peer_budget: at most this many distinct ring neighbours per rank over the whole run (default
        4; 0: unbounded; otherwise >= 4): bounds NCCL's point-to-point buffers at any scale (see
        :func:`bytescale.plan`).
    """

    capacity: int = option(help="tokens per micro-batch per rank (per HDP unit with tensor parallelism)",
                           min=1, required=True)
    strategy: str = option("balanced", "planner strategy; static is the DP x CP baseline", choices=STRATEGIES)
    offload: bool = option(False, "let the planner offload activations of long sequences (paper Eq. 3)")
    offload_rule: str = option("step", "how offloading may shrink rings: step (never lengthens the step) or "
                                       "paper-eq3 (the paper's literal Eq. 3)", choices=("step", "paper-eq3"))
    cost: Any = option(None, "planner cost model (a JSON profile from bytescale.profile, a dict, a CostModel)")
    speed: Optional[Tuple[float, ...]] = option(None, "per-rank relative speeds")
    memory: Optional[Tuple[float, ...]] = option(None, "per-rank capacity multipliers")
    static_cp: Optional[int] = option(None, "CP degree of the static baseline (none: sized for the longest "
                                            "document)", min=1)
    pp: int = option(1, "pipeline stages the plan is for (the mesh's pp; slots and the 1F1B replay)", min=1)
    peer_budget: int = option(4, "most distinct ring neighbours per rank over the run (0: unbounded; else >= 4)",
                              min=0)

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"PlannerConfig.capacity must be an integer >= 1, got {self.capacity!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"PlannerConfig.strategy {self.strategy!r} is not one of {STRATEGIES}")
        if self.static_cp is not None and self.strategy != "static":
            raise ValueError("PlannerConfig.static_cp applies to strategy='static' only")
        if self.static_cp is not None and (isinstance(self.static_cp, bool) or not isinstance(self.static_cp, int)
                                           or self.static_cp < 1):
            raise ValueError(f"PlannerConfig.static_cp must be an integer >= 1 (or None), got {self.static_cp!r}")
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"PlannerConfig.pp must be an integer >= 1, got {self.pp!r}")
        if (isinstance(self.peer_budget, bool) or not isinstance(self.peer_budget, int) or self.peer_budget < 0
                or 0 < self.peer_budget < 4):
            raise ValueError(f"PlannerConfig.peer_budget must be 0 (unbounded) or an integer >= 4, "
                             f"got {self.peer_budget!r}")
        if self.offload_rule not in ("step", "paper-eq3"):
            raise ValueError(f"PlannerConfig.offload_rule {self.offload_rule!r} is not 'step' or 'paper-eq3'")
        if self.strategy == "static" and self.offload:
            raise ValueError("PlannerConfig: strategy='static' (the DP x CP baseline) does not offload; "
                             "set offload=False or choose an HDP strategy")

    def plan(self, lengths, world_size):
        """Plan one global batch of ``lengths`` over ``world_size`` ranks, or over the HDP units of
        a :class:`bytescale.planner.UnitMap` (:func:`bytescale.plan`)."""
        from .planner import plan

        return plan(lengths, world_size=world_size, capacity=self.capacity, strategy=self.strategy,
                    offload=self.offload, cost=self.cost, speed=self.speed, memory=self.memory,
                    static_cp=self.static_cp, offload_rule=self.offload_rule, pp=self.pp,
                    peer_budget=self.peer_budget)


@dataclass(frozen=True)
class LoaderConfig:
    """How the loader forms and delivers steps (:class:`bytescale.data.HDPLoader`).

    tokens_per_batch: global batch token budget; seed: the sample order's seed.
    prefetch: prepare step k+1 in a background thread while step k trains.
    check_plan: all-reduce a fingerprint of each step's plan so ranks that planned differently fail
        with a clear error instead of deadlocking in a ring (needs a process group).
    The loader delivers each rank the plan's own micro-batches; which run when (lockstep slots
        under FSDP2 or expert parallelism, 1F1B with pipelines) is the step executor's schedule
        (:mod:`bytescale.runtime.schedule`).
    max_steps: stop after this many steps (None: endless).
    oversize: what happens to a document longer than any plan of the mesh can hold
        (:func:`bytescale.planner.longest_document`: units x capacity, more with offloading):
        "split" (default) cuts it into consecutive pieces that fit, no token dropped; "skip" leaves
        it out (counted and logged); "error" refuses at construction naming the count and the
        first documents. A dataset or token store is checked before the first step, in one pass
        over its lengths; streaming sources (the data service) apply the option per drawn
        document and never end the run ("error" there skips the document and logs it as an error).
    """

    tokens_per_batch: int = option(help="global batch size in tokens", min=1, required=True)
    seed: int = option(0, "seed of the global batch order")
    prefetch: bool = option(True, "prepare the next step while this one trains")
    check_plan: bool = option(True, "compare a fingerprint of each step's plan across ranks")
    max_steps: Optional[int] = option(None, "stop after this many steps", min=0)
    oversize: str = option("split", "documents longer than any plan of the mesh can hold: split (consecutive "
                                    "pieces, no token dropped), skip (counted), or error (refuse at start)",
                           choices=OVERSIZE)

    def __post_init__(self) -> None:
        if self.oversize not in OVERSIZE:
            raise ValueError(f"LoaderConfig.oversize {self.oversize!r} is not one of {OVERSIZE}")
        if isinstance(self.tokens_per_batch, bool) or not isinstance(self.tokens_per_batch, int) \
                or self.tokens_per_batch < 1:
            raise ValueError(f"LoaderConfig.tokens_per_batch must be an integer >= 1, got {self.tokens_per_batch!r}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"LoaderConfig.max_steps must be >= 0, got {self.max_steps}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How :class:`bytescale.HybridDataParallel` runs micro-batches and synchronises gradients.

    bucket_cap_mb: gradient all-reduce bucket size. broadcast_parameters: start every replica from
    rank 0's parameters. bf16_grad_comm: ring attention's travelling dK/dV accumulators in bf16 (half
    the backward ring traffic). offload_min_bytes: saved activations smaller than this stay on the
    device when a micro-batch offloads.
    """

    bucket_cap_mb: float = option(25.0, "gradient all-reduce bucket size (MiB)", min=0.0)
    broadcast_parameters: bool = option(True, "start every replica from the first rank's parameters")
    bf16_grad_comm: bool = option(False, "ring attention's dK/dV traffic in bf16")
    offload_min_bytes: int = option(1 << 16, "saved activations smaller than this stay on the device", min=0)

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"RuntimeConfig.bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.offload_min_bytes < 0:
            raise ValueError(f"RuntimeConfig.offload_min_bytes must be >= 0, got {self.offload_min_bytes}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is laid out over the mesh (:func:`bytescale.init_mesh`,
    :func:`bytescale.models.parallel.tensor_parallel`, FSDP2).

    tp: tensor-parallel ranks per HDP unit (TP innermost). sequence_parallel: norms on tokens / tp.
    fsdp: shard parameters, gradients and optimizer state with FSDP2 over the HDP dimension.
    ep: expert-parallel degree (:func:`bytescale.models.expert_parallel`).
    pp: pipeline stages (outermost; :class:`bytescale.runtime.StepExecutor` runs them 1F1B).
    """

    tp: int = option(1, "tensor-parallel degree: ranks per HDP unit (the mesh is hdp x tp, TP innermost; the "
                        "planner plans world/tp units)", min=1)
    sequence_parallel: bool = option(False, "with tp > 1: norms on tokens/tp (sequence parallelism; the "
                                            "package's Llama)")
    fsdp: bool = option(False, "shard parameters, gradients and optimizer state with FSDP2 fully_shard over "
                               "the HDP dimension")
    ep: int = option(1, "expert-parallel degree: each MoE layer's experts sharded over blocks of ep consecutive HDP "
                        "units, tokens exchanged by all-to-all", min=1)
    pp: int = option(1, "pipeline-parallel degree: stages of the package's Llama (outermost; the mesh is "
                        "pp x hdp x tp), each stage's HDP units planned with 1F1B slots (use --strategy pp-balance)",
                     min=1)

    def __post_init__(self) -> None:
        from .parallel_dims import check_composition  # the one compatibility matrix

        try:
            check_composition(self.pp, self.tp, self.ep, self.fsdp, self.sequence_parallel)
        except ValueError as e:
            raise ValueError(f"ParallelConfig: {e}") from None

    def dims(self, world: int) -> "ParallelDims":
        """These sizes over ``world`` ranks (:class:`bytescale.parallel_dims.ParallelDims`)."""
        from .parallel_dims import ParallelDims

        return ParallelDims(world, pp=self.pp, tp=self.tp, ep=self.ep, fsdp=self.fsdp, sp=self.sequence_parallel)


ENV_KNOBS = {
    "BYTESCALE_CHECK_COLLECTIVES": (
        "1", "0 turns off the cross-rank fingerprint check before CPU collectives (same value on "
             "every rank); read once per process (csrc/common/env.h)."),
    "BYTESCALE_TRAIN_TIMEOUT_S": (
        "600", "python -m bytescale.train: the process groups' timeout in seconds (a collective or ring "
               "exchange waiting longer for a peer raises; the checkpoint writer's group too)."),
    "BYTESCALE_CHECK_RING": (
        "1", "0 turns off ring attention's agreement check (members compare a digest of documents, "
             "ring order, dtype, head shapes, causal, scale before any K/V moves; same value on "
             "every rank); read once per process (csrc/common/env.h)."),
    "BYTESCALE_NCCL_ORDER": (
        "0", "1: CUDA's execution model on CPU, for tests: every operation of a rank (world and dynamic-group "
             "collectives, point-to-point exchanges) on one in-order queue, as on one NCCL stream, and every "
             "backward on a separate thread, as CUDA autograd does (bytescale.testing); read once per process "
             "(csrc/common/env.h)."),
    "BYTESCALE_CUDA_TRANSPORT": (
        "nccl", "the transport of CUDA tensors: nccl, or staged (every message through host memory over "
                "Gloo, so several processes can share one GPU: a test tool; python -m bytescale.train then "
                "puts process LOCAL_RANK on GPU LOCAL_RANK mod the GPU count); read once per process "
                "(csrc/common/env.h)."),
    "BYTESCALE_ATTENTION_KERNEL": (
        "auto", "per-ring-step attention kernel: auto, flash, cudnn (CUDA), sdpa (CPU) or tiled; read once "
                "per process (csrc/common/env.h)."),
}
"""Every environment variable bytescale reads: name -> (default, meaning)."""
