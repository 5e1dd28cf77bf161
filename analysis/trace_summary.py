"""A trace's recorded statistics, per tensor over all steps: what ``analyze TRACE`` reports
beside the records of the tensors the trace saved.

Several records of a tensor in one step (micro-batches) count as one step: their counts add up.
Shares: overflow of the finite values, underflow of the nonzero finite values (percent). Each
tensor's status follows :mod:`fp8sim.analysis.status` over its steps after the warm-up
(:func:`~fp8sim.analysis.status.warmup_length`), which is reported apart. Counts and shares
(``overflow``, ``underflow``, ``*_pct``, ``overflow_steps``) cover every step, so that they add
up to what ``fp8sim compare`` and ``replay``'s ``recorded`` row count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8sim.analysis.records import TraceTensorRecord
from fp8sim.analysis.status import STATUS_ORDER, Thresholds, classify_steps, step_statuses, warmup_length
from fp8sim.nan_aware import max_or_nan

__all__ = ["TraceSummary", "summarize_trace", "sort_worst_first_trace"]


@dataclass(frozen=True)
class TraceSummary:
    """One trace: its ``path``, run ``config`` (trace.json's), and a record per tensor
    (:class:`~fp8sim.analysis.records.TraceTensorRecord`, in the trace's tensor order).
    :meth:`grid` gives the per-step shares for heatmaps."""

    path: str
    config: dict
    tensors: tuple[TraceTensorRecord, ...]
    names: tuple[str, ...] = field(repr=False, default=())
    #: per (tensor, step), in that order: tensor index, step, overflow and underflow share (%)
    _cells: tuple[np.ndarray, ...] = field(repr=False, default=())

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: ``path``, ``config``, ``tensors``."""
        return {"path": self.path, "config": self.config,
                "tensors": [t.to_dict() for t in self.tensors]}  # fmt: skip

    def row_labels(self) -> list[str]:
        """The heatmap row label of each of :attr:`names`: the name, with ``(what-if)`` for a
        cast the run did not perform."""
        hypo = {t.name for t in self.tensors if t.what_if}
        return [n + (" (what-if)" if n in hypo else "") for n in self.names]

    def grid(self, what: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, matrix tensors x steps) of the ``overflow`` or ``underflow`` share in percent
        (NaN where a tensor has no record at a step); rows follow :attr:`names`."""
        if what not in ("overflow", "underflow"):
            raise ValueError(f"grid {what!r}: overflow or underflow")
        tens, step, ov, un = self._cells
        steps = np.unique(step)
        mat = np.full((len(self.names), steps.size), np.nan)
        mat[tens, np.searchsorted(steps, step)] = ov if what == "overflow" else un
        return steps, mat


def _per_step(tensor: np.ndarray, step: np.ndarray, *cols: np.ndarray):
    """Records summed per (tensor, step): a step may hold several records of a tensor
    (micro-batches). Returns (tensor, step, *summed cols), in (tensor, step) order."""
    keys, inv = np.unique(np.stack([tensor, step], axis=1), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    sums = []
    for c in cols:  # int64 sums: exact, as a tensor's counts add up to at most 2**62 (the reader checks)
        s = np.zeros(len(keys), np.int64)
        np.add.at(s, inv, c.astype(np.int64))
        sums.append(s)
    return (keys[:, 0], keys[:, 1], *sums)


def summarize_trace(path: str, reader: Any, th: Thresholds = Thresholds()) -> TraceSummary:
    """The summary of the trace ``reader`` (a :class:`fp8sim.trace.TraceReader`) at ``path``,
    each tensor classified with ``th``. Raises ValueError for a corrupt chunk."""
    sc = reader.scalars()
    # records of 0 elements (a MoE expert no token was routed to: nothing was cast) hold no
    # values: no step of the tensor's statistics, no underflow
    sc = {c: v[sc["numel"] > 0] for c, v in sc.items()}
    tens, step, numel, nan, inf, zero, over, under = _per_step(
        sc["tensor"], sc["step"], sc["numel"], sc["nan"], sc["inf"], sc["zero"], sc["overflow"],
        sc["underflow"])  # fmt: skip
    finite = numel - nan - inf
    nonzero = finite - zero
    with np.errstate(invalid="ignore", divide="ignore"):
        ov_share = np.where(finite > 0, 100.0 * over / np.maximum(finite, 1), 0.0)
        un_share = np.where(nonzero > 0, 100.0 * under / np.maximum(nonzero, 1), 0.0)
    statuses = step_statuses(ov_share, un_share, nan + inf, th)
    rows = []
    for t in reader.tensors:
        sel = tens == t.index
        if not sel.any():
            continue
        rsel = sc["tensor"] == t.index  # its records, in step order
        fin, nz = int(finite[sel].sum()), int(nonzero[sel].sum())
        ov, un = int(over[sel].sum()), int(under[sel].sum())
        steps_t = step[sel]
        n_warm = warmup_length(sc["scale"][rsel].tolist())
        # warm-up steps: those whose every record is a warm-up record
        warm = np.isin(steps_t, sc["step"][rsel][:n_warm]) & ~np.isin(steps_t, sc["step"][rsel][n_warm:])
        post = ~warm
        us, st = un_share[sel][post], statuses[sel][post]
        w = int(np.argmax(us)) if us.size else 0
        row = {
            "name": t.name,
            "file": path,
            "role": t.role,
            "format": t.format,
            "scaling": "recorded",
            "what_if": t.what_if,
            "shape": list(t.shape),
            "steps": int(sel.sum()),
            "numel": int(numel[sel].sum()),
            # NaN when a step's amax is NaN (shown "nan"; JSON: null and amax_nan_steps > 0)
            "amax": max_or_nan(sc["amax"][rsel].tolist()) if not np.isinf(sc["amax"][rsel]).all() else None,
            "amax_nan_steps": int(np.isnan(sc["amax"][rsel]).sum()),
            "scale": float(sc["scale"][rsel][-1]),
            "overflow": ov,
            "underflow": un,
            "nan": int(nan[sel].sum()),
            "inf": int(inf[sel].sum()),
            "overflow_pct": 100.0 * ov / fin if fin else 0.0,
            "underflow_pct": 100.0 * un / nz if nz else 0.0,
            "overflow_steps": int((over[sel] > 0).sum()),
            "worst_underflow_pct": float(us[w]) if us.size else 0.0,
            "worst_underflow_step": int(steps_t[post][w]) if us.size else None,
            "warmup_steps": int(warm.sum()),
            "warmup_worst_underflow_pct": float(un_share[sel][warm].max()) if warm.any() else None,
            "critical_steps": int((st == 0).sum()),
            "warning_steps": int((st == 1).sum()),
            "status": classify_steps(st, th),
        }
        rows.append(TraceTensorRecord.from_dict(row))
    return TraceSummary(path, reader.config, tuple(rows), tuple(t.name for t in reader.tensors),
                        (tens, step, ov_share, un_share))  # fmt: skip


def sort_worst_first_trace(rows: list[TraceTensorRecord]) -> list[TraceTensorRecord]:
    """By status, then overflow share, worst step's underflow share (both descending), name."""
    return sorted(rows, key=lambda r: (STATUS_ORDER[r.status], -r.overflow_pct,
                                       -r.worst_underflow_pct, r.name))  # fmt: skip
