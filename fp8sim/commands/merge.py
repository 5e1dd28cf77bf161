"""``fp8sim merge``: results of parts of one job merged into one.

merge RESULT... : analysis results (``fp8sim analyze --json`` files of one checkpoint split over
machines, one shard list per node), given in the order of their shard lists, merged into the
result one run over every shard gives, byte for byte (:func:`fp8sim.analysis.merge_results`):
its table on stdout, ``--json FILE`` (``-``: stdout, no table). Exit codes as ``analyze``: 0, 1 a
merged record crossed the parts' ``--fail-on`` rules, 2 bad input (a part that is no analyze
result, parts of different jobs).

What is merged is told by the inputs: JSON files of ``fp8sim analyze``. (Per-rank traces are not
merged by this version: a directory is refused in one line.)
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
        help="merge the analysis results of parts of one job (one shard list per machine)",
        description=(
            "Merge fp8sim analyze --json results of parts of one checkpoint (one shard list per "
            "node, given in that order) into the result of one run over all of them."
        ),
    )
    p.add_argument("results", nargs="+", metavar="RESULT", help="analyze --json files, in order")
    p.add_argument("--json", metavar="FILE", help="write the merged JSON to FILE ('-' for stdout)")
    p.add_argument("--top", type=int, default=50, help="table rows to print (0: all; default 50)")
    p.set_defaults(func=run_merge)


def input_kind(path: str) -> str:
    """What an input of ``merge`` is: ``analysis`` (a JSON file); ValueError naming it
    otherwise (a directory: per-rank traces are not merged by this version)."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: a directory; merge takes fp8sim analyze --json results "
                         "(merging per-rank traces is not available in this version)")  # fmt: skip
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    return "analysis"


def run_merge(args: argparse.Namespace) -> int:
    from fp8sim.analysis.json_output import check_json_path
    from fp8sim.analysis.merge import merge_results
    from fp8sim.analysis.report import escape_cell
    from fp8sim.errors import spelled_as

    with spelled_as({"top": "--top", "path": "--json"}):
        if args.top < 0:
            raise ValueError(f"--top must be >= 0 (0 prints every row), got {args.top}")
        for path in args.results:
            input_kind(path)
        if args.json is not None and args.json != "-":
            check_json_path(args.json, args.results)
        result = merge_results(args.results)
        if args.json == "-":
            sys.stdout.write(result.to_json() + "\n")
        elif args.json is not None:
            result.to_json(args.json)
    if args.json != "-":
        print(result.table(top=args.top))
    counts = result.counts
    print(f"merged {len(args.results)} results: {counts['critical']} critical, "
          f"{counts['warning']} warning, {counts['ok']} ok", file=sys.stderr)  # fmt: skip
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
