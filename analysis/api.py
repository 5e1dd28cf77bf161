"""The analysis library: :func:`analyze` (FP8 statistics of tensors in files, checkpoints, traces
or memory) and :func:`replay` (scaling policies over a recorded trace;
:mod:`fp8sim.analysis.replay_api`). ``fp8sim analyze`` and ``fp8sim replay`` are these calls plus
rendering.

Bad arguments raise :class:`~fp8sim.errors.ArgumentError` (a ``ValueError``) naming the
parameter; a bad input (a missing, corrupt or refused file, a tensor whose data cannot be read)
raises ``ValueError`` naming the file, or, with ``keep_going=True``, is listed in the result's
``errors`` while the other inputs are analyzed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any, Callable, Sequence

from fp8sim.analysis.records import BadInput, Crossing, Note, TensorRecord
from fp8sim.analysis.replay_api import replay
from fp8sim.analysis.results import AnalysisResult, Log2Histogram
from fp8sim.analysis.status import Thresholds
from fp8sim.errors import ArgumentError, expect_bool, expect_int, expect_names, expect_real, expect_str

#: ``replay`` is :func:`fp8sim.analysis.replay_api.replay`, importable from here too
__all__ = ["analyze", "replay", "scale_fallback_notes"]

#: ``fp8_scales`` values: analyze FP8 codes as stored, or dequantized with their companion scale
FP8_SCALES = ("stored", "apply")


def _names(value: str | Sequence[str]) -> list[str]:
    """``"e4m3,e5m2"`` or ``["e4m3", "e5m2"]`` -> ``["e4m3", "e5m2"]``."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(t).strip() for t in items if str(t).strip()]


def progress_bar(total: int, enabled: bool, unit: str):
    """A tqdm bar on stderr (disabled unless ``enabled``), for the analysis calls."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, file=sys.stderr, disable=not enabled,
                leave=False, dynamic_ncols=True)  # fmt: skip


def _one_line(text: str) -> str:
    from fp8sim.errors import one_line

    return one_line(text)


# ------------------------------------------------------------------------------------------
# analyze
# ------------------------------------------------------------------------------------------
def _checked_options(formats, scalings, margin, pow2, fail_on, thresholds, fp8_scales, fp8_block,
                     chunk):  # fmt: skip
    """(variants, rules, thresholds, fp8 block) of analyze's arguments, or ArgumentError.
    ``thresholds``: {parameter: percent} of the status thresholds."""
    from fp8sim.analysis.dumps import parse_block
    from fp8sim.analysis.report import parse_fail_on
    from fp8sim.analysis.stats import parse_variants
    from fp8sim.scaling import check_margin

    expect_names(formats, "formats")
    expect_names(scalings, "scalings")
    expect_real(margin, "margin", finite=False)  # its range: check_margin below
    expect_bool(pow2, "pow2")
    expect_str(fail_on, "fail_on", optional=True)
    for name, value in thresholds.items():
        expect_real(value, name, finite=False)  # their range: below
    expect_str(fp8_scales, "fp8_scales")
    expect_str(fp8_block, "fp8_block", optional=True)
    expect_int(chunk, "chunk", lowest=1, optional=True)
    try:
        check_margin(margin, "margin")
    except ValueError as exc:
        raise ArgumentError.renamed(exc, "margin", "margin") from None
    variants = parse_variants(_names(formats), _names(scalings), margin=margin, pow2=pow2)
    try:
        rules = parse_fail_on(fail_on) if fail_on is not None else []
    except ValueError as exc:
        raise ArgumentError.renamed(exc, "--fail-on", "fail_on") from None
    for what in ("underflow", "overflow"):
        w, c = thresholds[f"{what}_warning"], thresholds[f"{what}_critical"]
        if not (isinstance(w, (int, float)) and isinstance(c, (int, float))
                and math.isfinite(w) and math.isfinite(c) and 0 <= w <= c <= 100):  # fmt: skip
            raise ArgumentError("", f"{what}_warning", f" {w} / ", f"{what}_critical",
                                f" {c}: need 0 <= warning <= critical <= 100 (percent)")  # fmt: skip
    th = Thresholds(**thresholds)
    if fp8_scales not in FP8_SCALES:
        raise ArgumentError.about("fp8_scales", f" {fp8_scales!r}: valid: {', '.join(FP8_SCALES)}")
    block = None
    if fp8_block is not None:
        try:
            block = parse_block(fp8_block, "fp8_block")
        except ValueError as exc:
            raise ArgumentError.renamed(exc, "fp8_block", "fp8_block") from None
        if fp8_scales != "apply":  # it would change nothing
            raise ArgumentError("", "fp8_block", " applies with ", "fp8_scales", " apply only")  # --scales apply
    return variants, rules, th, block


def _open_inputs(inputs: Any, bad: Callable, errors: list) -> tuple[list, list[str], list[dict], list[str]]:
    """(dumps, files read, notes, every file and in-memory input in order): paths expanded
    (directories walked, each file once), arrays,
    tensors and mappings as in-memory dumps (``<input K>``, K their position in ``inputs``).
    ``bad(path, error)`` is called for a path that cannot be found or opened (it raises, or
    appends to ``errors``)."""
    from fp8sim.analysis.dumps import each_file_once, expand_paths, is_in_memory, memory_dump
    from fp8sim.analysis.dumps import open_dump

    single = not isinstance(inputs, (list, tuple))  # a list is several inputs
    given = [inputs] if single else list(inputs)
    if not given:
        raise ArgumentError.about("inputs", ": none given (a path, an array, a tensor or a dict)")
    order: list[tuple[int, Any]] = []  # (position in given, a path found or an in-memory input)
    paths: list[str] = []
    for k, x in enumerate(given):
        if isinstance(x, (str, os.PathLike)):
            try:
                found = expand_paths([x])
            except ValueError as exc:  # a missing path: with keep_going, listed and skipped
                bad(os.fspath(x), exc)
                continue
            paths += found
            order += [(k, p) for p in found]
        elif is_in_memory(x):
            order.append((k, x))
        else:
            where = "" if single else f"[{k}]"
            raise ArgumentError.about("inputs", f"{where}: expected a path, a numpy array, a torch "
                                                "tensor or a dict of them, got "
                                                f"{type(x).__name__}")  # fmt: skip
    if not order and not errors:
        raise ValueError(f"no dump files found in {', '.join(os.fspath(x) for x in given)}")
    kept, notes = each_file_once(paths)  # noted, not analyzed twice
    to_open = set(kept)
    dumps, reached = [], []
    for k, x in order:
        if not isinstance(x, str) or x in to_open:
            reached.append(x if isinstance(x, str) else f"<input {k}>")
        if not isinstance(x, str):
            dumps.append(memory_dump(x, f"<input {k}>"))
        elif x in to_open:
            to_open.discard(x)  # a path given twice is opened once
            try:
                dumps.append(open_dump(x))
            except ValueError as exc:
                bad(x, exc)
    return dumps, kept, notes, reached


def _in_input_order(items: list[dict], reached: list[str]) -> list[dict]:
    """Notes or errors grouped by the input they are about, in input order (those about no
    input analyzed -- a path given twice, a missing one -- first), each input's in the order
    they came: a result is then the concatenation of the results over parts of its inputs, which
    is what :func:`~fp8sim.analysis.merge_results` relies on."""
    where = {p: i for i, p in enumerate(reached)}
    return sorted(items, key=lambda x: where.get(x["file"], -1))


def _histogram(st, file: str) -> Log2Histogram:
    """The log2|x| histogram of a tensor's statistics, with each variant's window."""
    import numpy as np

    from fp8sim.analysis.stats import LOG2_EXPONENTS
    from fp8sim.formats import get_format

    windows = []
    for v in st.variants:
        fmt = get_format(v.format)
        s = v.scale if v.scale and math.isfinite(v.scale) else 1.0
        tag = "" if v.scaling in ("none", "tensor") else " (smallest group scale)"
        windows.append((f"{v.format} {v.scaling} x{s:.3g}{tag}", fmt.min_subnormal / s, fmt.max / s))
    nz = np.flatnonzero(st.log2_counts)
    lo, hi = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
    return Log2Histogram(st.name, file, LOG2_EXPONENTS[lo:hi].copy(), st.log2_counts[lo:hi].copy(),
                         tuple(windows))  # fmt: skip


def scale_fallback_notes(records: list[dict]) -> list[dict]:
    """A note for each record whose tensor scale fell back to 1 because the tensor holds inf:
    the scale rule keeps 1 when the amax it sees is inf, so that record's underflow and SQNR are
    those of the unscaled values (the table alone shows only "scale 1" and a large underflow)."""
    out = []
    for r in records:
        if r["scaling"] != "tensor" or r["scale"] != 1.0:
            continue
        if not r["inf"]:
            continue
        why = f"the tensor holds {r['inf']} inf value(s), so the amax the rule sees is inf"
        out.append({"file": r.get("file"), "name": r["name"],
                    "note": f"{r['format']}, tensor scaling: the scale fell back to 1 ({why}); "
                            "its underflow and SQNR are those of the unscaled values"})
    return out


#: the formats and scalings analyze uses when none are given
DEFAULT_FORMATS = ("e4m3", "e5m2")
DEFAULT_SCALINGS = ("tensor",)


def analyze(
    inputs: Any,
    formats: str | Sequence[str] | None = None,
    scalings: str | Sequence[str] | None = None,
    *,
    margin: float = 0.0,
    pow2: bool = False,
    fail_on: str | None = None,
    underflow_warning: float = Thresholds.underflow_warning,
    underflow_critical: float = Thresholds.underflow_critical,
    overflow_warning: float = Thresholds.overflow_warning,
    overflow_critical: float = Thresholds.overflow_critical,
    what_if: bool = False,
    allow_empty: bool = False,
    fp8_scales: str = "stored",
    fp8_block: str | None = None,
    keep_going: bool = False,
    chunk: int | None = None,
    jobs: int = 1,
    progress: bool = False,
) -> AnalysisResult:
    """FP8 statistics of every float tensor in ``inputs`` under each format x scaling.

    ``inputs``: a path (a ``.safetensors``, ``.pt``/``.pth``/``.bin``, ``.npy`` or ``.npz`` file,
    a directory of them such as a checkpoint folder, or an fp8sim trace), a numpy array, a torch
    tensor, a dict (a ``state_dict``) of arrays or tensors, or a list of these. Files are read
    lazily and safely (``.pt``: ``torch.load(weights_only=True)`` only); in-memory inputs are
    named ``<input K>`` where a file's path would stand.

    ``formats`` / ``scalings``: names, or one comma-separated string (``"e4m3,e5m2"``;
    scalings ``none``, ``tensor``, ``row``, ``col``, ``block:RxC``, ``mx``, ``mx:rceil``;
    default e4m3, e5m2 and tensor). They apply to tensors in files and memory and to the full
    tensors a trace saved; a trace's recorded statistics keep the run's own formats and scales
    (a note says so when a trace saved no full tensor). The figures are those of
    ``quantize_scaled(x, fmt, granularity, rounding="rne", saturate=True)``; scales just in time
    from each group's amax, ``margin`` binades of headroom, ``pow2`` rounds them down to powers
    of two (docs/analysis.md). ``fail_on``: rules such as ``"overflow>0,underflow>1%"`` or
    ``"critical"``, checked on every record (``result.crossings``). The status thresholds
    ``underflow_*`` / ``overflow_*`` are percent (:mod:`fp8sim.analysis.status`). ``what_if``:
    count the casts a trace records but its run did not perform (``what_if`` rows: weight
    gradients under ``te-*`` recipes) in ``counts``, the verdict and ``fail_on``; they are
    listed, labelled, either way. ``allow_empty``: return a result with nothing analyzed
    instead of raising ValueError (no float tensor, no recorded step). ``fp8_scales``:
    ``stored`` (FP8 codes as they are) or ``apply`` (dequantized with their companion
    ``NAME_scale_inv`` / ``NAME_scale``; ``fp8_block`` ``"RxC"`` for block scales).
    ``keep_going``: a bad file or tensor is listed in ``result.errors`` instead of raising.
    ``chunk``: elements read at a time (bounds memory). ``jobs``: processes analyzing the
    tensors of files (1: this one; N: N worker processes, each with bounded memory and 1/N of
    the numba threads; the result is the same, bit for bit: :mod:`fp8sim.analysis.jobs`).
    ``progress``: a bar on stderr.
    """
    from fp8sim.analysis.run_traces import merged_runs
    from fp8sim.analysis.te_log_summary import split_te_logs

    explicit = formats is not None or scalings is not None
    variants, rules, th, block = _checked_options(
        DEFAULT_FORMATS if formats is None else formats, DEFAULT_SCALINGS if scalings is None else scalings,
        margin, pow2, fail_on,
        {"underflow_warning": underflow_warning, "underflow_critical": underflow_critical,
         "overflow_warning": overflow_warning, "overflow_critical": overflow_critical},
        fp8_scales, fp8_block, chunk)  # fmt: skip
    for name, value in (("what_if", what_if), ("allow_empty", allow_empty), ("keep_going", keep_going),
                        ("progress", progress)):  # fmt: skip
        expect_bool(value, name)
    expect_int(jobs, "jobs", lowest=1)
    inputs, te_notes, te_paths = split_te_logs(inputs)
    if inputs is None:  # TE debug logs only: their statistics, said as notes
        return AnalysisResult(variants=tuple(variants), records=(), traces=(),
                              notes=tuple(Note(**n) for n in te_notes), errors=(), rules=tuple(rules),
                              crossings=(), files=tuple(te_paths), what_if=what_if)  # fmt: skip
    run_errors: list[dict] = []

    def bad_run(path: str, exc: Exception) -> None:  # a run whose rank traces cannot be merged
        if not keep_going:
            raise ValueError(_one_line(str(exc)))
        run_errors.append({"file": path, "name": None, "reason": _one_line(str(exc))})

    opts = {"variants": variants, "rules": rules, "th": th, "block": block, "fp8_scales": fp8_scales,
            "explicit": explicit, "what_if": what_if, "allow_empty": allow_empty, "keep_going": keep_going,
            "chunk": chunk, "jobs": jobs, "progress": progress}  # fmt: skip
    with merged_runs(inputs, bad_run) as (inputs, shown, run_notes):
        return _analyze_opened(inputs, shown, te_notes + run_notes, run_errors, **opts)


def _analyze_opened(inputs, shown, run_notes, run_errors, *, variants, rules, th, block, fp8_scales, explicit,
                    what_if, allow_empty, keep_going, chunk, jobs, progress) -> AnalysisResult:  # fmt: skip
    """:func:`analyze` once its options are checked and run directories merged (``shown``: a
    merged trace's path -> the run directory shown for it; ``explicit``: formats or scalings
    were given)."""
    from fp8sim.analysis.dumps import FLOAT_DTYPES, link_fp8_scales
    from fp8sim.analysis.jobs import stats_in_order
    from fp8sim.analysis.report import escape_cell, failures, sort_worst_first
    from fp8sim.analysis.status import classify
    from fp8sim.analysis.trace_summary import summarize_trace
    from fp8sim.analysis.verdict import layer_verdicts

    errors: list[dict] = list(run_errors)

    def bad(path: str, exc: Exception, name: str | None = None) -> None:
        """``path`` is bad, or (``name``) one tensor of it is: raised, or listed (keep_going)."""
        path = shown.get(path, path)
        reason = _one_line(str(exc)) or type(exc).__name__
        shown_path = _one_line(path)  # a newline in a file name is written \n
        if name is not None:  # the reason names the file, then the tensor
            rest = reason[len(shown_path) + 1:].strip() if reason.startswith(f"{shown_path}:") else reason
            nm = escape_cell(name)
            reason = f"{shown_path}: {rest if rest.startswith(f'cannot read {nm}: ') else f'{nm}: {rest}'}"
        elif not reason.startswith(shown_path):
            reason = f"{shown_path}: {reason}"
        if not keep_going:
            raise ValueError(reason)
        errors.append({"file": path, "name": name, "reason": reason})

    dumps, files, notes, reached = _open_inputs(inputs, bad, errors)
    opened = {}  # id(dump) -> the path a worker opens (a merged run's trace, not the run shown)
    for d in dumps:  # a merged run is shown as the run directory given
        opened[id(d)] = d.path
        d.path = shown.get(d.path, d.path)
    files = [shown.get(f, f) for f in files]
    reached = [shown.get(f, f) for f in reached]
    notes = run_notes + notes
    notes += link_fp8_scales(dumps, fp8_scales, block, bad)
    total = 2 * sum(t.numel for d in dumps for t in d.tensors if t.is_float)
    records: list[dict] = []
    traces, plot_items, verdicts = [], [], []
    items = [(opened[id(d)], d, t) for d in dumps for t in d.tensors if t.is_float and t.numel]
    bar = progress_bar(total, progress, "elem")
    results = stats_in_order(items, variants, chunk, jobs, (fp8_scales, block), bar.update)
    try:
        for dump in dumps:
            for name, reason in dump.skipped:
                notes.append({"file": dump.path, "name": name, "note": f"skipped: {reason}"})
            if dump.trace is not None:
                if explicit and not dump.tensors:
                    notes.append({"file": dump.path, "name": None,
                                  "note": "the formats and scalings asked for apply to the full tensors a trace "
                                          "saved, and this one saved none: its recorded statistics are in the "
                                          "run's own formats and scales (record with save_every=K, --save-every K, "
                                          "to analyze tensors under others)"})  # fmt: skip
                try:
                    summary = summarize_trace(dump.path, dump.trace, th)
                except ValueError as exc:  # a corrupt chunk: the other files still go on
                    bad(dump.path, exc)
                else:
                    traces.append(summary)
                    plot_items.append(summary)
                    try:
                        verdicts += layer_verdicts(dump.path, dump.trace, th, what_if=what_if)
                    except ValueError as exc:  # a corrupt saved tensor
                        bad(dump.path, exc)
            for src in dump.tensors:
                bar.set_description(escape_cell(src.name)[-30:], refresh=False)
                if not src.is_float:
                    notes.append({"file": dump.path, "name": src.name,
                                  "note": f"skipped: {src.dtype} tensor (analyzed: "
                                          f"{', '.join(FLOAT_DTYPES)})"})  # fmt: skip
                    continue
                if src.numel == 0:
                    notes.append({"file": dump.path, "name": src.name,
                                  "note": f"empty tensor, shape {list(src.shape)}"})  # fmt: skip
                    continue
                st = next(results)
                if isinstance(st, ValueError):  # its data cannot be read: this tensor is bad (no
                    bad(dump.path, st, src.name)  # record), the file's others go on
                    continue
                st.file = dump.path
                wi = _saved_what_if(dump.trace, src.name)
                for rec in st.records():
                    rec["status"] = classify(rec, th)
                    rec["dequantized_with"] = getattr(src, "described", None)  # fp8_scales apply
                    rec["what_if"] = wi
                    records.append(rec)
                plot_items.append(_histogram(st, dump.path))
    finally:
        results.close()  # stops the workers (a bad tensor raised, or an interrupt)
        bar.close()

    records = sort_worst_first(records)
    notes = _in_input_order(notes, reached) + scale_fallback_notes(records)
    errors = _in_input_order(errors, reached)
    trace_rows = [r.to_dict() for t in traces for r in t.tensors]
    if not records and not trace_rows and not errors and not allow_empty:
        raise ValueError(_nothing_analyzed(files, dumps, notes))
    counted = [r for r in records + trace_rows if what_if or not r["what_if"]]
    crossed = failures(counted, rules) if rules else []
    return AnalysisResult(
        variants=tuple(variants),
        records=tuple(TensorRecord.from_dict(r) for r in records),
        traces=tuple(traces),
        notes=tuple(Note(**n) for n in notes),
        errors=tuple(BadInput(**e) for e in errors),
        rules=tuple(rules),
        crossings=tuple(Crossing(str(rule), r["name"], r["format"], r["scaling"]) for rule, r in crossed),
        files=tuple(files),
        verdicts=tuple(verdicts),
        plot_items=tuple(plot_items),
        what_if=what_if,
        settings={**dataclasses.asdict(th), "scales": fp8_scales,
                  "fp8_block": None if block is None else f"{block[0]}x{block[1]}"},
    )  # fmt: skip


def _saved_what_if(trace: Any, name: str) -> bool:
    """Whether the saved full tensor ``name`` (``W@stepS``) of ``trace`` (a TraceReader, or None
    for other dumps) is one of a cast the run did not perform."""
    if trace is None or "@step" not in name:
        return False
    try:
        return trace.tensor(name.rsplit("@step", 1)[0]).what_if
    except ValueError:
        return False


def _nothing_analyzed(files: list[str], dumps: list, notes: list[dict]) -> str:
    """The one line that says why an analysis found nothing to analyze."""
    traces = [d.path for d in dumps if d.trace is not None]
    skipped = [n for n in notes if str(n.get("note", "")).startswith(("skipped", "empty tensor"))]
    what = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "") if files else "the input"
    why = []
    if skipped:
        first = skipped[0]
        why.append(f"{len(skipped)} tensor(s) skipped (first: {first['name']}: {first['note']})")
    if traces:
        why.append(f"{len(traces)} trace(s) without a recorded step")
    if not why:
        why.append("no tensor in it")
    return (f"no data analyzed in {what}: " + "; ".join(why)
            + " (allow_empty=True, --allow-empty on the command line, to accept this)")
