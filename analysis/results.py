"""What :func:`fp8sim.analysis.analyze` returns (:func:`fp8sim.analysis.replay`'s result:
:mod:`fp8sim.analysis.replay_result`).

Both results are immutable and hold typed records (:mod:`fp8sim.analysis.records`); each gives
the command line's table (:meth:`table`), its JSON (:meth:`to_json`, the format docs/cli.md
documents), the worst records (:meth:`worst`), a pandas DataFrame (:meth:`to_pandas`, when pandas
is installed) and PNG plots (:meth:`plot`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from fp8sim.analysis.json_output import check_json_path, json_text, write_json
from fp8sim.analysis.records import BadInput, Crossing, LayerVerdict, Note, TensorRecord, TraceTensorRecord
from fp8sim.analysis.report import FailRule, escape_cell, format_table, format_trace_table, sort_worst_first
from fp8sim.analysis.trace_summary import TraceSummary, sort_worst_first_trace
from fp8sim.errors import ArgumentError, expect_int
from fp8sim.formats import get_format

__all__ = ["AnalysisResult", "Log2Histogram"]

#: rows a result's repr shows
_REPR_ROWS = 5


@dataclass(frozen=True)
class Log2Histogram:
    """A tensor's values per binade: ``counts[i]`` values with ``floor(log2|x|) ==
    exponents[i]`` (zeros, NaN and inf not counted; the nonzero range only), and the |x| window
    each analyzed format x scaling represents, ``(label, min_subnormal / scale, max / scale)``."""

    name: str
    file: str
    exponents: np.ndarray = field(repr=False)
    counts: np.ndarray = field(repr=False)
    windows: tuple[tuple[str, float, float], ...] = ()


def pandas_module(what: str):
    """pandas, or ImportError saying ``what.to_pandas()`` needs it."""
    try:
        import pandas
    except ImportError:
        raise ImportError(f"{what}.to_pandas() needs pandas, which is not installed: "
                          "pip install pandas") from None  # fmt: skip
    return pandas


def _check_top(top: int | None) -> int | None:
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise ArgumentError.about("top", f" must be an integer >= 0 (0 prints every row) or None, got {top!r:.40}")
    return top or None


def plot_dir(directory: Any):
    """A :class:`~fp8sim.analysis.plots.PlotDir` for ``directory`` (a path, or one already made)."""
    from fp8sim.analysis.plots import PlotDir

    if isinstance(directory, PlotDir):
        return directory
    try:
        return PlotDir(os.fspath(directory), option="directory")
    except ValueError as exc:
        raise ArgumentError.renamed(exc, "directory", "directory") from None


# ------------------------------------------------------------------------------------------
# analyze
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class AnalysisResult:
    """Statistics of every float tensor analyzed under every format x scaling (``variants``).

    ``records``: one :class:`~fp8sim.analysis.records.TensorRecord` per tensor x variant, worst
    first; ``traces``: a :class:`~fp8sim.analysis.trace_summary.TraceSummary` per trace (its
    recorded statistics); ``notes`` and ``errors`` (bad inputs, with ``keep_going``);
    ``crossings``: the records that crossed a ``rules`` (``fail_on``) rule; ``files``: the files
    and trace directories read; ``verdicts``: per trace, a
    :class:`~fp8sim.analysis.records.LayerVerdict` per layer and role (ok / needs margin N /
    needs finer scaling / keep in higher precision; the rule: :mod:`fp8sim.analysis.verdict`).
    """

    variants: tuple
    records: tuple[TensorRecord, ...]
    traces: tuple[TraceSummary, ...]
    notes: tuple[Note, ...]
    errors: tuple[BadInput, ...]
    rules: tuple[FailRule, ...]
    crossings: tuple[Crossing, ...]
    files: tuple[str, ...]
    #: per trace, a verdict per layer and role (:mod:`fp8sim.analysis.verdict`)
    verdicts: tuple[LayerVerdict, ...] = ()
    #: histograms and traces in the order analyzed (plots are numbered in that order)
    plot_items: tuple = field(default=(), compare=False)
    #: whether the casts the run did not perform (``what_if`` rows) count in ``counts``, the
    #: verdict and the ``fail_on`` rules
    what_if: bool = False
    #: the settings that shape the figures (JSON ``run``: thresholds, scales mode, fp8 block)
    settings: dict = field(default_factory=dict, compare=False)

    @property
    def histograms(self) -> tuple[Log2Histogram, ...]:
        """The log2|x| histogram of each tensor analyzed, in the order analyzed."""
        return tuple(p for p in self.plot_items if isinstance(p, Log2Histogram))

    def _rows(self, what_if: bool | None = None) -> list:
        """Records and trace tensors; without ``what_if`` (default: the result's), not the
        casts the run did not perform."""
        keep = self.what_if if what_if is None else what_if
        rows = [*self.records, *(t for tr in self.traces for t in tr.tensors)]
        return [r for r in rows if keep or not r.what_if]

    @property
    def counts(self) -> dict[str, int]:
        """Records and trace tensors per status: ``{"critical": .., "warning": .., "ok": ..}``;
        the casts the run did not perform (``what_if`` rows) only when the result counts them."""
        rows = self._rows()
        return {k: sum(r.status == k for r in rows) for k in ("critical", "warning", "ok")}

    @property
    def what_if_rows(self) -> int:
        """How many records and trace tensors are casts the run did not perform."""
        return len(self._rows(True)) - len(self._rows(False))

    def summary_line(self) -> str:
        """``3 critical, 1 warning, 20 ok`` and, where what-if rows are not counted, how many."""
        c = self.counts
        line = f"{c['critical']} critical, {c['warning']} warning, {c['ok']} ok"
        n = self.what_if_rows
        if n and not self.what_if:
            line += f" ({n} what-if row{'s' if n > 1 else ''}, casts the run did not perform, not counted)"
        elif n:
            line += f" ({n} what-if row{'s' if n > 1 else ''} counted)"
        return line

    def table(self, top: int | None = 50) -> str:
        """The command line's table: the records, worst first (``top`` rows; 0 or None: all),
        then each trace's recorded statistics per tensor (the casts its run performed, then the
        what-if ones apart), and last each trace's verdict per layer and role (every one)."""
        top = _check_top(top)
        parts = []
        if self.records:
            parts.append(format_table([r.to_dict() for r in self.records], limit=top))
        for t in self.traces:
            rows = sort_worst_first_trace(list(t.tensors))
            real = [r.to_dict() for r in rows if not r.what_if]
            hypo = [r.to_dict() for r in rows if r.what_if]
            parts.append(f"\ntrace {escape_cell(t.path)}: recorded statistics over all steps")
            parts.append(format_trace_table(real) if real else "(no cast the run performed was recorded)")
            if hypo:
                counted = "counted in the summary" if self.what_if else "not counted in the summary (--what-if counts them)"
                parts.append(f"\ntrace {escape_cell(t.path)}: what-if casts -- recorded, but not performed by the "
                             f"run (e.g. weight gradients its recipe keeps in high precision); {counted}")
                parts.append(format_trace_table(hypo))
        if not self.records and not self.traces:
            parts.append("no float tensors analyzed")
        from fp8sim.analysis.verdict import format_verdict_table

        for t in self.traces:
            mine = [v for v in self.verdicts if v.trace == t.path]
            if mine:
                parts.append(f"\ntrace {escape_cell(t.path)}: verdict per layer and role (judged in "
                             "each tensor's recorded format, after its warm-up)")  # fmt: skip
                parts.append(format_verdict_table(mine))
        return "\n".join(parts).lstrip("\n")

    def worst(self, n: int = 10) -> list[TensorRecord | TraceTensorRecord]:
        """The ``n`` worst records, trace tensors included (what-if rows only when the result
        counts them): by status, then overflow share, underflow share (descending), SQNR
        (ascending; undefined last), name."""
        expect_int(n, "n", lowest=0)
        rows = self._rows()
        dicts = [r.to_dict() for r in rows]
        by_id = {id(d): r for d, r in zip(dicts, rows)}
        return [by_id[id(d)] for d in sort_worst_first(dicts)[:n]]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (docs/cli.md): variants, records, traces, notes, errors, summary,
        what_if, fail_on, verdicts, run (the files read, the rules and settings: what
        :func:`~fp8sim.analysis.merge_results` needs to merge results)."""
        return {
            "variants": [{"format": v.fmt.name, "scaling": v.scaling, "margin": v.margin,
                          "pow2": v.pow2} for v in self.variants],  # fmt: skip
            "records": [r.to_dict() for r in self.records],
            "traces": [t.to_dict() for t in self.traces],
            "notes": [x.to_dict() for x in self.notes],
            "errors": [e.to_dict() for e in self.errors],
            "summary": self.counts,
            "what_if": {"rows": self.what_if_rows, "counted": self.what_if},
            "fail_on": [c.to_dict() for c in self.crossings],
            "verdicts": [v.to_dict() for v in self.verdicts],
            "run": {"files": list(self.files),
                    "fail_on": [{"metric": r.metric, "op": r.op, "value": r.value,
                                 "percent": r.percent} for r in self.rules],
                    **self.settings},  # fmt: skip
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "AnalysisResult":
        """The result a JSON object of :meth:`to_dict` describes (no histograms: they are not in
        the JSON). A trace tensor's null ``amax`` with ``amax_nan_steps`` > 0 is NaN again.
        Raises ValueError naming the first key that is missing or malformed."""
        from fp8sim.analysis.stats import Variant

        def part(key: str, build):
            try:
                return build(doc[key])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"not an fp8sim analyze result: its {key!r} is missing or "
                                 f"malformed ({type(exc).__name__}: {exc})") from None  # fmt: skip

        if not isinstance(doc, dict):
            raise ValueError("not an fp8sim analyze result: not a JSON object")
        run = part("run", dict)
        variants = part("variants", lambda vs: tuple(
            Variant(get_format(v["format"]), v["scaling"], v["margin"], v["pow2"]) for v in vs))
        rules = part("run", lambda r: tuple(FailRule(**x) for x in r["fail_on"]))
        traces = part("traces", lambda ts: tuple(TraceSummary(
            t["path"], t["config"], tuple(_trace_record(x) for x in t["tensors"])) for t in ts))
        return cls(
            variants=variants,
            records=part("records", lambda rs: tuple(TensorRecord.from_dict(r) for r in rs)),
            traces=traces,
            notes=part("notes", lambda ns: tuple(Note.from_dict(n) for n in ns)),
            errors=part("errors", lambda es: tuple(BadInput.from_dict(e) for e in es)),
            rules=rules,
            crossings=part("fail_on", lambda cs: tuple(Crossing.from_dict(c) for c in cs)),
            files=part("run", lambda r: tuple(str(f) for f in r["files"])),
            verdicts=part("verdicts", lambda vs: tuple(LayerVerdict.from_dict(v) for v in vs)),
            what_if=part("what_if", lambda w: w["counted"] is True),
            settings={k: v for k, v in run.items() if k not in ("files", "fail_on")},
        )  # fmt: skip

    def to_json(self, path: str | os.PathLike | None = None) -> str | None:
        """The JSON text (strict: non-finite numbers are ``null``), or, with ``path``, that text
        written there whole or not at all (never over one of the files analyzed, nor inside an
        fp8sim trace)."""
        if path is None:
            return json_text(self.to_dict())
        check_json_path(path, self.files)
        write_json(path, self.to_dict())
        return None

    def to_pandas(self, which: str = "records"):
        """A pandas DataFrame, one row per record (``which="records"``) or per trace tensor
        (``"traces"``), the JSON fields as columns."""
        pd = pandas_module("AnalysisResult")
        if which == "records":
            rows, cls = self.records, TensorRecord
        elif which == "traces":
            rows, cls = [t for tr in self.traces for t in tr.tensors], TraceTensorRecord
        else:
            raise ArgumentError.about("which", f" {which!r}: records or traces")
        return pd.DataFrame([r.to_dict() for r in rows], columns=[f.name for f in fields(cls)])

    def plot(self, directory: Any) -> list[str]:
        """PNGs into ``directory`` (a path, made if missing, or a ``plots.PlotDir``): a log2|x|
        histogram per tensor with each variant's window, and per trace its overflow and
        underflow share per tensor and step. Returns the paths written."""
        from fp8sim.analysis.plots import plot_heatmap, plot_log2_histogram, safe_name

        pdir = plot_dir(directory)
        written = []
        index = 0
        for item in self.plot_items:
            if isinstance(item, TraceSummary):
                if not item.tensors:  # no step recorded
                    continue
                base = safe_name(os.path.basename(os.path.normpath(item.path)), index)
                for key in ("underflow", "overflow"):
                    steps, mat = item.grid(key)
                    written.append(plot_heatmap(pdir.path(f"{base}_trace_{key}.png"),
                                                f"{item.path}: recorded {key} share (%)",
                                                item.row_labels(), steps, mat))  # fmt: skip
            else:
                written.append(plot_log2_histogram(
                    pdir.path(safe_name(item.name, index) + ".png"),
                    f"{item.name} ({os.path.basename(item.file)})", item.exponents, item.counts,
                    item.windows))  # fmt: skip
            index += 1
        pdir.finish()
        return written

    def __repr__(self) -> str:
        tensors = len({(r.file, r.name) for r in self.records})
        head = (f"AnalysisResult: {len(self.records)} records ({tensors} tensor(s) x "
                f"{len(self.variants)} format/scaling variant(s))")  # fmt: skip
        if self.traces:
            head += (f", {len(self.traces)} trace(s) ({sum(len(t.tensors) for t in self.traces)} "
                     "tensors' recorded statistics)")  # fmt: skip
        lines = [head + ": " + self.summary_line()]
        if self.notes or self.errors or self.rules:
            lines.append(f"notes: {len(self.notes)}, errors: {len(self.errors)}"
                         + (f", fail_on crossings: {len(self.crossings)}" if self.rules else ""))
        if self.records:
            lines.append("worst records:")
            lines.append(format_table([r.to_dict() for r in self.records[:_REPR_ROWS]]))
            if len(self.records) > _REPR_ROWS:
                lines.append(f"... {len(self.records) - _REPR_ROWS} more: .table(top=0), "
                             ".worst(n), .to_pandas()")  # fmt: skip
        trace_rows = [r for tr in self.traces for r in tr.tensors if self.what_if or not r.what_if]
        if trace_rows:
            lines.append("worst trace tensors (recorded statistics):")
            lines.append(format_trace_table([r.to_dict() for r in sort_worst_first_trace(trace_rows)[:_REPR_ROWS]]))
            if len(trace_rows) > _REPR_ROWS:
                lines.append(f"... {len(trace_rows) - _REPR_ROWS} more: .table(), .to_pandas('traces')")
        if self.verdicts:
            by: dict[str, int] = {}
            for v in self.verdicts:
                by[v.verdict] = by.get(v.verdict, 0) + 1
            lines.append("verdicts: " + ", ".join(f"{n} {k}" for k, n in by.items()) + " (.verdicts, .table())")
        return "\n".join(lines)


def _trace_record(d: dict[str, Any]) -> TraceTensorRecord:
    """A trace tensor's record from JSON: a null amax with NaN steps is NaN (JSON has no NaN)."""
    rec = TraceTensorRecord.from_dict(d)
    if rec.amax is None and rec.amax_nan_steps > 0:
        from dataclasses import replace

        rec = replace(rec, amax=math.nan)
    return rec
