"""The planner's cost model (C++ ``CostModel``) and how one is loaded from a profile or a dict."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Union

from .. import _C

__all__ = ["CostModel", "load_cost_model"]

CostModel = _C.planner.CostModel


def load_cost_model(source: Union[str, os.PathLike, Dict[str, Any], None] = None) -> CostModel:
    """A cost model from a JSON profile path, a dict of coefficients, or the defaults (None).

    Missing coefficients keep their defaults; a malformed profile (bad JSON, a coefficient that is
    not a number, NaN, infinite or negative) raises ValueError naming the file or the field.
    """
    if source is None:
        return CostModel()
    if isinstance(source, dict):
        try:
            text = json.dumps(source)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cost model: the coefficients {source!r} are not JSON numbers ({e})") from None
        return CostModel.from_json(text)
    with open(source, "rb") as f:
        raw = f.read()
    try:
        return CostModel.from_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cost model profile {os.fspath(source)!r}: {e}") from None
