"""Which documents a plan can hold at all: the planner's feasibility rule (csrc/planner/feasibility.h).

A document fits a plan of given options over ``units`` HDP units (pipelines, with ``pp`` > 1) when
it fits the largest unit's capacity, or when its memory floor (``ceil(Act(s) / Act(capacity))``
units, or with offloading the paper's Eq. 3 minimum) is at most ``units``; under the static
DP x CP baseline its CP group must hold it too. The planner refuses a batch by the same rule, so
a document within :func:`longest_document` never makes a step fail for want of ranks.

    limit = longest_document(PlannerConfig(capacity=4096), units=3)   # 12288
    too_long = np.flatnonzero(lengths > limit)                          # one numpy pass
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np

from .. import _C
from .units import UnitMap

__all__ = ["longest_document", "documents_fit"]


def _plan_options(planner: Any, units: Union[int, UnitMap]):
    from . import _options

    n = units.num_units if isinstance(units, UnitMap) else int(units)
    return _options(n, planner.capacity, planner.strategy, planner.offload, planner.cost, planner.speed,
                    planner.memory, planner.static_cp, planner.pp, None, planner.offload_rule)


def longest_document(planner: Any, units: Union[int, UnitMap]) -> int:
    """The largest ``L`` such that every document of 1..L tokens can be planned with ``planner``
    (a :class:`bytescale.config.PlannerConfig`) over ``units`` HDP units (an int or a
    :class:`UnitMap`): ``units x capacity`` without offloading, more with it, the CP group's
    tokens under the static baseline. ``2**40`` (the planner's maximum length) when all can.

    Raises:
        ValueError: options the planner would refuse (naming the field).
    """
    return int(_C.planner.longest_sequence(_plan_options(planner, units)))


def documents_fit(planner: Any, units: Union[int, UnitMap], lengths: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """Per length, whether the planner can place a document of that many tokens (bool array; the
    exact rule, which with offloading may hold a few lengths above :func:`longest_document`)."""
    arr = np.ascontiguousarray(np.asarray(lengths, dtype=np.int64).reshape(-1))
    return np.asarray(_C.planner.sequence_fits(arr, _plan_options(planner, units)), dtype=bool)
