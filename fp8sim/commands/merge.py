"""``fp8sim merge``: the parts of one job merged into one -- a run's rank traces into one trace,
or analysis results of one checkpoint split over machines into one result.

merge RUN_DIR --out DIR : a run's record directory holding ``rank0/``, ``rank1/``, ... (one
fp8sim trace per rank) merged by placement into the new trace ``DIR``
(:func:`fp8sim.trace.merge_rank_traces`; ``DIR`` must not exist, its folder must).

merge RESULT... : analysis results (``fp8sim analyze --json`` files of one checkpoint split over
machines, one shard list per node), given in the order of their shard lists, merged into the
result one run over every shard gives, byte for byte (:func:`fp8sim.analysis.merge_results`):
its table on stdout, ``--json FILE`` (``-``: stdout, no table).

What is merged is told by the inputs; mixing them, or an option of the other kind, is refused.
Exit codes as ``analyze``: 0, 1 a merged record crossed the parts' ``--fail-on`` rules, 2 bad
input (a part that is no analyze result, parts of different jobs, ranks that disagree).
"""

from __future__ import annotations

import argparse
import os
import sys

from fp8sim.commands.output import one_line

__all__ = ["register", "run_merge", "input_kind"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="merge a run's rank traces into one trace, or the analyze results of parts of one job",
        description=(
            "Merge a run's record directory (rank0/, rank1/, ... traces) into one trace (--out DIR), "
            "or fp8sim analyze --json results of parts of one checkpoint (one shard list per "
            "node, given in that order) into the result of one run over all of them."
        ),
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="a run's record directory (rank0/, rank1/, ...), or analyze --json files in order")  # fmt: skip
    p.add_argument("--out", metavar="DIR", help="the merged trace's new directory (rank traces)")
    p.add_argument("--json", metavar="FILE",
                   help="write the merged analyze result to FILE ('-' for stdout) (results)")  # fmt: skip
    p.add_argument("--top", type=int, default=None,
                   help="table rows to print (0: all; default 50) (results)")  # fmt: skip
    p.set_defaults(func=run_merge)


def input_kind(path: str) -> str:
    """What an input of ``merge`` is: ``run`` (a record directory holding rank traces) or
    ``analysis`` (a file: an analyze JSON result); ValueError naming it otherwise."""
    from fp8sim.trace.merge import rank_trace_dirs

    if not os.path.lexists(path):
        raise ValueError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "trace.json")):
            raise ValueError(f"{path}: one trace, nothing to merge (merge takes a run's record "
                             "directory holding rank0/, rank1/, ... traces)")  # fmt: skip
        if rank_trace_dirs(path) is None:  # raises for missing ranks
            raise ValueError(f"{path}: a directory without rank traces (rank0/, rank1/, ... each "
                             "an fp8sim trace); merge takes a run's record directory or analyze "
                             "--json results")  # fmt: skip
        return "run"
    return "analysis"


def run_merge(args: argparse.Namespace) -> int:
    from fp8sim.errors import spelled_as

    with spelled_as({"top": "--top", "path": "--json", "dest": "--out"}):
        kinds = [input_kind(p) for p in args.inputs]
        if "run" in kinds:
            return _merge_run(args, kinds)
        if args.out is not None:
            raise ValueError("--out is for a run's rank traces; the merged analyze result goes to "
                             "--json FILE")  # fmt: skip
        return _merge_results(args)


def _merge_run(args: argparse.Namespace, kinds: list[str]) -> int:
    from fp8sim.trace import TraceReader
    from fp8sim.trace.merge import merge_rank_traces, rank_trace_dirs

    if len(kinds) > 1:
        what = "analyze results" if "analysis" in kinds else "runs"
        raise ValueError(f"merge takes one run's record directory at a time (given with other {what}: "
                         f"{', '.join(args.inputs)})")  # fmt: skip
    for flag, value in (("--json", args.json), ("--top", args.top)):
        if value is not None:
            raise ValueError(f"{flag} is for analyze results; a run's rank traces merge into --out DIR")
    if args.out is None:
        raise ValueError(f"{args.inputs[0]}: a run's rank traces: give --out DIR, the new directory of "
                         "the merged trace")  # fmt: skip
    run = args.inputs[0]
    ranks = len(rank_trace_dirs(run))
    dest = merge_rank_traces(run, args.out)
    merged = TraceReader(dest)
    steps = len(merged.steps())
    print(f"merged {ranks} rank traces of {run} into {dest}: {len(merged.tensors)} tensors, {steps} "
          "steps (partitioned tensors summed, replicated ones checked equal and taken once; each rank's "
          "scales in rank_scales.npz)", file=sys.stderr)  # fmt: skip
    return 0


def _merge_results(args: argparse.Namespace) -> int:
    from fp8sim.analysis.json_output import check_json_path
    from fp8sim.analysis.merge import merge_results
    from fp8sim.analysis.report import escape_cell

    top = 50 if args.top is None else args.top
    if top < 0:
        raise ValueError(f"--top must be >= 0 (0 prints every row), got {top}")
    if args.json is not None and args.json != "-":
        check_json_path(args.json, args.inputs)
    result = merge_results(args.inputs)
    if args.json == "-":
        sys.stdout.write(result.to_json() + "\n")
    elif args.json is not None:
        result.to_json(args.json)
    if args.json != "-":
        print(result.table(top=top))
    print(f"merged {len(args.inputs)} results: {result.summary_line()}", file=sys.stderr)
    if result.errors:
        print(f"bad inputs in the parts ({len(result.errors)}):", file=sys.stderr)
        for e in result.errors:
            print(f"  {one_line(e.reason)}", file=sys.stderr)
        return 2
    if result.crossings:
        c = result.crossings[0]
        print(f"--fail-on: {len(result.crossings)} crossing(s); first: {c.rule} by "
              f"{escape_cell(c.name)} ({c.format}, {c.scaling})", file=sys.stderr)  # fmt: skip
        return 1
    return 0
