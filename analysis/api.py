"""The analysis library: :func:`analyze` (FP8 statistics of tensors in files, checkpoints, traces
or memory) and :func:`replay` (scaling policies over a recorded trace). ``fp8sim analyze`` and
``fp8sim replay`` are these calls plus rendering.

Bad arguments raise :class:`~fp8sim.errors.ArgumentError` (a ``ValueError``) naming the
parameter; a bad input (a missing, corrupt or refused file, a tensor whose data cannot be read)
raises ``ValueError`` naming the file, or, with ``keep_going=True``, is listed in the result's
``errors`` while the other inputs are analyzed.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Sequence

from fp8sim.analysis.records import BadInput, Crossing, Note, TensorRecord
from fp8sim.analysis.results import AnalysisResult, Log2Histogram, ReplayResult, replay_result
from fp8sim.errors import ArgumentError, expect_bool, expect_int, expect_names, expect_real, expect_str

__all__ = ["analyze", "replay", "scale_fallback_notes"]

#: ``fp8_scales`` values: analyze FP8 codes as stored, or dequantized with their companion scale
FP8_SCALES = ("stored", "apply")


def _names(value: str | Sequence[str]) -> list[str]:
    """``"e4m3,e5m2"`` or ``["e4m3", "e5m2"]`` -> ``["e4m3", "e5m2"]``."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(t).strip() for t in items if str(t).strip()]


def _progress(total: int, enabled: bool, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, file=sys.stderr, disable=not enabled,
                leave=False, dynamic_ncols=True)  # fmt: skip


def _one_line(text: str) -> str:
    from fp8sim.commands.output import one_line

    return one_line(text)


# ------------------------------------------------------------------------------------------
# analyze
# ------------------------------------------------------------------------------------------
def _checked_options(formats, scalings, margin, pow2, fail_on, underflow_warning,
                     underflow_critical, fp8_scales, fp8_block, chunk):  # fmt: skip
    """(variants, rules, thresholds, fp8 block) of analyze's arguments, or ArgumentError."""
    from fp8sim.analysis.dumps import parse_block
    from fp8sim.analysis.report import Thresholds, parse_fail_on
    from fp8sim.analysis.stats import parse_variants
    from fp8sim.scaling import check_margin

    expect_names(formats, "formats")
    expect_names(scalings, "scalings")
    expect_real(margin, "margin", finite=False)  # its range: check_margin below
    expect_bool(pow2, "pow2")
    expect_str(fail_on, "fail_on", optional=True)
    expect_real(underflow_warning, "underflow_warning")
    expect_real(underflow_critical, "underflow_critical")
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
    try:
        th = Thresholds(underflow_warning, underflow_critical)
    except ValueError as exc:
        why = str(exc).split(": ", 1)[-1]
        raise ArgumentError("", "underflow_warning", f" {underflow_warning} / ", "underflow_critical",
                            f" {underflow_critical}: {why}") from None  # fmt: skip
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


def _open_inputs(inputs: Any, bad: Callable, errors: list) -> tuple[list, list[str], list[dict]]:
    """(dumps, files read, notes): paths expanded (directories walked, each file once), arrays,
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
    dumps = []
    for k, x in order:
        if not isinstance(x, str):
            dumps.append(memory_dump(x, f"<input {k}>"))
        elif x in to_open:
            to_open.discard(x)  # a path given twice is opened once
            try:
                dumps.append(open_dump(x))
            except ValueError as exc:
                bad(x, exc)
    return dumps, kept, notes


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


def analyze(
    inputs: Any,
    formats: str | Sequence[str] = ("e4m3", "e5m2"),
    scalings: str | Sequence[str] = ("tensor",),
    *,
    margin: float = 0.0,
    pow2: bool = False,
    fail_on: str | None = None,
    underflow_warning: float = 0.5,
    underflow_critical: float = 2.0,
    fp8_scales: str = "stored",
    fp8_block: str | None = None,
    keep_going: bool = False,
    chunk: int | None = None,
    progress: bool = False,
) -> AnalysisResult:
    """FP8 statistics of every float tensor in ``inputs`` under each format x scaling.

    ``inputs``: a path (a ``.safetensors``, ``.pt``/``.pth``/``.bin``, ``.npy`` or ``.npz`` file,
    a directory of them such as a checkpoint folder, or an fp8sim trace), a numpy array, a torch
    tensor, a dict (a ``state_dict``) of arrays or tensors, or a list of these. Files are read
    lazily and safely (``.pt``: ``torch.load(weights_only=True)`` only); in-memory inputs are
    named ``<input K>`` where a file's path would stand.

    ``formats`` / ``scalings``: names, or one comma-separated string (``"e4m3,e5m2"``;
    scalings ``none``, ``tensor``, ``row``, ``col``, ``block:RxC``, ``mx``, ``mx:rceil``). The
    figures are those of ``quantize_scaled(x, fmt, granularity, rounding="rne",
    saturate=True)``; scales just in time from each group's amax, ``margin`` binades of headroom,
    ``pow2`` rounds them down to powers of two (docs/analysis.md). ``fail_on``: rules such as
    ``"overflow>0,underflow>1%"``, checked on every record (``result.crossings``). Status
    thresholds ``underflow_warning`` / ``underflow_critical`` are percent. ``fp8_scales``:
    ``stored`` (FP8 codes as they are) or ``apply`` (dequantized with their companion
    ``NAME_scale_inv`` / ``NAME_scale``; ``fp8_block`` ``"RxC"`` for block scales).
    ``keep_going``: a bad file or tensor is listed in ``result.errors`` instead of raising.
    ``chunk``: elements read at a time (bounds memory). ``progress``: a bar on stderr.
    """
    from fp8sim.analysis.run_traces import merged_runs
    from fp8sim.analysis.te_log_summary import split_te_logs

    variants, rules, th, block = _checked_options(
        formats, scalings, margin, pow2, fail_on, underflow_warning, underflow_critical,
        fp8_scales, fp8_block, chunk)  # fmt: skip
    expect_bool(keep_going, "keep_going")
    expect_bool(progress, "progress")
    inputs, te_notes, te_paths = split_te_logs(inputs)
    if inputs is None:  # TE debug logs only: their statistics, said as notes
        return AnalysisResult(variants=tuple(variants), records=(), traces=(),
                              notes=tuple(Note(**n) for n in te_notes), errors=(), rules=tuple(rules),
                              crossings=(), files=tuple(te_paths))  # fmt: skip
    run_errors: list[dict] = []

    def bad_run(path: str, exc: Exception) -> None:  # a run whose rank traces cannot be merged
        if not keep_going:
            raise ValueError(_one_line(str(exc)))
        run_errors.append({"file": path, "name": None, "reason": _one_line(str(exc))})

    with merged_runs(inputs, bad_run) as (inputs, shown, run_notes):
        run_notes = te_notes + run_notes
        return _analyze_opened(inputs, shown, run_notes, run_errors, variants, rules, th, block, fp8_scales,
                               keep_going, chunk, progress)  # fmt: skip


def _analyze_opened(inputs, shown, run_notes, run_errors, variants, rules, th, block, fp8_scales, keep_going, chunk,
                    progress) -> AnalysisResult:  # fmt: skip
    """:func:`analyze` once its options are checked and run directories merged (``shown``: a
    merged trace's path -> the run directory shown for it)."""
    from fp8sim.analysis.dumps import FLOAT_DTYPES, link_fp8_scales
    from fp8sim.analysis.report import classify, escape_cell, failures, sort_worst_first
    from fp8sim.analysis.stats import tensor_stats
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

    dumps, files, notes = _open_inputs(inputs, bad, errors)
    for d in dumps:  # a merged run is shown as the run directory given
        d.path = shown.get(d.path, d.path)
    files = [shown.get(f, f) for f in files]
    notes = run_notes + notes
    notes += link_fp8_scales(dumps, fp8_scales, block, bad)
    total = 2 * sum(t.numel for d in dumps for t in d.tensors if t.is_float)
    records: list[dict] = []
    traces, plot_items, verdicts = [], [], []
    bar = _progress(total, progress, "elem")
    try:
        for dump in dumps:
            for name, reason in dump.skipped:
                notes.append({"file": dump.path, "name": name, "note": f"skipped: {reason}"})
            if dump.trace is not None:
                try:
                    summary = summarize_trace(dump.path, dump.trace, th)
                except ValueError as exc:  # a corrupt chunk: the other files still go on
                    bad(dump.path, exc)
                else:
                    traces.append(summary)
                    plot_items.append(summary)
                    try:
                        verdicts += layer_verdicts(dump.path, dump.trace, th.underflow_warning)
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
                try:
                    st = tensor_stats(src, variants, name=src.name, chunk=chunk, progress=bar.update)
                except ValueError as exc:  # its data cannot be read: this tensor is bad (no
                    bad(dump.path, exc, src.name)  # record), the file's others go on
                    continue
                st.file = dump.path
                for rec in st.records():
                    rec["status"] = classify(rec, th)
                    rec["dequantized_with"] = getattr(src, "described", None)  # fp8_scales apply
                    records.append(rec)
                plot_items.append(_histogram(st, dump.path))
    finally:
        bar.close()

    records = sort_worst_first(records)
    notes += scale_fallback_notes(records)
    trace_rows = [r.to_dict() for t in traces for r in t.tensors]
    crossed = failures(records + trace_rows, rules) if rules else []
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
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# replay
# ------------------------------------------------------------------------------------------
def _replay_failures(replays: list, rules: list) -> list[tuple]:
    """(rule, policy, tensor, step) of every replayed record that crosses a rule: earliest step
    first, then policy order, then recording order. A record whose counts are a bracket (a
    non-power-of-two scale) crosses only when its whole bracket does: the lower bound is compared
    for ``>``/``>=``, the upper for ``<``/``<=``. Shares with a zero denominator never cross."""
    found = []
    for pi, rp in enumerate(replays):
        c = rp.cols
        events: dict[int, int] = {}
        for i in range(c["step"].size):
            tid = int(c["tensor"][i])
            events[tid] = events.get(tid, 0) + int(c["event"][i])
            fin, nz = int(c["finite"][i]), int(c["nonzero"][i])
            bound = {}
            for b in ("lo", "hi"):
                ov, un = int(c[f"overflow_{b}"][i]), int(c[f"underflow_{b}"][i])
                bound[b] = {"overflow": ov, "overflow_pct": 100.0 * ov / fin if fin else None,
                            "underflow": un, "underflow_pct": 100.0 * un / nz if nz else None,
                            "events": events[tid]}  # fmt: skip
            for rule in rules:
                if rule.crossed(bound["lo" if rule.op in (">", ">=") else "hi"]):
                    found.append((int(c["step"][i]), pi, i, rule, rp.policy, rp.names[tid]))
    found.sort(key=lambda f: f[:3])  # stable: rules keep their order within a record
    return [(rule, policy, tensor, step) for step, _, _, rule, policy, tensor in found]


def replay(
    trace: Any,
    policies: str | Sequence[str],
    *,
    include_recorded: bool = True,
    fail_on: str | None = None,
    progress: bool = False,
) -> ReplayResult:
    """What each scaling policy would have done over the recorded ``trace`` (a trace directory
    or a :class:`fp8sim.trace.TraceReader`), step by step: the scale per tensor and step,
    overflow events, overflow / underflow counts (exact for power-of-two scales, else a bracket);
    see :mod:`fp8sim.analysis.policy_replay`.

    ``policies``: specs such as ``"delayed:history=16,margin=1"``, ``"current:pow2"``,
    ``"msamp"``, ``"autoscale"``, ``"static:scale=1"`` (one string is one spec; ``fp8sim
    policies`` lists them); the same policy spelled twice is replayed once.
    ``include_recorded``: the trace's own scales first, as the policy ``recorded``. ``fail_on``:
    rules such as ``"overflow>0,underflow>1%,events>2"`` checked per policy x tensor x step
    (``result.crossings``). ``progress``: a bar on stderr.
    """
    from fp8sim.analysis.report import REPLAY_FAIL_METRICS, parse_fail_on
    from fp8sim.analysis.run_traces import merged_runs
    from fp8sim.trace import TraceReader, is_trace

    expect_names(policies, "policies")
    expect_bool(include_recorded, "include_recorded")
    expect_str(fail_on, "fail_on", optional=True)
    expect_bool(progress, "progress")
    try:
        rules = parse_fail_on(fail_on, REPLAY_FAIL_METRICS) if fail_on is not None else []
    except ValueError as exc:
        raise ArgumentError.renamed(exc, "--fail-on", "fail_on") from None
    specs = [policies] if isinstance(policies, str) else list(policies)
    if not specs:
        raise ArgumentError.about("policies", ": give one policy spec or more (e.g. 'current')")
    if isinstance(trace, TraceReader):
        return _replay_reader(trace, str(trace.path), specs, include_recorded, rules, progress)
    shown = os.fspath(trace)
    if not os.path.exists(shown):
        raise ValueError(f"{shown}: no such directory")
    with merged_runs(shown) as (path, _, _):
        if not os.path.isdir(path) or not is_trace(path):
            raise ValueError(f"{shown}: not an fp8sim trace directory (no trace.json of the "
                             "fp8sim-trace schema, nor rank0/, rank1/, ... traces of a run)")  # fmt: skip
        return _replay_reader(TraceReader(path), shown, specs, include_recorded, rules, progress)


def _replay_reader(reader, shown: str, specs: list, include_recorded: bool, rules: list,
                   progress: bool) -> ReplayResult:  # fmt: skip
    """:func:`replay` over an open trace (``shown``: the path given for it)."""
    from fp8sim.analysis.policy_replay import replay_policies
    from fp8sim.scaling_config import parse_scaling, scaling_spec

    n_records = int(reader.scalars()["step"].size)
    # one per policy, however often it is spelled (replay_policies replays it once)
    n_pol = len({scaling_spec(*parse_scaling(p)) for p in specs}) + (1 if include_recorded else 0)
    bar = _progress(n_records * n_pol, progress, "rec")
    try:
        replays = replay_policies(reader, specs, include_recorded=include_recorded,
                                  progress=bar.update)  # fmt: skip
    finally:
        bar.close()
    crossed = _replay_failures(replays, rules) if rules else []
    return replay_result(shown, reader.rounding, replays, rules, crossed, n_records)
