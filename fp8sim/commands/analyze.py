"""``fp8sim analyze`` and ``fp8sim replay``: arguments -> :func:`fp8sim.analysis.analyze` /
:func:`fp8sim.analysis.replay` -> tables, JSON, plots, exit codes.

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
import os
import sys

from fp8sim.analysis.status import Thresholds
from fp8sim.commands.output import one_line
from fp8sim.errors import spelled_as

__all__ = ["register", "run_analyze", "run_replay"]


#: what ``fp8sim analyze --help`` says about its table (docs/cli.md says more)
ANALYZE_EPILOG = """\
table, one row per tensor x format x scaling, worst first:
  status     critical: overflow >= --overflow-critical ({oc:g}%) of the values, or underflow >=
             --underflow-critical ({uc:g}%); warning: overflow >= --overflow-warning ({ow:g}%),
             underflow >= --underflow-warning ({uw:g}%), NaN/inf present, MX blocks lost to a NaN
             scale, or values clamped by the MX floor rule (>= {ow:g}%); ok: otherwise.
             A trace tensor: critical when >= {sc:g}% of its steps after warm-up are critical
             casts, warning when any is a warning or critical cast (docs/analysis.md)
  amax       max |x| (inf: a value beyond float32's range)
  scale      the multiplier applied before the cast (the smallest one for row/block/MX)
  overflow   finite values whose scaled magnitude rounds above the format's max, with their
             share of the finite values ("clamped": by the MX floor rule, as the spec intends)
  underflow  nonzero finite values that become 0, with their share of the nonzero values
  subnormal  values that land in the format's subnormal range
  sqnr_db    signal-to-quantization-noise ratio in dB (exact: no error; -inf: an error that is
             not finite; -: undefined)

--fail-on RULES, comma-separated: a status word, critical or warning (crossed by any row of
  that status or worse: --fail-on critical is the gate the statuses stand for), or
  METRIC OP VALUE[%] with OP one of > >= < <= and METRIC one of:
  overflow, clamped, underflow, subnormal (count, or % share), nan, inf, lost, sqnr_db, rel_mse, amax
  (clamped: values the MX floor rule clamps, which overflow never counts)
  e.g. --fail-on critical, --fail-on "overflow>0,underflow>1%,sqnr_db<20"   (exit 1 when any
  counted row crosses one; what-if rows count only with --what-if)
exit: 0 ok; 1 a --fail-on rule crossed; 2 bad input, or no data analyzed (--allow-empty: 0)
"""


class _CommaList(argparse.Action):
    """A comma-separated option that may be repeated: ``--scaling mx --scaling tensor`` is
    ``--scaling mx,tensor`` (a repeat is never silently dropped); the first use replaces the default."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        given = getattr(namespace, "_given_" + self.dest, False)
        setattr(namespace, self.dest, f"{getattr(namespace, self.dest)},{values}" if given else values)
        setattr(namespace, "_given_" + self.dest, True)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="FP8 statistics of tensor dumps: overflow, underflow, SQNR per format x scaling",
        description=(
            "Analyze tensors in .safetensors/.pt/.pth/.npy/.npz files, directories of them, or "
            "fp8sim traces. .pt files load with torch.load(weights_only=True) only."
        ),
        epilog=ANALYZE_EPILOG.format(uw=Thresholds.underflow_warning, uc=Thresholds.underflow_critical,
                                     ow=Thresholds.overflow_warning, oc=Thresholds.overflow_critical,
                                     sc=Thresholds.steps_critical),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="dump files, directories or traces")
    p.add_argument("--format", default=None, action=_CommaList,
                   help="comma-separated formats, or the option repeated (default e4m3,e5m2); "
                        "for a trace: its saved full tensors")  # fmt: skip
    p.add_argument(
        "--scaling",
        default=None,
        action=_CommaList,
        help="comma-separated, or the option repeated: none, tensor, row, col, block:RxC, mx, mx:rceil, "
             "nvfp4[:16x1|:2d][:torchao|:torchao-block] (always e2m1) (default tensor)",
    )
    p.add_argument("--margin", type=float, default=0.0, help="scale headroom in binades (default 0)")
    p.add_argument("--pow2", action="store_true", help="round scales down to powers of two")
    p.add_argument("--json", metavar="FILE", help="write JSON records to FILE ('-' for stdout)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--fail-on", metavar="RULES", help='e.g. "overflow>0,underflow>1%%": exit 1 if crossed')
    p.add_argument("--keep-going", action="store_true", help="analyze the other files past a bad one")
    for what, level in (("underflow", "warning"), ("underflow", "critical"), ("overflow", "warning"),
                        ("overflow", "critical")):  # fmt: skip
        default = getattr(Thresholds, f"{what}_{level}")
        p.add_argument(f"--{what}-{level}", type=float, default=default, metavar="PCT",
                       help=f"{what} share that makes a cast {'a ' if level == 'warning' else ''}{level} "
                            f"(default {default:g}%%)")  # fmt: skip
    p.add_argument("--what-if", action="store_true",
                   help="count the casts a trace records but its run did not perform (what-if rows: weight "
                        "gradients under te-* recipes) in the summary, the verdict and --fail-on")  # fmt: skip
    p.add_argument("--allow-empty", action="store_true",
                   help="exit 0 when nothing was analyzed (no float tensor, no recorded step); default: exit 2")
    p.add_argument("--top", type=int, default=50, help="table rows to print (0: all; default 50)")
    p.add_argument("--scales", "--fp8-scales", dest="scales", choices=("stored", "apply"),
                   default="stored",
                   help="quantized checkpoint tensors with companion scales -- FP8 with "
                        "NAME_scale_inv / NAME_scale, packed NVFP4 (uint8) with its E4M3 block scale "
                        "and float32 global scale (compressed-tensors, ModelOpt), MX (MXFP4/6/8 "
                        "with E8M0 scales per 32; gpt-oss _blocks/_scales): analyze them as "
                        "stored (default) or as the values dequantized with their scales "
                        "(--fp8-scales: the same)")  # fmt: skip
    p.add_argument("--fp8-block", metavar="RxC",
                   help="block shape of block scales (default: the checkpoint's config.json "
                        "weight_block_size, else 128x128)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="worker processes analyzing the files' tensors, each with bounded memory "
                        "and 1/N of the threads; the result is the same as with 1 (default 1)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=1 << 20, help=argparse.SUPPRESS)
    p.set_defaults(func=run_analyze)

    r = sub.add_parser(
        "replay",
        help="replay scaling policies over a recorded trace, side by side",
        description=(
            "For each --policy (e.g. 'delayed:history=16,margin=1', 'current:pow2', 'msamp', "
            "'autoscale', 'static:scale=1', 'nvfp4', 'nvfp4:2d,torchao', 'mx:rceil', "
            "'current:gran=block:1x128,pow2'): the scale per tensor and step, overflow events, "
            "and overflow/underflow shares (exact for power-of-two scales; block-scaled policies "
            "exactly, at the steps whose full tensors the trace saved)."
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
    r.add_argument("--what-if", action="store_true",
                   help="replay the casts the trace records but its run did not perform too (what-if "
                        "tensors: weight gradients under te-* recipes); left out by default")  # fmt: skip
    r.add_argument("--by", choices=("policy", "tensor", "layer"), default="policy",
                   help="table rows: one per policy (default), or per tensor / per layer with a "
                        "column per policy (cells: overflow events / overflowing values / worst "
                        "underflow share)")  # fmt: skip
    r.add_argument("--fail-on", metavar="RULES",
                   help='e.g. "overflow>0,underflow>1%%,events>2": exit 1 if any policy crosses one at '
                        "any tensor and step (overflow/underflow: count, or %% of the finite/nonzero "
                        "values; events: the tensor's overflow events so far)")  # fmt: skip
    r.set_defaults(func=run_replay)


#: the library's parameter -> the flag that sets it (messages name the flags)
ANALYZE_FLAGS = {"formats": "--format", "scalings": "--scaling", "margin": "--margin",
                 "fail_on": "--fail-on", "underflow_warning": "--underflow-warning",
                 "underflow_critical": "--underflow-critical", "overflow_warning": "--overflow-warning",
                 "overflow_critical": "--overflow-critical", "fp8_scales": "--scales",
                 "fp8_block": "--fp8-block", "chunk": "--chunk", "jobs": "--jobs", "top": "--top",
                 "path": "--json",
                 "directory": "--plot"}  # fmt: skip
REPLAY_FLAGS = {"policies": "--policy", "fail_on": "--fail-on", "path": "--json",
                "directory": "--plot", "by": "--by"}  # fmt: skip


def _msg(text: str) -> None:
    print(text, file=sys.stderr)


def _outputs_checked(json_dest: str | None, plot: str | None):
    """``--json`` and ``--plot`` refused before any work, not after it; the run's PlotDir (None
    without --plot)."""
    from fp8sim.analysis.json_output import check_json_path

    if json_dest is not None and json_dest != "-":
        check_json_path(json_dest)  # not into a trace either (the one replayed, or any other)
    if plot is None:
        return None
    from fp8sim.analysis.plots import PlotDir

    return PlotDir(plot)


def _note_generic_formats(formats: str | None) -> None:
    """A note on stderr for each ``--format`` that is a generic eXmY, not a named format."""
    from fp8sim.formats import generic_format_note

    for name in (formats or "").split(","):
        note = generic_format_note(name.strip()) if name.strip() else None
        if note:
            _msg(f"note: --format {note}")


def _write_json(result, dest: str | None) -> None:
    if dest == "-":
        sys.stdout.write(result.to_json() + "\n")
    elif dest is not None:
        result.to_json(dest)


def run_analyze(args: argparse.Namespace) -> int:
    from fp8sim.analysis.api import analyze
    from fp8sim.analysis.report import escape_cell

    with spelled_as(ANALYZE_FLAGS):
        if args.top < 0:
            raise ValueError(f"--top must be >= 0 (0 prints every row), got {args.top}")
        _note_generic_formats(args.format)
        plot_dir = _outputs_checked(args.json, args.plot)
        result = analyze(
            args.paths, args.format, args.scaling, margin=args.margin, pow2=args.pow2,
            fail_on=args.fail_on, underflow_warning=args.underflow_warning,
            underflow_critical=args.underflow_critical, overflow_warning=args.overflow_warning,
            overflow_critical=args.overflow_critical, what_if=args.what_if, allow_empty=args.allow_empty,
            fp8_scales=args.scales,
            fp8_block=args.fp8_block, keep_going=args.keep_going, chunk=args.chunk,
            jobs=args.jobs, progress=args.json is None and sys.stderr.isatty(),
        )  # fmt: skip
        _write_json(result, args.json)
        if plot_dir is not None:
            result.plot(plot_dir)
    if args.json != "-":
        print(result.table(top=args.top))
    for n in result.notes:
        _msg(f"note: {escape_cell(n.file)}: " + (f"{escape_cell(n.name)}: " if n.name else "")
             + one_line(n.note))  # fmt: skip
    _msg(result.summary_line())
    if result.errors:  # the same items as JSON "errors": whole files, then single tensors
        for title, whole in (("bad files", True), ("bad tensors", False)):
            listed = [e.reason for e in result.errors if (e.name is None) == whole]
            if listed:
                _msg(f"{title} ({len(listed)}):")
                for reason in listed:
                    _msg(f"  {reason}")
        return 2
    if result.crossings:
        c = result.crossings[0]
        _msg(f"--fail-on: {len(result.crossings)} crossing(s); first: {c.rule} by "
             f"{escape_cell(c.name)} ({c.format}, {c.scaling})")  # fmt: skip
        return 1
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from fp8sim.analysis.replay_api import replay
    from fp8sim.analysis.report import REPLAY_FAIL_METRICS, parse_fail_on

    with spelled_as(REPLAY_FLAGS):
        if args.fail_on is not None:  # a bad rule is said first, before the trace is read
            parse_fail_on(args.fail_on, REPLAY_FAIL_METRICS)
        _outputs_checked(args.json, None)
        if args.allreduce is not None:
            return _run_allreduce(args)
        if not args.policy:
            raise ValueError("replay: give --policy SPEC (one or more) or --allreduce N")
        if _is_te_log(args.trace):
            return _run_te_log(args)
        plot_dir = _outputs_checked(None, args.plot)
        result = replay(args.trace, args.policy, include_recorded=not args.no_recorded, what_if=args.what_if,
                        fail_on=args.fail_on, progress=args.json is None and sys.stderr.isatty())  # fmt: skip
        _write_json(result, args.json)
        if args.json != "-":
            print(result.table(by=args.by))
        if plot_dir is not None:
            result.plot(plot_dir)
    from fp8sim.analysis.policy_replay import RECORDED, needs_full_tensors

    for pol in result.policies:
        if pol.policy != RECORDED and needs_full_tensors(pol.policy):
            _msg(f"policy {pol.policy}: replayed at the {pol.records} records with a saved full tensor "
                 f"(or, for mx, block statistics); {pol.skipped} without either left out")  # fmt: skip
    _msg(f"replayed {result.trace_records} records under {len(result.policies)} policies")
    if result.what_if_records:
        _msg(result.what_if_note())
    if result.crossings:
        c = result.crossings[0]
        _msg(f"--fail-on: {len(result.crossings)} crossing(s); first: {c.rule} under policy "
             f"{c.policy}: tensor {c.tensor} at step {c.step}")  # fmt: skip
        return 1
    return 0


def _is_te_log(path: str) -> bool:
    from fp8sim.trace.te_logs import te_log_files

    return os.path.exists(path) and bool(te_log_files(path))


def _run_te_log(args: argparse.Namespace) -> int:
    """``replay TE_LOG_DIR --policy ...``: per policy and tensor, the scales and amax-overflow
    events that Transformer Engine's logged amaxes give (counts need histograms the log lacks)."""
    from fp8sim.analysis.json_output import json_text, write_json
    from fp8sim.analysis.report import text_table
    from fp8sim.analysis.te_log_summary import replay_te_log
    from fp8sim.trace.te_logs import read_te_logs

    for flag, given in (("--fail-on", args.fail_on is not None), ("--plot", args.plot is not None),
                        ("--by", args.by != "policy"), ("--what-if", args.what_if)):  # fmt: skip
        if given:
            raise ValueError(f"replay: {flag} needs an fp8sim trace; {args.trace} is a Transformer Engine "
                             "debug log (its amaxes give scales and overflow events only)")  # fmt: skip
    rows = replay_te_log(read_te_logs(args.trace), args.policy)
    out = [{"policy": r["policy"], "tensor": f"{r['layer']}.{r['tensor']}", "iterations": len(r["steps"]),
            "events": sum(1 for _, _, e in r["steps"] if e), "undecided": sum(1 for _, _, e in r["steps"] if e is None),
            "scale_min": min((s for _, s, _ in r["steps"]), default=None),
            "scale_max": max((s for _, s, _ in r["steps"]), default=None)} for r in rows]  # fmt: skip
    if args.json == "-":
        sys.stdout.write(json_text({"trace": args.trace, "source": "te-debug-log", "rows": out}) + "\n")
    elif args.json is not None:
        write_json(args.json, {"trace": args.trace, "source": "te-debug-log", "rows": out})
    if args.json != "-":
        print(text_table(["policy", "tensor", "iterations", "events", "undecided", "scale min", "scale max"],
                         [[r["policy"], r["tensor"], str(r["iterations"]), str(r["events"]), str(r["undecided"]),
                           f"{r['scale_min']:.4g}" if r["scale_min"] is not None else "-",
                           f"{r['scale_max']:.4g}" if r["scale_max"] is not None else "-"] for r in out],
                         right={2, 3, 4, 5, 6}))  # fmt: skip
    _msg(f"{args.trace}: a Transformer Engine debug log holds whole-tensor statistics only: each policy's "
         "scales and amax-overflow events (events: iterations whose amax overflows; undecided: the logged "
         "amax's 4-decimal interval straddles the threshold) are exact; overflow and underflow counts "
         "need the histograms of an fp8sim trace")  # fmt: skip
    return 0


def _run_allreduce(args: argparse.Namespace) -> int:
    """``replay --allreduce N``: the simulated FP8 gradient all-reduce (no policies)."""
    from fp8sim.analysis.json_output import json_text, write_json
    from fp8sim.analysis.allreduce_replay import format_allreduce_report, replay_allreduce

    if args.policy:
        raise ValueError("replay: --allreduce and --policy are separate replays; give one of them")
    if args.fail_on is not None:
        raise ValueError("replay: --fail-on applies to --policy replays, not to --allreduce")
    if args.by != "policy":
        raise ValueError("replay: --by applies to --policy replays, not to --allreduce")
    result = replay_allreduce(args.trace, args.allreduce)
    if args.json == "-":
        sys.stdout.write(json_text(result) + "\n")
    elif args.json is not None:
        write_json(args.json, result)
    if args.json != "-":
        print(format_allreduce_report(result))
    return 0
