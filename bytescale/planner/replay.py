"""What a plan's replay returns: :class:`Replay` (the flat step) and :class:`PipelineReplay` (1F1B)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _C

__all__ = ["Replay", "PipelineReplay"]


@dataclass(frozen=True)
class Replay:
    """A plan replayed in the runtime's model of a step (:meth:`Plan.replay`).

    ``start``/``end``: per micro-batch (indexed like ``Plan.raw.mb_cost``); ``rank_finish``: end of
    each rank's last micro-batch; ``rank_busy``: time inside micro-batches; ``rank_idle``:
    ``step_time - rank_busy``; ``step_time``: the step's end (max of ``rank_finish``). Arrays are
    read-only float64.
    """

    start: np.ndarray
    end: np.ndarray
    rank_finish: np.ndarray
    rank_busy: np.ndarray
    rank_idle: np.ndarray
    step_time: float

    @classmethod
    def _wrap(cls, r: "_C.planner.ReplayResult") -> "Replay":
        return cls(r.mb_start, r.mb_end, r.rank_finish, r.rank_busy, r.rank_idle, float(r.step_time))


@dataclass(frozen=True)
class PipelineReplay:
    """A pipelined plan replayed under 1F1B (:meth:`Plan.pipeline_replay`).

    ``fwd_start`` ... ``bwd_end``: float64 ``[micro-batches, stages]`` (micro-batches indexed like
    ``Plan.raw.mb_cost``); ``pipe_finish``: per pipeline, the end of its last operation;
    ``stage_busy``: ``[pipelines, stages]`` time inside operations; ``step_time``: the latest
    finish; ``bubble``: the idle share of the step over every stage of every pipeline (pipeline
    warm-up and cool-down, waits for ring partners and transfers, pipelines ending early).
    """

    fwd_start: np.ndarray
    fwd_end: np.ndarray
    bwd_start: np.ndarray
    bwd_end: np.ndarray
    pipe_finish: np.ndarray
    stage_busy: np.ndarray
    step_time: float
    bubble: float

    @classmethod
    def _wrap(cls, r: "_C.planner.PipelineReplay") -> "PipelineReplay":
        H, P = int(r.pipelines), int(r.stages)
        return cls(*(np.asarray(a).reshape(-1, P) for a in (r.fwd_start, r.fwd_end, r.bwd_start, r.bwd_end)),
                   np.asarray(r.pipe_finish), np.asarray(r.stage_busy).reshape(H, P), float(r.step_time),
                   float(r.bubble))
