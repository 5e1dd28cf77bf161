"""What :func:`fp8sim.analysis.replay` returns: :class:`ReplayResult`, scaling policies replayed
over a trace (the command line's table, JSON, the worst records, pandas, plots), built by
:func:`replay_result` from :func:`~fp8sim.analysis.policy_replay.replay_policies`' columns.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Sequence

import numpy as np

from fp8sim.analysis.json_output import check_json_path, json_text, write_json
from fp8sim.analysis.records import PolicySummary, ReplayCrossing, ReplayRecord
from fp8sim.analysis.report import FailRule, format_replay_table, text_table
from fp8sim.analysis.results import pandas_module, plot_dir
from fp8sim.errors import ArgumentError, expect_int

__all__ = ["ReplayResult", "replay_result", "replay_row"]


def _shares(lo: Any, hi: Any, denominator: Any) -> tuple[float | None, float | None]:
    """``[lo, hi] / denominator``; ``None`` where the denominator is 0."""
    d = int(denominator)
    return (None, None) if d == 0 else (int(lo) / d, int(hi) / d)


def replay_row(rp: Any, i: int) -> dict[str, Any]:
    """Record ``i`` of a :class:`~fp8sim.analysis.policy_replay.PolicyReplay` as its JSON
    object (see :class:`~fp8sim.analysis.records.ReplayRecord`)."""
    c = rp.cols
    return {"step": int(c["step"][i]), "tensor": rp.names[int(c["tensor"][i])],
            "scale": float(c["scale"][i]), "exact": bool(c["exact"][i]),
            "overflow": (int(c["overflow_lo"][i]), int(c["overflow_hi"][i])),
            "underflow": (int(c["underflow_lo"][i]), int(c["underflow_hi"][i])),
            "finite": int(c["finite"][i]), "nonzero": int(c["nonzero"][i]),
            "overflow_share": _shares(c["overflow_lo"][i], c["overflow_hi"][i], c["finite"][i]),
            "underflow_share": _shares(c["underflow_lo"][i], c["underflow_hi"][i], c["nonzero"][i]),
            "event": bool(c["event"][i])}  # fmt: skip


@dataclass(frozen=True, repr=False)
class ReplayResult:
    """Scaling policies replayed over a trace (``recorded``: the run's own scales).

    ``policies``: a :class:`~fp8sim.analysis.records.PolicySummary` per policy; ``records``
    (built on first use): a :class:`~fp8sim.analysis.records.ReplayRecord` per policy x trace
    record; ``crossings``: the ``rules`` (``fail_on``) crossed, earliest step first;
    ``replays``: the per-record columns (:class:`~fp8sim.analysis.policy_replay.PolicyReplay`,
    with :meth:`grid` for heatmaps); ``trace_records``: the trace's records replayed (each once
    per policy): without ``what_if``, those of the casts the run performed, so that ``recorded``
    counts what ``fp8sim compare`` and ``analyze``'s trace table count.
    """

    trace: str
    rounding: str
    policies: tuple[PolicySummary, ...]
    rules: tuple[FailRule, ...]
    crossings: tuple[ReplayCrossing, ...]
    replays: tuple = field(compare=False)
    trace_records: int = 0
    #: the trace's tensors of casts its run did not perform, whether they were replayed
    #: (``what_if``), and how many of their records were left out (0 when replayed)
    what_if_tensors: tuple[str, ...] = ()
    what_if: bool = False
    what_if_records: int = 0

    @cached_property
    def records(self) -> tuple[ReplayRecord, ...]:
        return tuple(ReplayRecord(policy=rp.policy, **replay_row(rp, i))
                     for rp in self.replays for i in range(rp.cols["step"].size))  # fmt: skip

    def cells(self, by: str = "tensor") -> list[dict[str, Any]]:
        """Per tensor (``by="tensor"``) or per layer (``"layer"``: the tensor name without its
        role suffix, :func:`fp8sim.analysis.verdict.layer_of`) x policy, over that policy's
        records of it: ``row``, ``policy``, ``records``, ``events`` (records whose amax
        overflowed), ``overflow`` (``[lo, hi]``: overflowing values summed, equal when exact),
        ``worst_underflow_pct`` (the largest underflow share of a record, percent, bracket
        midpoint; None without records). Rows in the trace's tensor order, policies in order."""
        from fp8sim.analysis.verdict import layer_of

        if by not in ("tensor", "layer"):
            raise ArgumentError.about("by", f" {by!r}: policy, tensor or layer")
        key = (lambda n: n) if by == "tensor" else layer_of
        rows: list[str] = []
        present = sorted({int(t) for rp in self.replays for t in rp.cols["tensor"]})
        names = self.replays[0].names if self.replays else []
        for tid in present:
            if key(names[tid]) not in rows:
                rows.append(key(names[tid]))
        out = []
        for row in rows:
            for rp in self.replays:
                c = rp.cols
                sel = np.array([key(rp.names[int(t)]) == row for t in c["tensor"]], bool)
                n = int(sel.sum())
                us = rp.underflow_share[sel]
                out.append({"row": row, "policy": rp.policy, "records": n,
                            "events": int(c["event"][sel].sum()),
                            "overflow": [int(c["overflow_lo"][sel].sum()), int(c["overflow_hi"][sel].sum())],
                            "worst_underflow_pct": 100.0 * float(us.max()) if n else None})  # fmt: skip
        return out

    def table(self, by: str = "policy") -> str:
        """The command line's table: one row per policy (``by="policy"``), or one row per tensor
        (``"tensor"``) or layer (``"layer"``) and a column per policy, each cell ``events /
        overflowing values / worst underflow share`` (:meth:`cells`; ``-``: no record)."""
        if by == "policy":
            return format_replay_table([p.to_dict() for p in self.policies])
        cells = self.cells(by)
        pols = [rp.policy for rp in self.replays]
        grid: dict[str, dict[str, str]] = {}
        for c in cells:
            lo, hi = c["overflow"]
            text = "-" if not c["records"] else (
                f"{c['events']} / {lo if lo == hi else f'{lo}..{hi}'} / {c['worst_underflow_pct']:.3g}%")
            grid.setdefault(c["row"], {})[c["policy"]] = text
        hypo = set(self.what_if_tensors) if by == "tensor" else set()
        rows = [[r + (" (what-if)" if r in hypo else ""), *(grid[r][p] for p in pols)] for r in grid]
        legend = "cells: overflow events / overflowing values / worst underflow share of a record"
        return text_table([by, *pols], rows, right=set(range(1, len(pols) + 1))) + "\n" + legend

    def what_if_note(self) -> str:
        """The line that says which what-if records were left out ("" when none were)."""
        if not self.what_if_records:
            return ""
        names = ", ".join(self.what_if_tensors[:3]) + (", ..." if len(self.what_if_tensors) > 3 else "")
        return (f"left out {self.what_if_records} records of {len(self.what_if_tensors)} what-if tensor(s), "
                f"casts the run did not perform ({names}); --what-if (what_if=True) replays them too")

    def worst(self, n: int = 10) -> list[ReplayRecord]:
        """The ``n`` worst records over all policies: by overflow share, then underflow share
        (descending; bracket midpoints), then policy and record order."""
        expect_int(n, "n", lowest=0)
        def share(pair: tuple) -> float:
            return -math.inf if pair[0] is None else (pair[0] + pair[1]) / 2

        order = sorted(range(len(self.records)), key=lambda i: (
            -share(self.records[i].overflow_share), -share(self.records[i].underflow_share), i))
        return [self.records[i] for i in order[:n]]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (docs/cli.md): trace, rounding, policies, records (per policy),
        what_if, fail_on."""
        per_policy = {rp.policy: [replay_row(rp, i) for i in range(rp.cols["step"].size)]
                      for rp in self.replays}  # fmt: skip
        return {"trace": self.trace, "rounding": self.rounding,
                "policies": [p.to_dict() for p in self.policies], "records": per_policy,
                "what_if": {"tensors": list(self.what_if_tensors), "replayed": self.what_if,
                            "records_left_out": self.what_if_records},
                "fail_on": [c.to_dict() for c in self.crossings]}  # fmt: skip

    def to_json(self, path: str | os.PathLike | None = None) -> str | None:
        """The JSON text, or, with ``path``, that text written there whole or not at all (never
        inside an fp8sim trace)."""
        if path is None:
            return json_text(self.to_dict())
        check_json_path(path)
        write_json(path, self.to_dict())
        return None

    def to_pandas(self, which: str = "records"):
        """A pandas DataFrame: one row per policy x record (``which="records"``; brackets as
        ``overflow_lo``/``_hi`` ... columns) or per policy (``"policies"``)."""
        pd = pandas_module("ReplayResult")
        if which == "policies":
            return pd.DataFrame([p.to_dict() for p in self.policies],
                                columns=[f.name for f in fields(PolicySummary)])  # fmt: skip
        if which != "records":
            raise ArgumentError.about("which", f" {which!r}: records or policies")
        cols: dict[str, list] = {}
        for r in self.records:
            for f in fields(ReplayRecord):
                v = getattr(r, f.name)
                if isinstance(v, tuple):
                    cols.setdefault(f"{f.name}_lo", []).append(v[0])
                    cols.setdefault(f"{f.name}_hi", []).append(v[1])
                else:
                    cols.setdefault(f.name, []).append(v)
        return pd.DataFrame(cols)

    def plot(self, directory: Any) -> list[str]:
        """PNGs into ``directory`` (a path, made if missing, or a ``plots.PlotDir``): events and
        underflow per policy (``policies.png``), and per policy its overflow and underflow share
        per tensor and step. Returns the paths written."""
        from fp8sim.analysis.plots import plot_heatmap, plot_policy_summary, safe_name

        pdir = plot_dir(directory)
        written = [plot_policy_summary(pdir.path("policies.png"), [p.to_dict() for p in self.policies])]
        for i, rp in enumerate(self.replays):
            if rp.cols["step"].size == 0:
                continue
            base = safe_name(rp.policy, i)
            for what in ("underflow_share", "overflow_share"):
                steps, mat = rp.grid(what)
                written.append(plot_heatmap(pdir.path(f"{base}_{what}.png"),
                                            f"{rp.policy}: {what.replace('_', ' ')} (%)", rp.names,
                                            steps, 100.0 * mat))  # fmt: skip
        pdir.finish()
        return written

    def __repr__(self) -> str:
        lines = [f"ReplayResult: {len(self.policies)} policies over {self.trace_records} records of "
                 f"{self.trace} (rounding {self.rounding})"]  # fmt: skip
        if self.what_if_records:
            lines.append(self.what_if_note())
        if self.rules:
            lines.append(f"fail_on crossings: {len(self.crossings)}")
        lines.append(self.table())
        return "\n".join(lines)


def replay_result(trace: str, rounding: str, replays: Sequence, rules: Sequence[FailRule],
                  crossings: Sequence[tuple], trace_records: int, **what_if: Any) -> ReplayResult:  # fmt: skip
    """A :class:`ReplayResult` of :func:`~fp8sim.analysis.policy_replay.replay_policies`'
    columns and the ``(rule, policy, tensor, step)`` crossings."""
    return ReplayResult(
        trace=trace, rounding=rounding,
        policies=tuple(PolicySummary.from_dict(rp.summary()) for rp in replays),
        rules=tuple(rules),
        crossings=tuple(ReplayCrossing(str(rule), pol, name, step) for rule, pol, name, step in crossings),
        replays=tuple(replays), trace_records=trace_records, **what_if,
    )  # fmt: skip
