"""Maxima and orderings over figures that never lose a NaN.

Python's ``max`` skips a NaN that is not the first item (``max([1.0, nan]) == 1.0``: every
comparison with NaN is false), ``sorted`` leaves NaNs wherever they fell, and numpy's ``nanmax``
skips them on purpose. A figure (a loss, an amax, a share) that is NaN means something went wrong
there: the reports built from these helpers show it and say where.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, TypeVar

__all__ = ["max_or_nan", "nan_steps", "worst_first"]

K = TypeVar("K")


def _is_nan(v: Any) -> bool:
    try:
        return math.isnan(v)
    except TypeError:
        return False


def max_or_nan(values: Iterable[float], default: Any = None) -> Any:
    """The largest of ``values``; NaN if any of them is NaN, wherever it stands; ``default`` for
    none at all."""
    best, seen = None, False
    for v in values:
        if _is_nan(v):
            return math.nan
        if not seen or v > best:
            best, seen = v, True
    return best if seen else default


def nan_steps(pairs: Iterable[tuple[K, Any]]) -> list[K]:
    """The keys (steps) of the ``(key, value)`` pairs whose value is NaN, in order."""
    return [k for k, v in pairs if _is_nan(v)]


def worst_first(v: Any, *, higher_is_worse: bool = True) -> tuple[int, float]:
    """A sort key putting NaN first (worst: it is what needs looking at), then the other values
    worst first (the highest when ``higher_is_worse``, else the lowest); None (undefined) last."""
    if v is None:
        return (2, 0.0)
    if _is_nan(v):
        return (0, 0.0)
    return (1, -v if higher_is_worse else v)

