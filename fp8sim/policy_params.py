"""Policy parameters: the schema type and the spec-string parsing helpers of
:func:`fp8sim.policies.parse_policy` (``"name:key=value,flag,choice"``).

Values are converted to the type of the parameter's default; unknown keys, bad values and bad
choices raise ValueError naming what is valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Param", "format_param", "check_margin", "check_count", "coerce_params", "split_items",
           "bare_word"]


@dataclass(frozen=True)
class Param:
    """One policy parameter: its default (whose type is the parameter's type) and meaning."""

    default: Any
    help: str
    choices: tuple[str, ...] | None = None


def check_margin(policy: str, margin: float) -> None:
    if not math.isfinite(margin) or abs(margin) > 126:
        raise ValueError(f"{policy}: margin must be finite with |margin| <= 126, got {margin}")


def check_count(policy: str, key: str, n: int, most: int) -> None:
    if not 1 <= n <= most:
        raise ValueError(f"{policy}: {key} must be >= 1 and <= {most}, got {n:.6g}")


def format_param(v: Any) -> str:
    """A parameter value as specs spell it (``true``/``false``, ``16``, ``1e-05``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)
    return str(v)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _convert(policy: str, key: str, param: Param, value: Any) -> Any:
    kind = type(param.default)
    where = f"policy {policy!r}, parameter {key!r}"
    if kind is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{where}: expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected an integer, got {value!r}") from None
        if not f.is_integer():
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return int(f)
    if kind is float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
        if math.isnan(f):
            raise ValueError(f"{where}: expected a number, got NaN")
        return f
    text = str(value).strip()
    if param.choices is not None:
        text = text.lower()
        if text not in param.choices:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(param.choices)}")
    return text


def coerce_params(policy: str, schema: dict[str, Param], given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(schema))
    if unknown:
        valid = ", ".join(schema) or "(none)"
        raise ValueError(f"policy {policy!r}: unknown parameter {unknown[0]!r}; valid: {valid}")
    return {k: _convert(policy, k, p, given.get(k, p.default)) for k, p in schema.items()}


def split_items(body: str) -> list[str]:
    """Split on commas (granularity values like ``block:1x128`` contain no commas)."""
    return body.split(",") if body else []


def bare_word(policy: str, schema: dict[str, Param], word: str) -> tuple[str, Any]:
    if word in schema and isinstance(schema[word].default, bool):
        return word, True
    hits = [k for k, p in schema.items() if p.choices and word in p.choices]
    if len(hits) == 1:
        return hits[0], word
    flags = [k for k, p in schema.items() if isinstance(p.default, bool)]
    choices = [c for p in schema.values() if p.choices for c in p.choices]
    valid = ", ".join(flags + choices) or "(none)"
    raise ValueError(
        f"policy {policy!r}: {word!r} is not a flag or choice (key=value needed); "
        f"bare words: {valid}; "
        f"keys: {', '.join(schema) or '(none)'}"
    )
