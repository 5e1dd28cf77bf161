"""``fp8sim analyze`` and ``fp8sim replay``.

analyze PATH... : statistics of every float tensor in dumps (safetensors, .pt/.pth, .npy, .npz,
directories, fp8sim traces) under each ``--format`` x ``--scaling``; a worst-first table on stdout,
``--json FILE`` (``-``: stdout, no table), ``--plot DIR`` PNGs, ``--fail-on`` rules (exit 1).
replay TRACE --policy SPEC... : what each scaling policy would have done over a recorded trace;
``--fail-on`` rules (exit 1) per policy x tensor x step (see :data:`analysis.report.REPLAY_FAIL_METRICS`).

Exit codes: 0 ok; 1 a ``--fail-on`` rule was crossed; 2 bad input (a bad file is named with the
reason; with ``--keep-going`` the other files are analyzed first and the bad ones listed at the
end, and the exit code is still 2); 3 an internal error (a bug: ``cli.main`` names it in one line).
A file that cannot be opened (a bad header, a corrupt trace chunk) is bad as a whole; a tensor
whose data cannot be read (a damaged .npz member, a truncated range) is bad on its own: with
``--keep-going`` the file's other tensors are still analyzed, and it has no record (a record
exists only for a tensor read whole). JSON ``errors``: ``{file, name, reason}``, ``name`` null for
a whole file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fp8sim.atomic_file import atomic_write
from fp8sim.commands.output import one_line

__all__ = ["register", "run_analyze", "run_replay"]


#: what ``fp8sim analyze --help`` says about its table (docs/cli.md says more)
ANALYZE_EPILOG = """\
table, one row per tensor x format x scaling, worst first:
  status     critical: any value overflows, or underflow >= --underflow-critical (2%);
             warning: underflow >= --underflow-warning (0.5%), or NaN/inf present, or MX blocks
             lost to a NaN scale; ok: otherwise
  amax       max |x| (inf: a value beyond float32's range)
  scale      the multiplier applied before the cast (the smallest one for row/block/MX)
  overflow   finite values whose scaled magnitude rounds above the format's max, with their
             share of the finite values
  underflow  nonzero finite values that become 0, with their share of the nonzero values
  subnormal  values that land in the format's subnormal range
  sqnr_db    signal-to-quantization-noise ratio in dB (exact: no error; -inf: an error that is
             not finite; -: undefined)

--fail-on METRIC OP VALUE[%], comma-separated, OP one of > >= < <=; METRIC one of:
  overflow, underflow, subnormal (count, or % share), nan, inf, lost, sqnr_db, rel_mse, amax
  e.g. --fail-on "overflow>0,underflow>1%,sqnr_db<20"   (exit 1 when any record crosses one)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="FP8 statistics of tensor dumps: overflow, underflow, SQNR per format x scaling",
        description=(
            "Analyze tensors in .safetensors/.pt/.pth/.npy/.npz files, directories of them, or "
            "fp8sim traces. .pt files load with torch.load(weights_only=True) only."
        ),
        epilog=ANALYZE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="dump files, directories or traces")
    p.add_argument("--format", default="e4m3,e5m2", help="comma-separated formats (default e4m3,e5m2)")
    p.add_argument(
        "--scaling",
        default="tensor",
        help="comma-separated: none, tensor, row, col, block:RxC, mx, mx:rceil (default tensor)",
    )
    p.add_argument("--margin", type=float, default=0.0, help="scale headroom in binades (default 0)")
    p.add_argument("--pow2", action="store_true", help="round scales down to powers of two")
    p.add_argument("--json", metavar="FILE", help="write JSON records to FILE ('-' for stdout)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--fail-on", metavar="RULES", help='e.g. "overflow>0,underflow>1%%": exit 1 if crossed')
    p.add_argument("--keep-going", action="store_true", help="analyze the other files past a bad one")
    p.add_argument("--underflow-warning", type=float, default=0.5, metavar="PCT",
                   help="underflow share that makes a tensor a warning (default 0.5%%)")  # fmt: skip
    p.add_argument("--underflow-critical", type=float, default=2.0, metavar="PCT",
                   help="underflow share that makes a tensor critical (default 2%%)")  # fmt: skip
    p.add_argument("--top", type=int, default=50, help="table rows to print (0: all; default 50)")
    p.add_argument("--fp8-scales", choices=("stored", "apply"), default="stored",
                   help="FP8 tensors of a checkpoint with a companion NAME_scale_inv / NAME_scale: "
                        "analyze the stored codes (default) or the values dequantized with it")  # fmt: skip
    p.add_argument("--fp8-block", metavar="RxC",
                   help="block shape of block scales (default: the checkpoint's config.json "
                        "weight_block_size, else 128x128)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=1 << 20, help=argparse.SUPPRESS)
    p.set_defaults(func=run_analyze)

    r = sub.add_parser(
        "replay",
        help="replay scaling policies over a recorded trace, side by side",
        description=(
            "For each --policy (e.g. 'delayed:history=16,margin=1', 'current:pow2', 'msamp', "
            "'autoscale', 'static:scale=1'): the scale per tensor and step, overflow events, and "
            "overflow/underflow shares (exact for power-of-two scales)."
        ),
    )
    r.add_argument("trace", metavar="TRACE", help="an fp8sim trace directory")
    r.add_argument("--policy", action="append", metavar="SPEC",
                   help="a policy spec; repeat for several (required unless --allreduce)")  # fmt: skip
    r.add_argument("--allreduce", type=int, metavar="N",
                   help="simulate the FP8 gradient all-reduce over N ranks on the saved weight gradients "
                        "(TRACE: a directory of rank*/ traces, or one trace whose consecutive saved steps "
                        "stand in for ranks): pre-/post-scaling, MS-AMP 1/sqrt(N), AutoScale; exact vs FP8 ring")  # fmt: skip
    r.add_argument("--json", metavar="FILE", help="write JSON to FILE ('-' for stdout)")
    r.add_argument("--plot", metavar="DIR", help="write PNG heatmaps into DIR")
    r.add_argument("--no-recorded", action="store_true", help="leave out the trace's own scales")
    r.add_argument("--fail-on", metavar="RULES",
                   help='e.g. "overflow>0,underflow>1%%,events>2": exit 1 if any policy crosses one at '
                        "any tensor and step (overflow/underflow: count, or %% of the finite/nonzero "
                        "values; events: the tensor's overflow events so far)")  # fmt: skip
    r.set_defaults(func=run_replay)


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def _split(s: str) -> list[str]:
    return [t.strip() for t in s.split(",") if t.strip()]


def _clean(v: Any) -> Any:
    """JSON-ready: numpy scalars to Python, non-finite floats to None."""
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


def _check_json_dest(dest: str | None) -> None:
    """Refuse an unwritable ``--json`` destination before any work (not after it)."""
    if dest is None or dest == "-":
        return
    if not dest.strip():
        raise ValueError("--json: an empty path (give a file, or - for stdout)")
    real = os.path.realpath(dest)  # a link is followed: its target is written (atomic_write)
    parent = os.path.dirname(real)
    if os.path.isdir(real):
        raise ValueError(f"--json {dest}: is a directory")
    if os.path.exists(real) and not os.path.isfile(real):  # /dev/null, a FIFO: written in place
        if not os.access(real, os.W_OK):
            raise ValueError(f"--json {dest}: not writable")
        return
    if not os.path.isdir(parent):
        raise ValueError(f"--json {dest}: no such directory {parent}")
    if not os.access(parent, os.W_OK) or (os.path.exists(real) and not os.access(real, os.W_OK)):
        raise ValueError(f"--json {dest}: not writable")


def _check_json_not_an_input(dest: str | None, files: list[str] = ()) -> None:
    """Refuse a ``--json`` destination that is one of the ``files`` read, or lies inside an
    fp8sim trace directory: the JSON would overwrite the data it was made from."""
    if dest is None or dest == "-":
        return
    from fp8sim.trace import is_trace

    real = os.path.realpath(dest)
    if any(real == os.path.realpath(f) for f in files):
        raise ValueError(f"--json {dest}: is one of the files analyzed (it would be overwritten)")
    d = os.path.dirname(real)
    while True:
        try:
            inside = is_trace(d)
        except ValueError:  # a damaged trace is still a trace
            inside = True
        if inside:
            raise ValueError(f"--json {dest}: inside the fp8sim trace {d}, whose files it could "
                             "overwrite; write it elsewhere")  # fmt: skip
        parent = os.path.dirname(d)
        if parent == d:
            return
        d = parent


def _write_json(dest: str, obj: Any) -> None:
    """Strict JSON to ``dest`` ('-': stdout), written whole or not at all (a temporary file
    renamed over it: an interrupted run leaves the old file, never half a new one)."""
    text = json.dumps(_clean(obj), indent=1, allow_nan=False)
    if dest == "-":
        sys.stdout.write(text + "\n")
        return
    try:
        atomic_write(Path(dest), lambda f: f.write((text + "\n").encode()))
    except OSError as exc:
        raise ValueError(f"--json {dest}: cannot write ({exc.strerror or exc})") from None


def _plot_dir(d: str | None):
    """The run's :class:`analysis.plots.PlotDir` (None without --plot)."""
    if d is None:
        return None
    from fp8sim.analysis.plots import PlotDir

    return PlotDir(d)


def _progress(total: int, enabled: bool, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, file=sys.stderr, disable=not enabled,
                leave=False, dynamic_ncols=True)  # fmt: skip


def _msg(text: str) -> None:
    print(text, file=sys.stderr)


# ------------------------------------------------------------------------------------------
# analyze
# ------------------------------------------------------------------------------------------
def _per_step(tensor: np.ndarray, step: np.ndarray, *cols: np.ndarray):
    """Records summed per (tensor, step): a step may hold several records of a tensor
    (micro-batches). Returns (tensor, step, *summed cols), in (tensor, step) order."""
    keys, inv = np.unique(np.stack([tensor, step], axis=1), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    # float64 weights: counts below 2**53 add up exactly
    sums = [np.bincount(inv, weights=c, minlength=len(keys)).astype(np.int64) for c in cols]
    return (keys[:, 0], keys[:, 1], *sums)


def _trace_rows(dump, th) -> tuple[list[dict], dict]:
    """Per-tensor rows of a trace's recorded statistics (all steps), and heatmap data. Several
    records of a tensor in one step (micro-batches) count as one step: their counts add up."""
    from fp8sim.analysis.report import classify
    from fp8sim.nan_aware import max_or_nan

    reader = dump.trace
    sc = reader.scalars()
    rows = []
    tens, step, numel, nan, inf, zero, over, under = _per_step(
        sc["tensor"], sc["step"], sc["numel"], sc["nan"], sc["inf"], sc["zero"], sc["overflow"],
        sc["underflow"])  # fmt: skip
    finite = numel - nan - inf
    nonzero = finite - zero
    with np.errstate(invalid="ignore", divide="ignore"):
        ov_share = np.where(finite > 0, 100.0 * over / np.maximum(finite, 1), 0.0)
        un_share = np.where(nonzero > 0, 100.0 * under / np.maximum(nonzero, 1), 0.0)
    for t in reader.tensors:
        sel = tens == t.index
        if not sel.any():
            continue
        rsel = sc["tensor"] == t.index  # its records
        fin, nz = int(finite[sel].sum()), int(nonzero[sel].sum())
        ov, un = int(over[sel].sum()), int(under[sel].sum())
        us = un_share[sel]
        w = int(np.argmax(us))
        amax = sc["amax"][rsel]
        row = {
            "name": t.name,
            "file": dump.path,
            "role": t.role,
            "format": t.format,
            "scaling": "recorded",
            "shape": list(t.shape),
            "steps": int(sel.sum()),
            "numel": int(numel[sel].sum()),
            # NaN when a step's amax is NaN (shown "nan"; JSON: null and amax_nan_steps > 0)
            "amax": max_or_nan(amax.tolist()) if not np.isinf(amax).all() else None,
            "amax_nan_steps": int(np.isnan(amax).sum()),
            "scale": float(sc["scale"][rsel][-1]),
            "overflow": ov,
            "underflow": un,
            "nan": int(nan[sel].sum()),
            "inf": int(inf[sel].sum()),
            "overflow_pct": 100.0 * ov / fin if fin else 0.0,
            "underflow_pct": 100.0 * un / nz if nz else 0.0,
            "overflow_steps": int((over[sel] > 0).sum()),
            "worst_underflow_pct": float(us[w]),
            "worst_underflow_step": int(step[sel][w]),
        }
        row["status"] = classify(row, th)
        rows.append(row)
    steps = np.unique(sc["step"])
    names = [t.name for t in reader.tensors]
    mats = {}
    for key, share in (("underflow", un_share), ("overflow", ov_share)):
        m = np.full((len(names), steps.size), np.nan)
        m[tens, np.searchsorted(steps, step)] = share
        mats[key] = m
    return rows, {"names": names, "steps": steps, **mats}


def _histogram_plot(plot_dir, index: int, st, file: str) -> None:
    from fp8sim.analysis.plots import plot_log2_histogram, safe_name
    from fp8sim.analysis.stats import LOG2_EXPONENTS
    from fp8sim.formats import get_format

    windows = []
    for v in st.variants:
        fmt = get_format(v.format)
        s = v.scale if v.scale and math.isfinite(v.scale) else 1.0
        tag = "" if v.scaling in ("none", "tensor") else " (smallest group scale)"
        windows.append((f"{v.format} {v.scaling} x{s:.3g}{tag}", fmt.min_subnormal / s, fmt.max / s))
    path = plot_dir.path(safe_name(st.name, index) + ".png")
    plot_log2_histogram(path, f"{st.name} ({os.path.basename(file)})", LOG2_EXPONENTS,
                        st.log2_counts, windows)  # fmt: skip


def run_analyze(args: argparse.Namespace) -> int:
    from fp8sim.analysis.dumps import FLOAT_DTYPES, each_file_once, expand_paths, open_dump
    from fp8sim.analysis.report import (
        Thresholds,
        escape_cell,
        classify,
        failures,
        format_table,
        parse_fail_on,
        sort_worst_first,
    )
    from fp8sim.analysis.dumps import link_fp8_scales, parse_block
    from fp8sim.analysis.stats import parse_variants, tensor_stats

    from fp8sim.scaling import check_margin

    check_margin(args.margin, "--margin")  # before any file, not once per file
    variants = parse_variants(_split(args.format), _split(args.scaling), margin=args.margin,
                              pow2=args.pow2)  # fmt: skip
    rules = parse_fail_on(args.fail_on) if args.fail_on is not None else []
    th = Thresholds(args.underflow_warning, args.underflow_critical)
    if args.top < 0:
        raise ValueError(f"--top must be >= 0 (0 prints every row), got {args.top}")
    if args.chunk < 1:  # a hidden testing option
        raise ValueError(f"--chunk must be >= 1, got {args.chunk}")
    fp8_block = parse_block(args.fp8_block) if args.fp8_block is not None else None
    if fp8_block is not None and args.fp8_scales != "apply":  # it would change nothing
        raise ValueError("--fp8-block applies with --fp8-scales apply only")
    _check_json_dest(args.json)
    plot_dir = _plot_dir(args.plot)
    errors: list[dict] = []

    def bad(path: str, exc: Exception, name: str | None = None) -> None:
        """``path`` is bad, or (``name``) one tensor of it is: raised, or listed (--keep-going)."""
        reason = one_line(str(exc)) or type(exc).__name__
        shown = one_line(path)  # a newline in a file name is written \n
        if name is not None:  # the reason names the file, then the tensor
            rest = reason[len(shown) + 1:].strip() if reason.startswith(f"{shown}:") else reason
            nm = escape_cell(name)
            reason = f"{shown}: {rest if rest.startswith(f'cannot read {nm}: ') else f'{nm}: {rest}'}"
        elif not reason.startswith(shown):
            reason = f"{shown}: {reason}"
        if not args.keep_going:
            raise ValueError(reason)
        errors.append({"file": path, "name": name, "reason": reason})

    paths = []
    for given in args.paths:
        try:
            paths.extend(expand_paths([given]))
        except ValueError as exc:  # a missing path: with --keep-going, listed and skipped
            bad(given, exc)
    if not paths and not errors:
        raise ValueError(f"no dump files found in {', '.join(args.paths)}")
    _check_json_not_an_input(args.json, paths)
    paths, repeats = each_file_once(paths)  # noted, not analyzed twice

    dumps = []
    for path in paths:
        try:
            dumps.append(open_dump(path))
        except ValueError as exc:
            bad(path, exc)
    notes: list[dict] = repeats + link_fp8_scales(dumps, args.fp8_scales, fp8_block, bad)
    total = 2 * sum(t.numel for d in dumps for t in d.tensors if t.is_float)
    show = bool(args.json is None and sys.stderr.isatty())
    records: list[dict] = []
    traces: list[dict] = []
    plot_index = 0
    bar = _progress(total, show, "elem")
    try:
        for dump in dumps:
            for name, reason in dump.skipped:
                notes.append({"file": dump.path, "name": name, "note": f"skipped: {reason}"})
            if dump.trace is not None:
                try:
                    rows, heat = _trace_rows(dump, th)
                except ValueError as exc:  # a corrupt chunk: the other files still go on
                    bad(dump.path, exc)
                    rows, heat = None, None
            if dump.trace is not None and rows is not None:
                traces.append({"path": dump.path, "config": dump.trace.config, "tensors": rows})
                if plot_dir and heat["steps"].size:
                    from fp8sim.analysis.plots import plot_heatmap, safe_name

                    base = safe_name(os.path.basename(os.path.normpath(dump.path)), plot_index)
                    plot_index += 1
                    for key in ("underflow", "overflow"):
                        plot_heatmap(plot_dir.path(f"{base}_trace_{key}.png"),
                                     f"{dump.path}: recorded {key} share (%)", heat["names"],
                                     heat["steps"], heat[key])  # fmt: skip
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
                    st = tensor_stats(src, variants, name=src.name, chunk=args.chunk,
                                      progress=bar.update)  # fmt: skip
                except ValueError as exc:  # its data cannot be read: this tensor is bad (no
                    bad(dump.path, exc, src.name)  # record), the file's others go on
                    continue
                st.file = dump.path
                for rec in st.records():
                    rec["status"] = classify(rec, th)
                    rec["dequantized_with"] = getattr(src, "described", None)  # --fp8-scales apply
                    records.append(rec)
                if plot_dir:
                    _histogram_plot(plot_dir, plot_index, st, dump.path)
                    plot_index += 1
    finally:
        bar.close()
    if plot_dir:
        plot_dir.finish()

    records = sort_worst_first(records)
    notes += scale_fallback_notes(records)
    trace_rows = [r for t in traces for r in t["tensors"]]
    crossed = failures(records + trace_rows, rules) if rules else []
    counts = {k: sum(r["status"] == k for r in records + trace_rows) for k in ("critical", "warning", "ok")}

    if args.json is not None:
        _write_json(
            args.json,
            {
                "variants": [{"format": v.fmt.name, "scaling": v.scaling, "margin": v.margin,
                              "pow2": v.pow2} for v in variants],  # fmt: skip
                "records": records,
                "traces": traces,
                "notes": notes,
                "errors": errors,
                "summary": counts,
                "fail_on": [{"rule": str(rule), "name": r["name"], "format": r["format"],
                             "scaling": r["scaling"]} for rule, r in crossed],  # fmt: skip
            },
        )
    if args.json != "-":
        if records:
            print(format_table(records, limit=args.top or None))
        for t in traces:
            print(f"\ntrace {escape_cell(t['path'])}: recorded statistics over all steps")
            print(_trace_table(sort_worst_first_trace(t["tensors"])))
        if not records and not traces:
            print("no float tensors analyzed")
    for n in notes:
        _msg(f"note: {escape_cell(n['file'])}: " + (f"{escape_cell(n['name'])}: " if n["name"] else "")
             + one_line(n["note"]))  # fmt: skip
    _msg(f"{counts['critical']} critical, {counts['warning']} warning, {counts['ok']} ok")
    if errors:  # the same items as JSON "errors": whole files, then single tensors
        for title, whole in (("bad files", True), ("bad tensors", False)):
            listed = [e["reason"] for e in errors if (e["name"] is None) == whole]
            if listed:
                _msg(f"{title} ({len(listed)}):")
                for reason in listed:
                    _msg(f"  {reason}")
        return 2
    if crossed:
        rule, r = crossed[0]
        _msg(f"--fail-on: {len(crossed)} crossing(s); first: {rule} by {escape_cell(r['name'])} "
             f"({r['format']}, {r['scaling']})")  # fmt: skip
        return 1
    return 0


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


def sort_worst_first_trace(rows: list[dict]) -> list[dict]:
    from fp8sim.analysis.report import STATUS_ORDER

    return sorted(rows, key=lambda r: (STATUS_ORDER[r["status"]], -r["overflow_pct"],
                                       -r["worst_underflow_pct"], r["name"]))  # fmt: skip


def _trace_table(rows: list[dict]) -> str:
    from fp8sim.analysis.report import text_table

    body = [
        [r["status"], r["name"], r["role"], r["format"], str(r["steps"]),
         f"{r['amax']:.3g}" if r["amax"] is not None else "-",
         f"{r['overflow']} in {r['overflow_steps']} steps" if r["overflow"] else "0",
         f"{r['underflow_pct']:.3g}%", f"{r['worst_underflow_pct']:.3g}% @ {r['worst_underflow_step']}"]
        for r in rows
    ]  # fmt: skip
    return text_table(["status", "tensor", "role", "format", "steps", "max amax", "overflow",
                   "underflow", "worst underflow"], body, right={4, 5, 6, 7, 8})  # fmt: skip


# ------------------------------------------------------------------------------------------
# replay
# ------------------------------------------------------------------------------------------
def _shares(lo: Any, hi: Any, denominator: Any) -> list[float | None]:
    """``[lo, hi] / denominator`` (overflow: of the finite values; underflow: of the nonzero
    finite ones); ``None`` where the denominator is 0."""
    d = int(denominator)
    return [None, None] if d == 0 else [int(lo) / d, int(hi) / d]


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


def run_replay(args: argparse.Namespace) -> int:
    from fp8sim.analysis.report import REPLAY_FAIL_METRICS, format_replay_table, parse_fail_on
    from fp8sim.analysis.replay import replay_policies, summary_rows
    from fp8sim.trace import TraceReader, is_trace

    rules = parse_fail_on(args.fail_on, REPLAY_FAIL_METRICS) if args.fail_on is not None else []
    _check_json_dest(args.json)
    _check_json_not_an_input(args.json)  # not into the trace replayed (nor any other)
    if args.allreduce is not None:
        from fp8sim.training.allreduce_sim import format_allreduce_report, replay_allreduce

        if args.policy:
            raise ValueError("replay: --allreduce and --policy are separate replays; give one of them")
        if rules:
            raise ValueError("replay: --fail-on applies to --policy replays, not to --allreduce")
        result = replay_allreduce(args.trace, args.allreduce)
        if args.json is not None:
            _write_json(args.json, result)
        if args.json != "-":
            print(format_allreduce_report(result))
        return 0
    if not args.policy:
        raise ValueError("replay: give --policy SPEC (one or more) or --allreduce N")
    if not os.path.exists(args.trace):
        raise ValueError(f"{args.trace}: no such directory")
    if not os.path.isdir(args.trace) or not is_trace(args.trace):
        raise ValueError(f"{args.trace}: not an fp8sim trace directory (no trace.json of the "
                         "fp8sim-trace schema)")  # fmt: skip
    reader = TraceReader(args.trace)
    plot_dir = _plot_dir(args.plot)
    n_records = int(reader.scalars()["step"].size)
    from fp8sim.policies import parse_policy

    # one per policy, however often it is spelled (replay_policies replays it once)
    n_pol = len({parse_policy(p).spec for p in args.policy}) + (0 if args.no_recorded else 1)
    bar = _progress(n_records * n_pol, bool(args.json is None and sys.stderr.isatty()), "rec")
    try:
        replays = replay_policies(reader, args.policy, include_recorded=not args.no_recorded,
                                  progress=bar.update)  # fmt: skip
    finally:
        bar.close()
    summaries = summary_rows(replays)
    crossed = _replay_failures(replays, rules) if rules else []
    if args.json is not None:
        per_policy = {}
        for rp in replays:
            c = rp.cols
            per_policy[rp.policy] = [
                {"step": int(c["step"][i]), "tensor": rp.names[int(c["tensor"][i])],
                 "scale": float(c["scale"][i]), "exact": bool(c["exact"][i]),
                 "overflow": [int(c["overflow_lo"][i]), int(c["overflow_hi"][i])],
                 "underflow": [int(c["underflow_lo"][i]), int(c["underflow_hi"][i])],
                 "finite": int(c["finite"][i]), "nonzero": int(c["nonzero"][i]),
                 "overflow_share": _shares(c["overflow_lo"][i], c["overflow_hi"][i],
                                           c["finite"][i]),
                 "underflow_share": _shares(c["underflow_lo"][i], c["underflow_hi"][i],
                                            c["nonzero"][i]),
                 "event": bool(c["event"][i])}
                for i in range(c["step"].size)
            ]  # fmt: skip
        _write_json(args.json, {"trace": args.trace, "rounding": reader.rounding,
                                "policies": summaries, "records": per_policy,
                                "fail_on": [{"rule": str(rule), "policy": pol, "tensor": name,
                                             "step": step} for rule, pol, name, step in crossed]})  # fmt: skip
    if args.json != "-":
        print(format_replay_table(summaries))
    if plot_dir:
        from fp8sim.analysis.plots import plot_heatmap, plot_policy_summary, safe_name

        plot_policy_summary(plot_dir.path("policies.png"), summaries)
        for i, rp in enumerate(replays):
            if rp.cols["step"].size == 0:
                continue
            base = safe_name(rp.policy, i)
            for what in ("underflow_share", "overflow_share"):
                steps, mat = rp.grid(what)
                plot_heatmap(plot_dir.path(f"{base}_{what}.png"),
                             f"{rp.policy}: {what.replace('_', ' ')} (%)", rp.names, steps,
                             100.0 * mat)  # fmt: skip
        plot_dir.finish()
    _msg(f"replayed {n_records} records under {n_pol} policies")
    if crossed:
        rule, pol, name, step = crossed[0]
        _msg(f"--fail-on: {len(crossed)} crossing(s); first: {rule} under policy {pol}: "
             f"tensor {name} at step {step}")  # fmt: skip
        return 1
    return 0
