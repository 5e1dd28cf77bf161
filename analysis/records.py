"""The records of an analysis and a replay as typed, immutable objects.

Each class has exactly the fields of its JSON object (docs/cli.md), in the same order, and
:meth:`to_dict` gives that object back (tuples as lists; non-finite floats are written ``null``
when the JSON is made). Units: ``*_pct`` fields are percent (overflow of the finite values,
underflow and subnormal of the nonzero finite values); ``*_share`` fields are fractions (0..1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "TensorRecord",
    "TraceTensorRecord",
    "Note",
    "BadInput",
    "Crossing",
    "PolicySummary",
    "ReplayRecord",
    "ReplayCrossing",
    "LayerVerdict",
]


class _JsonRecord:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """The record's JSON object (a plain dict, fields in order, tuples as lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """The record of a JSON object (every field present, no other key)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


@dataclass(frozen=True, slots=True)
class TensorRecord(_JsonRecord):
    """One tensor under one format x scaling (see docs/analysis.md for the figures).

    ``amax`` None: a value beyond float32's range (inf); ``sqnr_db`` / ``rel_mse`` None: see
    ``sqnr_case`` (``exact``, ``unbounded`` or ``undefined``); ``scale`` / ``scale_max``: the
    smallest / largest group scale (one for ``tensor`` and ``none``); ``status``: ``critical``,
    ``warning`` or ``ok``; ``dequantized_with``: the companion scale an FP8 tensor was dequantized
    with (``fp8_scales="apply"``), else None; ``what_if``: a full tensor a trace saved of a cast
    its run did not perform."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    format: str
    scaling: str
    amax: float | None
    scale: float | None
    scale_max: float | None
    overflow: int
    underflow: int
    subnormal: int
    nan: int
    inf: int
    zero: int
    lost: int
    sqnr_db: float | None
    rel_mse: float | None
    sqnr_case: str
    overflow_pct: float
    underflow_pct: float
    subnormal_pct: float
    status: str
    dequantized_with: str | None
    what_if: bool


@dataclass(frozen=True, slots=True)
class TraceTensorRecord(_JsonRecord):
    """One tensor of a trace, its recorded statistics over all steps (records of one step
    summed). ``scaling`` is ``recorded``; ``what_if``: the run did not perform this cast (the
    trace records what it would have done); ``scale`` the last recorded one; ``amax`` the
    largest one, NaN when a step's amax is NaN (JSON null, with ``amax_nan_steps`` > 0), None
    when every one is inf; ``overflow_steps`` the steps with an overflow. After the warm-up
    (``warmup_steps`` steps, their worst underflow share ``warmup_worst_underflow_pct``, None
    without warm-up): ``worst_underflow_pct`` / ``_step`` the step with the largest underflow
    share, ``critical_steps`` / ``warning_steps`` the steps whose cast has that status, and
    ``status`` (:mod:`fp8sim.analysis.status`)."""

    name: str
    file: str
    role: str
    format: str
    scaling: str
    what_if: bool
    shape: tuple[int, ...]
    steps: int
    numel: int
    amax: float | None
    amax_nan_steps: int
    scale: float
    overflow: int
    underflow: int
    nan: int
    inf: int
    overflow_pct: float
    underflow_pct: float
    overflow_steps: int
    worst_underflow_pct: float
    worst_underflow_step: int | None
    warmup_steps: int
    warmup_worst_underflow_pct: float | None
    critical_steps: int
    warning_steps: int
    status: str


@dataclass(frozen=True, slots=True)
class Note(_JsonRecord):
    """Something said about an input that is not a record (a skipped tensor, a file analyzed
    once, a companion scale applied). ``name``: the tensor, or empty / None for the whole file."""

    file: str
    name: str | None
    note: str


@dataclass(frozen=True, slots=True)
class BadInput(_JsonRecord):
    """An input that could not be analyzed (``keep_going=True``): a whole file (``name`` None)
    or one tensor of it; ``reason`` is the one-line message."""

    file: str
    name: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class Crossing(_JsonRecord):
    """A ``fail_on`` rule crossed by a record (of ``analyze``)."""

    rule: str
    name: str
    format: str
    scaling: str


@dataclass(frozen=True, slots=True)
class PolicySummary(_JsonRecord):
    """One policy over a whole trace (``recorded``: the run's own scales). ``overflow`` is the
    best estimate (exact for power-of-two scales, else bracket midpoints), ``overflow_bounds``
    the bracket; the worst record is the one with the largest overflow share, then underflow
    share; ``exact_pct`` the share of records with exact counts. A policy without records has
    only ``policy, records, skipped, events, overflow, worst_tensor, worst_step, median_underflow_pct,
    worst_underflow_pct, exact_pct`` (the others None, and absent from its JSON)."""

    policy: str
    records: int
    skipped: int  # records left out: block-scaled policies replay only saved full tensors
    events: int
    overflow: float
    overflow_bounds: tuple[int, int] | None
    worst_tensor: str | None
    worst_step: int | None
    worst_overflow_pct: float | None
    median_underflow_pct: float
    worst_underflow_pct: float
    worst_underflow_tensor: str | None
    worst_underflow_step: int | None
    exact_pct: float

    _ONLY_WITH_RECORDS = ("overflow_bounds", "worst_overflow_pct", "worst_underflow_tensor",
                          "worst_underflow_step")  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PolicySummary":
        full = {f.name: None for f in fields(cls)} | d
        if full["overflow_bounds"] is not None:
            full["overflow_bounds"] = tuple(full["overflow_bounds"])
        return cls(**full)

    def to_dict(self) -> dict[str, Any]:
        d = _JsonRecord.to_dict(self)
        if not self.records:
            for k in self._ONLY_WITH_RECORDS:
                del d[k]
        return d


@dataclass(frozen=True, slots=True)
class ReplayRecord(_JsonRecord):
    """One trace record replayed under one policy. Counts are ``(lo, hi)`` brackets, equal when
    ``exact`` (a power-of-two scale); shares are fractions of ``finite`` (overflow) and
    ``nonzero`` (underflow), ``(None, None)`` when that is 0; ``event``: the amax itself
    overflowed. :meth:`to_dict` is the JSON object (``records[policy]`` entries: no ``policy``)."""

    policy: str
    step: int
    tensor: str
    scale: float
    exact: bool
    overflow: tuple[int, int]
    underflow: tuple[int, int]
    finite: int
    nonzero: int
    overflow_share: tuple[float | None, float | None]
    underflow_share: tuple[float | None, float | None]
    event: bool

    def to_dict(self) -> dict[str, Any]:
        d = _JsonRecord.to_dict(self)
        del d["policy"]
        return d


@dataclass(frozen=True, slots=True)
class ReplayCrossing(_JsonRecord):
    """A ``fail_on`` rule crossed by a policy at a tensor and step (of ``replay``)."""

    rule: str
    policy: str
    tensor: str
    step: int


@dataclass(frozen=True, slots=True)
class LayerVerdict(_JsonRecord):
    """Whether one layer's tensor of one role can go FP8, from a trace (the rule:
    :mod:`fp8sim.analysis.verdict`, docs/analysis.md). Judged in ``format``, the format the
    trace records for the tensor, over the steps after its warm-up.

    ``verdict``: ``ok``, ``needs margin``, ``needs finer scaling`` or ``keep in higher
    precision``; ``what_if``: a cast the run did not perform (judged only when asked for);
    ``text`` the line shown (``needs margin 2``, ``needs finer scaling (best:
    block:1x128)``, ``... (estimate)``). ``margin``: binades of margin that remove every
    overflow of the steps after warm-up whose overflow share makes them a warning or worse
    (None: no such step). ``basis``:
    ``histogram`` (exact counts from the trace's histograms), ``saved tensors`` (finer scalings
    cast exactly from saved full tensors) or ``estimate`` (the histogram criterion).
    ``jit_underflow_pct`` / ``_step``: the worst step's underflow share under ideal just-in-time
    power-of-two per-tensor scaling; ``finer_underflow_pct``: the best finer scaling's worst
    underflow share over the saved steps (None when not computed; with ``estimate``, the
    criterion's share). ``warmup_*``: the warm-up records, reported apart (their recorded
    overflow and worst underflow share; None/0 when there is no warm-up). Shares in percent."""

    trace: str
    layer: str
    role: str
    tensor: str
    what_if: bool
    format: str
    verdict: str
    text: str
    margin: int | None
    best_scaling: str | None
    basis: str
    steps: int
    overflow: int
    overflow_steps: int
    underflow_pct: float
    jit_underflow_pct: float
    jit_underflow_step: int | None
    finer_underflow_pct: float | None
    warmup_steps: int
    warmup_first_step: int | None
    warmup_last_step: int | None
    warmup_overflow: int
    warmup_worst_underflow_pct: float | None
