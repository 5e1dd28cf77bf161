"""``fp8sim conformance``: torch, ml_dtypes and Triton casts judged by the emulator."""

from __future__ import annotations

import argparse
import sys

from fp8sim.commands.output import info, print_json, print_table

__all__ = ["register", "run", "MAX_PATTERNS"]

#: the largest sweep: its patterns and every library's casts of them are held in memory
MAX_PATTERNS = 1 << 26


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "conformance",
        help="check torch / ml_dtypes / Triton casts against the emulator, code for code (any NaN code matches any NaN code)",
    )
    p.add_argument("--patterns", type=int, default=1 << 22,
                   help="float32 bit patterns in the sweep (default 2**22; 2**24 in the tests)")
    p.add_argument("--library", action="append", default=None,
                   help="only these libraries (torch, ml_dtypes, triton); repeatable")
    p.add_argument("--examples", type=int, default=3, help="disagreements shown per check (default %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--fail-on-disagreement", action="store_true",
                   help="exit 1 if any library follows neither overflow rule")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    # without a GPU, Triton's casts can only run in its interpreter; with one, natively
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    from fp8sim.conformance import LIBRARIES, CheckResult, run_conformance, untested_libraries

    if not 1 <= args.patterns <= MAX_PATTERNS:
        raise ValueError(f"--patterns must be in 1..{MAX_PATTERNS} (2**26: the sweep is held in "
                         f"memory), got {args.patterns}")  # fmt: skip
    for lib in args.library or []:
        if lib not in LIBRARIES:
            raise ValueError(f"--library {lib!r}: valid: {', '.join(LIBRARIES)}")
    untested = untested_libraries()
    for lib in args.library or []:
        if lib in untested:  # asked for by name: not testing it is an error, said before any work
            raise ValueError(f"--library {lib}: cannot be tested here: {untested[lib]}")
    show = (lambda m: info(f"  checking {m}")) if (sys.stderr.isatty() and not args.json) else None
    results = run_conformance(args.patterns, args.library, args.examples, progress=show)
    # the libraries left out, said in the table and the JSON (verdict UNTESTED) and on stderr
    results += [CheckResult(lib, "-", "-", "-", 0, -1, -1, "UNTESTED", [], why)
                for lib, why in untested.items() if not args.library]
    for lib, why in untested.items():
        if not args.library:
            info(f"not tested: {lib}: {why}")
    if args.json:
        print_json([r.as_dict() for r in results])
    else:
        rows = []
        for r in results:
            pct = lambda k: "-" if k < 0 or r.n == 0 else f"{100 * k / r.n:.4f}%"  # noqa: E731
            verdict = r.error or r.verdict
            if r.excluded:
                verdict += f" (excl. {r.excluded} known*)"
            rows.append([r.library, r.target, r.fmt, r.inputs, r.n, pct(r.agree_saturating),
                         pct(r.agree_nonsaturating), verdict])
        print_table(["library", "type", "ours", "inputs", "n", "=saturating", "=non-sat",
                     "verdict"], rows)
        notes = {(r.library, r.target): r.note for r in results if r.note}
        if notes:
            print("\n* known, documented differences (those inputs are not judged):")
            for (lib, typ), note in notes.items():
                print(f"  {lib} {typ}: {note}")
        if args.library and not results:
            info(f"no casts available for {', '.join(args.library)}")
        bad = [r for r in results if r.first_disagreements]
        if bad:
            print("\nfirst disagreements (input -> theirs | emulator, closer overflow rule):")
            for r in bad:
                for d in r.first_disagreements:
                    print(f"  {r.library} {r.target} [{r.inputs}]: {d['input']!r} -> "
                          f"{d['theirs']} ({d['theirs_value']!r}) | {d['emulator']} "
                          f"({d['emulator_value']!r})")
    if args.fail_on_disagreement and any(r.verdict in ("DISAGREES", "ERROR") for r in results):
        return 1
    return 0
