"""Readable mismatch reports: codes as hex and sign.exponent.mantissa fields, inputs with bits."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fp8sim.emulator import decode_table
from fp8sim.formats import FloatFormat


def code_fields(code: int, fmt: FloatFormat) -> str:
    """``"s.eeee.mmm"`` of a code (no sign field for unsigned formats, no mantissa field
    without mantissa bits); ``"(not a code)"`` past the format's width."""
    if not 0 <= code < fmt.num_codes:
        return "(not a code)"
    bits = format(code, f"0{fmt.bits}b")
    s, rest = (bits[0], bits[1:]) if fmt.signed else ("", bits)
    e, m = rest[: fmt.exponent_bits], rest[fmt.exponent_bits :]
    return ".".join(p for p in (s, e, m) if p)


def describe_code(code: int, fmt: FloatFormat) -> str:
    """``"0x58 0.1011.000 = 8"``: hex, fields and exact decoded value."""
    width = 2 if fmt.bits <= 8 else 4
    head = f"0x{code:0{width}x} {code_fields(code, fmt)}"
    if not 0 <= code < fmt.num_codes:
        return head
    return f"{head} = {float(decode_table(fmt, np.float64)[code]):.9g}"


def float_bits(v: Any) -> str:
    """Hex bit pattern of a float32/float64/float16/bfloat16 scalar, in its own width."""
    a = np.asarray(v)
    width = a.dtype.itemsize
    bits = int(a.reshape(1).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[width])[0])
    return f"0x{bits:0{2 * width}x}"


def describe_float(v: Any) -> str:
    """Shortest repr that round-trips in the value's own dtype, and its bits."""
    a = np.asarray(v)
    text = str(a.astype(np.float32)) if a.dtype.name == "bfloat16" else str(a[()])
    return f"{text} ({a.dtype.name} {float_bits(a)})"


def table(header: list[str], rows: list[list[str]], indent: str = "  ") -> str:
    """Columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(indent + line for line in lines)


def index_str(flat: int, shape: tuple[int, ...]) -> str:
    if len(shape) <= 1:
        return f"[{flat}]"
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(flat, shape)) + "]"


def with_msg(report: str, msg: str | Callable[[str], str] | None) -> str:
    """numpy.testing/torch.testing style: a string ``msg`` heads the report; a callable gets
    the report and returns the whole message."""
    if msg is None:
        return report
    if callable(msg):
        return msg(report)
    return f"{msg}\n{report}"
