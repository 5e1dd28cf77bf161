"""Merging analysis results of parts of one job (``fp8sim merge``): a big checkpoint split over
machines, one shard list per node (``fp8sim analyze SHARDS... --json part-K.json``), merged into
the result one run over every shard would have given, byte for byte (JSON and table).

Why it is exact: :func:`~fp8sim.analysis.analyze` orders what it returns so that a result is the
concatenation of the results of consecutive parts of its inputs -- records sorted worst first
with ties in input order, notes and errors grouped by input in input order (those about no input
first), traces and verdicts in input order -- and every figure of a record depends on its tensor
alone (a companion scale is looked up in the weight's own shard set, whichever node runs it).
Merging concatenates the parts in the order given, sorts the records again (a stable sort: ties
keep input order), and derives again what spans parts: the summary, the ``fail_on`` crossings and
the notes on tensor scales that fell back to 1. Give the parts in the order of their shard lists.

Refused (ValueError, one line): parts analyzed under different formats x scalings, ``fail_on``
rules, status thresholds, ``--what-if`` or ``--scales`` settings (their figures or statuses would not be
comparable), and a file read by two parts (it would count twice).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from fp8sim.analysis.records import BadInput, Crossing, Note, TensorRecord
from fp8sim.analysis.results import AnalysisResult

__all__ = ["merge_results", "load_result"]

#: bytes of a result file read (a result of a million records is a few hundred MB of JSON)
MAX_RESULT_BYTES = 4 << 30


def load_result(path: str | os.PathLike) -> AnalysisResult:
    """The :class:`AnalysisResult` of a JSON file written by ``fp8sim analyze --json`` (or
    :meth:`AnalysisResult.to_json`). Raises ValueError naming the file if it cannot be read or is
    no analyze result."""
    from fp8sim.input_files import open_regular

    p = os.fspath(path)
    try:
        with open_regular(p) as f:
            text = f.read(MAX_RESULT_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{p}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if len(text) > MAX_RESULT_BYTES:
        raise ValueError(f"{p}: over {MAX_RESULT_BYTES >> 30} GiB: not an analyze result")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{p}: not JSON ({first})") from None
    try:
        return AnalysisResult.from_dict(doc)
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None


def _same(parts: Sequence[AnalysisResult], names: Sequence[str], what: str, get) -> None:
    first = get(parts[0])
    for name, part in zip(names[1:], parts[1:]):
        if get(part) != first:
            raise ValueError(f"{names[0]} and {name} were analyzed with different {what}: they "
                             "are not parts of one job")  # fmt: skip


def merge_results(parts: Sequence[AnalysisResult | str | os.PathLike],
                  names: Sequence[str] | None = None) -> AnalysisResult:
    """One :class:`AnalysisResult` of the analysis results ``parts`` (results, or paths of
    their JSON files), in order (see the module docstring). ``names``: how to call the parts in
    messages (default: their paths, else ``part K``). Raises ValueError naming the parts that
    do not go together."""
    from fp8sim.analysis.api import scale_fallback_notes
    from fp8sim.analysis.report import failures, sort_worst_first

    if not parts:
        raise ValueError("merge: no results given")
    if names is None:
        names = [os.fspath(p) if not isinstance(p, AnalysisResult) else f"part {k + 1}"
                 for k, p in enumerate(parts)]  # fmt: skip
    results = [p if isinstance(p, AnalysisResult) else load_result(p) for p in parts]
    _same(results, names, "formats x scalings", lambda r: r.to_dict()["variants"])
    _same(results, names, "--fail-on rules", lambda r: r.rules)
    _same(results, names, "settings (thresholds, --scales, --fp8-block)", lambda r: r.settings)
    _same(results, names, "--what-if settings", lambda r: r.what_if)
    seen: dict[str, str] = {}
    for name, r in zip(names, results):
        for f in r.files:
            if f in seen:
                raise ValueError(f"{f} was analyzed by both {seen[f]} and {name}: it would count "
                                 "twice")  # fmt: skip
            seen[f] = name

    def own_notes(r: AnalysisResult) -> list[dict]:  # without the ones derived from its records
        derived = len(scale_fallback_notes([x.to_dict() for x in r.records]))
        return [n.to_dict() for n in r.notes[: len(r.notes) - derived]]

    files = [f for r in results for f in r.files]
    where = {f: i for i, f in enumerate(files)}

    def in_order(items: list[dict]) -> list[dict]:
        return sorted(items, key=lambda x: where.get(x["file"], -1))

    records = sort_worst_first([x.to_dict() for r in results for x in r.records])
    notes = in_order([n for r in results for n in own_notes(r)]) + scale_fallback_notes(records)
    errors = in_order([e.to_dict() for r in results for e in r.errors])
    traces = tuple(t for r in results for t in r.traces)
    rules = results[0].rules
    base = results[0]
    rows = records + [x.to_dict() for t in traces for x in t.tensors]
    counted = [r for r in rows if base.what_if or not r["what_if"]]
    crossed = failures(counted, rules) if rules else []
    return AnalysisResult(
        variants=base.variants,
        records=tuple(TensorRecord.from_dict(x) for x in records),
        traces=traces,
        notes=tuple(Note.from_dict(n) for n in notes),
        errors=tuple(BadInput.from_dict(x) for x in errors),
        rules=rules,
        crossings=tuple(Crossing(str(rule), r["name"], r["format"], r["scaling"]) for rule, r in crossed),
        files=tuple(files),
        verdicts=tuple(v for r in results for v in r.verdicts),
        what_if=base.what_if,
        settings=dict(base.settings),
    )  # fmt: skip

