"""Small numeric helpers shared by the result readers."""
from __future__ import annotations

import math
from typing import Any, Mapping

NAN = math.nan


def num(v: Any, scale: float = 1.0) -> float:
    """A float from a tool's JSON value (None / missing / non-numeric -> NaN), times scale."""
    try:
        return float(v) * scale
    except (TypeError, ValueError):
        return NAN


def pick(d: Mapping[str, Any], *keys: str, scale: float = 1.0) -> float:
    """First present key of d as a float (tools rename fields between versions)."""
    for k in keys:
        if k in d and d[k] is not None:
            return num(d[k], scale)
    return NAN
