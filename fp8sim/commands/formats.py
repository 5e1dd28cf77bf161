"""``fp8sim formats``: the named formats and their derived properties."""

from __future__ import annotations

import argparse

from fp8sim.commands.output import info, print_json, print_table
from fp8sim.formats import generic_format_note, get_format, list_formats

__all__ = ["register", "run", "format_record"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("formats", help="list formats: bits, bias, range, eps, special codes")
    p.add_argument("names", nargs="*", help="formats to show (default: all named ones; eXmY ok)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=run)


def _hex(code: int | None, fmt) -> str:
    if code is None:
        return "-"
    return f"{code:#0{2 + (fmt.bits + 3) // 4}x}"


def format_record(fmt) -> dict:
    return {
        "name": fmt.name,
        "bits": fmt.bits,
        "exponent_bits": fmt.exponent_bits,
        "mantissa_bits": fmt.mantissa_bits,
        "bias": fmt.bias,
        "signed": fmt.signed,
        "max": fmt.max,
        "min_normal": fmt.min_normal,
        "min_subnormal": fmt.min_subnormal,
        "eps": fmt.eps,
        "dynamic_range_binades": round(fmt.dynamic_range_binades, 3),
        "inf": _hex(fmt.inf_code, fmt) if fmt.has_inf else None,
        "nan": None if fmt.nan_code is None else _hex(fmt.nan_code, fmt),
        "nan_kind": fmt.nan,
        "max_code": _hex(fmt.max_code, fmt),
    }


def run(args: argparse.Namespace) -> int:
    fmts = [get_format(n) for n in args.names] if args.names else list_formats()
    for n in args.names or []:
        note = generic_format_note(n)
        if note:
            info(f"note: {note}")
    records = [format_record(f) for f in fmts]
    if args.json:
        print_json(records)
        return 0
    rows = [
        [r["name"], r["bits"], r["bias"], f"{r['max']:.6g}", f"{r['min_normal']:.6g}",
         f"{r['min_subnormal']:.6g}", f"{r['eps']:g}", f"{r['dynamic_range_binades']:.2f}",
         r["inf"] or "none", r["nan"] or "none", r["nan_kind"]]
        for r in records
    ]
    print_table(["format", "bits", "bias", "max", "min_normal", "min_subnormal", "eps",
                 "binades", "+inf", "NaN", "NaN kind"], rows)
    return 0
