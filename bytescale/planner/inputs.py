"""The planner's inputs checked and turned into C++ ``PlanOptions`` (every bad value named), and the
sizes derived from them (:func:`static_cp_degree`, :func:`stage_layers`)."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from .. import _C
from .cost import CostModel, load_cost_model

__all__ = ["static_cp_degree", "stage_layers", "OFFLOAD_RULES"]


def _positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, or a ValueError naming it (bools and non-integral numbers too)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"plan(): {name} must be an integer >= 1, got {value!r}")
    return int(value)


_MAX_LENGTH = 1 << 40  # the C++ planner's limit


def _check_each(values: Sequence[Any]) -> np.ndarray:
    """The slow path: every value must be an int (not a bool) or an integral float in range."""
    out = np.empty(len(values), dtype=np.int64)
    for k, x in enumerate(values):
        ok = isinstance(x, (int, np.integer, float, np.floating)) and not isinstance(x, (bool, np.bool_))
        if ok and isinstance(x, (float, np.floating)):
            ok = math.isfinite(x) and float(x).is_integer()
        if not ok or not 1 <= x <= _MAX_LENGTH:
            raise ValueError(f"plan(): sequence {k} has length {x!r} (lengths[{k}]); lengths must "
                             f"be integers in [1, 2^40]")
        out[k] = int(x)
    return out


def _lengths_array(lengths: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """The lengths as a contiguous int64 array, after checking every value is an integer >= 1.

    Checked before any conversion (a cast to int64 would truncate 1.5 to 1 and NaN to garbage);
    integral floats (``2.0``) are accepted. Raises ValueError naming the first bad index and value.
    """
    if isinstance(lengths, np.ndarray):
        arr = lengths.reshape(-1)
    else:
        seq = list(lengths)
        if not seq:
            return np.zeros(0, dtype=np.int64)
        if not all(issubclass(t, (int, float, np.integer, np.floating)) and not issubclass(t, (bool, np.bool_))
                   for t in set(map(type, seq))):
            return _check_each(seq)
        arr = np.asarray(seq)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind in "iu":
        bad = (arr < 1) | (arr > _MAX_LENGTH)
    elif kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr < 1) | (arr != np.floor(arr)) | (arr > _MAX_LENGTH)
    else:  # bools, strings, objects, complex numbers, ...
        return _check_each(arr.tolist())
    if bad.any():
        k = int(np.argmax(bad))
        raise ValueError(f"plan(): sequence {k} has length {arr[k].item()!r} (lengths[{k}]); "
                         f"lengths must be integers in [1, 2^40]")
    return np.ascontiguousarray(arr.astype(np.int64))


def static_cp_degree(longest: int, capacity: int, world_size: int) -> int:
    """The static DP x CP baseline's CP degree: the smallest power of two ``cp`` with
    ``cp * capacity >= longest`` (C++, ``csrc/planner/static_cp.cpp``).

    Raises:
        ValueError: the degree exceeds ``world_size`` (naming the values), or a bad argument.
    """
    if isinstance(longest, (bool, np.bool_)) or not isinstance(longest, (int, np.integer)) or longest < 0:
        raise ValueError(f"static_cp_degree: longest must be an integer >= 0, got {longest!r}")
    return int(_C.planner.static_cp_degree(int(longest), _positive_int("capacity", capacity),
                                           _positive_int("world_size", world_size)))


def stage_layers(layers: int, pp: int) -> int:
    """Layers of one pipeline stage when ``layers`` are cut into ``pp`` equal stages (the cost
    model's ``layers`` for a plan with ``pp`` stages).

    Raises:
        ValueError: ``pp`` does not divide ``layers`` (naming both), or either is < 1.
    """
    return int(_C.planner.stage_layers(_positive_int("layers", layers), _positive_int("pp", pp)))


_PIPELINE_KEYS = ("fwd_share", "p2p_bytes_per_token", "p2p_bw", "p2p_latency")


OFFLOAD_RULES = ("step", "paper-eq3")


def _options(world_size: int, capacity: int, strategy: str, offload: bool, cost: Any,
             speed: Optional[Sequence[float]], memory: Optional[Sequence[float]],
             static_cp: Optional[int] = None, pp: int = 1,
             pipeline: Optional[Dict[str, float]] = None,
             offload_rule: str = "step", peer_budget: int = 4) -> "_C.planner.PlanOptions":
    if offload_rule not in OFFLOAD_RULES:
        raise ValueError(f"plan(): offload_rule must be one of {OFFLOAD_RULES}, got {offload_rule!r}")
    if (isinstance(peer_budget, (bool, np.bool_)) or not isinstance(peer_budget, (int, np.integer))
            or peer_budget < 0 or 0 < peer_budget < 4):
        raise ValueError(f"plan(): peer_budget must be 0 (unbounded) or an integer >= 4, got {peer_budget!r}")
    o = _C.planner.PlanOptions()
    o.peer_budget = int(peer_budget)
    o.offload_rule = offload_rule
    o.pp = _positive_int("pp", pp)
    for k, v in (pipeline or {}).items():
        if k not in _PIPELINE_KEYS:
            raise ValueError(f"plan(): unknown pipeline option {k!r} (expected {', '.join(_PIPELINE_KEYS)})")
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"plan(): pipeline option {k} must be a number, got {v!r}")
        setattr(o, "pp_" + k, float(v))
    o.world_size = _positive_int("world_size", world_size)
    o.capacity = _positive_int("capacity", capacity)
    o.strategy = strategy
    if static_cp is not None:
        o.static_cp = _positive_int("static_cp", static_cp)
    o.offload = bool(offload)
    o.cost = cost if isinstance(cost, CostModel) else load_cost_model(cost)
    if speed is not None:
        o.speed = [float(x) for x in speed]
    if memory is not None:
        o.memory = [float(x) for x in memory]
    return o
