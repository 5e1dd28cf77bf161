"""Small shared output helpers for subcommands: tables to stdout, JSON, stderr messages."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

__all__ = ["print_table", "print_json", "info"]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file=None) -> None:
    """A plain aligned text table (no colour, safe for pipes)."""
    file = file or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=file)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=file)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, allow_nan=True)
    sys.stdout.write("\n")


def info(msg: str) -> None:
    print(msg, file=sys.stderr)
