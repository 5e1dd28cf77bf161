"""``fp8sim cast VALUE... --format F``: encode values, show codes, fields and errors."""

from __future__ import annotations

import argparse
import math
import re

import numpy as np

from fp8sim.commands.output import info, print_json, print_table
from fp8sim.formats import ROUNDING_MODES, generic_format_note, get_format

__all__ = ["register", "run", "cast_record"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cast", help="encode values: code (hex and fields), value, error")
    p.add_argument("values", nargs="+", help="numbers (float64, e.g. 1.1 464 -3e-5 inf nan)")
    p.add_argument("--format", "-f", default="e4m3", help="target format (default e4m3)")
    p.add_argument("--rounding", "-r", default="rne", choices=ROUNDING_MODES,
                   help="rounding mode (default %(default)s: to nearest, ties to even)")
    p.add_argument("--no-saturate", action="store_true",
                   help="OCP non-saturating overflow (inf, or NaN where no inf)")
    p.add_argument("--seed", type=int, default=None,
                   help="Philox seed for --rounding stochastic (default 0)")
    p.add_argument("--srbits", type=int, default=None, help="random bits for stochastic (1..32)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=run)
    # let "-3e-5" and "-inf" be values, not options (argparse only knows "-3" and "-.5")
    p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$")


def _parse_value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r} (use e.g. 1.5, -3e-5, inf, nan)") from None


def _fields(code: int, fmt) -> str:
    m = fmt.mantissa_bits
    e = fmt.exponent_bits
    mant = code & ((1 << m) - 1)
    exp = (code >> m) & ((1 << e) - 1)
    parts = []
    if fmt.signed:
        parts.append(str((code >> (e + m)) & 1))
    parts.append(format(exp, f"0{e}b"))
    if m:
        parts.append(format(mant, f"0{m}b"))
    return ".".join(parts)


def cast_record(value: float, code: int, decoded: float, fmt) -> dict:
    abs_err = decoded - value if math.isfinite(decoded) and math.isfinite(value) else float("nan")
    rel_err = abs_err / abs(value) if value not in (0.0,) and math.isfinite(abs_err) else (
        0.0 if abs_err == 0 else float("nan"))
    return {
        "input": value,
        "code": f"{code:#0{2 + (fmt.bits + 3) // 4}x}",
        "fields": _fields(code, fmt),
        "value": decoded,
        "abs_error": abs_err,
        "rel_error": rel_err,
    }


def _show(v: float) -> str:
    """A float as Python writes it, but a NaN with its sign (``repr`` drops it: -nan -> 'nan')."""
    return ("-nan" if math.copysign(1.0, v) < 0 else "nan") if math.isnan(v) else repr(v)


def _in_cli_words(message: str, values: list[str]) -> str:
    """An encode error as the command line says it: flags instead of keyword arguments, the
    value as typed instead of its array index."""
    message = message.replace("use saturate=True", "leave out --no-saturate to saturate")
    m = re.search(r"\(first at index \((\d+),\)\)", message)
    if m and int(m.group(1)) < len(values):
        message = message.replace(m.group(0), f"(first: {values[int(m.group(1))]})")
    return message


def run(args: argparse.Namespace) -> int:
    from fp8sim.emulator import decode, encode  # compiles numba code: only when casting

    fmt = get_format(args.format)
    note = generic_format_note(args.format)
    if note:
        info(f"note: {note}")
    x = np.array([_parse_value(v) for v in args.values], dtype=np.float64)
    kw = {}
    if args.rounding == "stochastic":
        kw = dict(seed=0 if args.seed is None else args.seed, srbits=args.srbits)
    elif args.seed is not None or args.srbits is not None:
        raise ValueError(f"--seed and --srbits are for --rounding stochastic, not {args.rounding}")
    try:
        codes = encode(x, fmt, rounding=args.rounding, saturate=not args.no_saturate, **kw)
    except ValueError as exc:  # the emulator's words are the API's: say it with the CLI's
        raise ValueError(_in_cli_words(str(exc), args.values)) from None
    values = decode(codes, fmt, dtype=np.float64)
    records = [cast_record(float(v), int(c), float(d), fmt) for v, c, d in zip(x, codes, values)]
    if args.json:
        print_json({"format": fmt.name, "rounding": args.rounding,
                    "saturate": not args.no_saturate, "results": records})
        return 0
    rows = [[_show(r["input"]), r["code"], r["fields"], _show(r["value"]),
             f"{r['abs_error']:.6g}", f"{r['rel_error']:.3e}"] for r in records]
    print_table(["input", "code", "s.exp.man", "value", "abs error", "rel error"], rows)
    return 0
