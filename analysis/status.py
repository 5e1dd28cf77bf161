"""The statuses ``ok`` / ``warning`` / ``critical``: one rule for every table, the summary line,
the per-layer verdict and ``--fail-on critical``.

The shares: overflow of the finite values, underflow of the nonzero finite values, in percent
(the records' ``*_pct`` fields). Defaults: :class:`Thresholds`, chosen from the loss effect of
overflow and underflow injected into a training run's FP8 casts (docs/analysis.md, "What the
statuses mean"; ``benchmarks/inject_cast_faults.py``).

One cast -- a tensor of a dump under one format x scaling, or one step of a traced tensor:

* ``critical``: overflow share >= ``overflow_critical``, or underflow share >=
  ``underflow_critical``;
* ``warning``: overflow share >= ``overflow_warning``, or underflow share >=
  ``underflow_warning``, or NaN/inf in the input, or MX blocks lost to a NaN scale, or values
  *clamped* by the MX floor rule with a share >= ``overflow_warning`` (the OCP MX spec's scale
  puts a block's largest values above the format's max and clamps them by design: at most 1/8 of
  such a value is lost in FP8, 1/4 in FP4, so clamping is never critical);
* ``ok`` otherwise: a handful of saturated values (the casts saturate: an overflowing value
  becomes +-max, never inf) is ``ok``.

A traced tensor, over its steps after the warm-up (:func:`warmup_length`; reported apart):

* ``critical`` when at least ``steps_critical`` percent of those steps are critical casts;
* ``warning`` when any of them is a warning or critical cast;
* ``ok`` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["STATUS_ORDER", "STATUSES", "Thresholds", "classify", "clamped_by_mx_floor",
           "step_statuses", "classify_steps", "warmup_length"]  # fmt: skip

STATUSES = ("critical", "warning", "ok")
STATUS_ORDER = {s: i for i, s in enumerate(STATUSES)}


@dataclass(frozen=True)
class Thresholds:
    """Status boundaries, all in percent: shares of a cast's values, and of a tensor's steps."""

    underflow_warning: float = 10.0
    underflow_critical: float = 25.0
    overflow_warning: float = 0.1
    overflow_critical: float = 1.0
    steps_critical: float = 10.0

    def __post_init__(self) -> None:
        for what in ("underflow", "overflow"):
            w, c = getattr(self, f"{what}_warning"), getattr(self, f"{what}_critical")
            if not (math.isfinite(w) and math.isfinite(c) and 0 <= w <= c <= 100):
                raise ValueError(f"--{what}-warning {w:g} / --{what}-critical {c:g}: need "
                                 "0 <= warning <= critical <= 100 (percent)")  # fmt: skip
        if not 0 < self.steps_critical <= 100:
            raise ValueError(f"steps_critical {self.steps_critical}: need 0 < share <= 100 (percent)")


def clamped_by_mx_floor(rec: dict[str, Any]) -> bool:
    """Whether a record's overflow is the MX floor rule's clamping (scaling ``mx``)."""
    return rec.get("scaling") in ("mx", "mx:floor") and bool(rec.get("overflow"))


def classify(rec: dict[str, Any], th: Thresholds = Thresholds()) -> str:
    """``ok`` / ``warning`` / ``critical`` of one cast (a record of ``analyze``; the module
    docstring). Trace tensors: :func:`classify_steps`."""
    ov, un = rec["overflow_pct"], rec["underflow_pct"]
    clamped = clamped_by_mx_floor(rec)
    if clamped:
        ov, clamp = 0.0, ov
    else:
        clamp = 0.0
    if _nan_or(ov >= th.overflow_critical, ov) or _nan_or(un >= th.underflow_critical, un):
        return "critical"
    if (ov >= th.overflow_warning or un >= th.underflow_warning or clamp >= th.overflow_warning
            or rec.get("nan") or rec.get("inf") or rec.get("lost")):  # fmt: skip
        return "warning"
    return "ok"


def _nan_or(cond: bool, v: float) -> bool:
    """A NaN share is never shown to stay below a threshold: it counts as crossing it."""
    return cond or (isinstance(v, float) and math.isnan(v))


def step_statuses(overflow_pct: Any, underflow_pct: Any, specials: Any, th: Thresholds = Thresholds()) -> Any:
    """Per step of a traced tensor, the status of its cast as an index into :data:`STATUSES`
    (0 critical, 1 warning, 2 ok): the per-step shares in percent, ``specials`` the step's
    NaN + inf count (numpy arrays)."""
    import numpy as np

    ov, un = np.asarray(overflow_pct, float), np.asarray(underflow_pct, float)
    crit = (ov >= th.overflow_critical) | (un >= th.underflow_critical)
    warn = (ov >= th.overflow_warning) | (un >= th.underflow_warning) | (np.asarray(specials) > 0)
    return np.where(crit, 0, np.where(warn, 1, 2))


def classify_steps(statuses: Any, th: Thresholds = Thresholds()) -> str:
    """A traced tensor's status from its per-step statuses after the warm-up
    (:func:`step_statuses`): the module docstring. No step: ``ok``."""
    import numpy as np

    s = np.asarray(statuses)
    if s.size == 0:
        return "ok"
    if 100.0 * np.count_nonzero(s == 0) / s.size >= th.steps_critical:
        return "critical"
    return "warning" if np.any(s < 2) else "ok"


def warmup_length(scales: Sequence[float]) -> int:
    """How many of a tensor's records, in step order, are its warm-up: those before the first
    whose scale differs from 1, when the first record's scale is 1 and a later one's is not (the
    steps a delayed-scaling policy casts at its initial scale 1, having seen no amax yet). 0 when
    the scale is 1 throughout (static scaling) or the first one is not 1 (just in time)."""
    if len(scales) == 0 or scales[0] != 1.0:
        return 0
    return next((i for i, s in enumerate(scales) if s != 1.0), 0)
