"""Small shared output helpers for subcommands: tables to stdout, JSON, stderr messages."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from fp8sim.errors import one_line  # noqa: F401 (here for the commands; defined in the core)

__all__ = ["print_table", "print_json", "json_safe", "info", "one_line"]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file=None) -> None:
    """A plain aligned text table (no colour, safe for pipes)."""
    file = file or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=file)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=file)


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as the strings "nan", "inf", "-inf" (strict JSON has no
    NaN/Infinity literals; jq and most parsers reject them)."""
    if isinstance(obj, float):
        if obj != obj:
            return "nan"
        if obj in (float("inf"), float("-inf")):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    """Strict JSON on stdout (see :func:`json_safe`)."""
    json.dump(json_safe(obj), sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def info(msg: str) -> None:
    print(msg, file=sys.stderr)


