"""Configuration in one place: the options of the planner, the loader and the runtime, and the
list of environment knobs.

Training scripts fill these (``python -m bytescale.train`` from its TrainConfig); every other API takes
them rather than loose keyword arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

__all__ = ["PlannerConfig", "LoaderConfig", "RuntimeConfig", "ENV_KNOBS"]

STRATEGIES = ("balanced", "naive", "pow2", "static")


@dataclass(frozen=True)
class PlannerConfig:
    """How each step's global batch is assigned to ranks (:func:`bytescale.plan`).

    capacity: tokens per micro-batch per rank (before ``memory`` multipliers).
    strategy: "balanced" (ours), "naive" (paper Alg. 1), "pow2" (Megatron-style dynamic CP) or
        "static" (the DP x CP baseline: one CP degree for every sequence, ``static_cp`` or the
        smallest power of two holding the longest sequence).
    offload: let long sequences offload activations (paper Eq. 3) to use fewer ranks.
    cost: a CostModel, a JSON profile path, a dict of coefficients, or None (defaults).
    speed, memory: per-rank relative speed and capacity multipliers (heterogeneous clusters).
    """

    capacity: int
    strategy: str = "balanced"
    offload: bool = False
    cost: Any = None
    speed: Optional[Tuple[float, ...]] = None
    memory: Optional[Tuple[float, ...]] = None
    static_cp: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"PlannerConfig.capacity must be an integer >= 1, got {self.capacity!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"PlannerConfig.strategy {self.strategy!r} is not one of {STRATEGIES}")
        if self.static_cp is not None and self.strategy != "static":
            raise ValueError("PlannerConfig.static_cp applies to strategy='static' only")

    def plan(self, lengths, world_size: int):
        """Plan one global batch of ``lengths`` over ``world_size`` ranks."""
        if self.strategy == "static":
            from .data.baselines import static_cp_plan

            return static_cp_plan(lengths, world_size, self.capacity, self.static_cp)
        from .planner import plan

        return plan(lengths, world_size=world_size, capacity=self.capacity, strategy=self.strategy,
                    offload=self.offload, cost=self.cost, speed=self.speed, memory=self.memory)


@dataclass(frozen=True)
class LoaderConfig:
    """How the loader forms and delivers steps (:class:`bytescale.data.HDPLoader`).

    tokens_per_batch: global batch token budget; seed: the sample order's seed.
    prefetch: prepare step k+1 in a background thread while step k trains.
    check_plan: all-reduce a fingerprint of each step's plan so ranks that planned differently fail
        with a clear error instead of deadlocking in a ring (needs a process group).
    lockstep: every rank runs the same number of micro-batch slots (empty ones as padding) and ring
        members meet in the same slot: for sharded parameters (FSDP2), whose forward all-gathers
        need every rank.
    max_steps: stop after this many steps (None: endless).
    """

    tokens_per_batch: int
    seed: int = 0
    prefetch: bool = True
    check_plan: bool = True
    lockstep: bool = False
    max_steps: Optional[int] = None

    def __post_init__(self) -> None:
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

    bucket_cap_mb: float = 25.0
    broadcast_parameters: bool = True
    bf16_grad_comm: bool = False
    offload_min_bytes: int = 1 << 16

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"RuntimeConfig.bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.offload_min_bytes < 0:
            raise ValueError(f"RuntimeConfig.offload_min_bytes must be >= 0, got {self.offload_min_bytes}")


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
    "BYTESCALE_ATTENTION_KERNEL": (
        "auto", "per-ring-step attention kernel: auto, flash, cudnn (CUDA), sdpa (CPU) or tiled; read once "
                "per process (csrc/common/env.h)."),
}
"""Every environment variable bytescale reads: name -> (default, meaning)."""
