"""Reports: worst-first terminal tables and ``--fail-on`` rules (the statuses themselves:
:mod:`fp8sim.analysis.status`).

``--fail-on`` rules: comma-separated ``METRIC OP VALUE[%]`` with OP in ``> >= < <=``; METRIC one
of :data:`FAIL_METRICS` (``analyze``) or :data:`REPLAY_FAIL_METRICS` (``replay``). With ``%`` the
share in percent is compared (``underflow>1%``), without it the count or value (``overflow>0``,
``sqnr_db<20``). For ``analyze`` a rule may also be a status word, ``critical`` or ``warning``:
crossed by every record of that status or worse (the statuses of the table). Under ``mx`` (the
OCP MX floor rule) the values above the format's max are *clamped* by design: they count under
the metric ``clamped``, never under ``overflow``.
"""

from __future__ import annotations

import math
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fp8sim.analysis.status import STATUS_ORDER, clamped_by_mx_floor
from fp8sim.nan_aware import worst_first

__all__ = [
    "sort_worst_first",
    "sqnr_value",
    "format_table",
    "text_table",
    "FailRule",
    "parse_fail_on",
    "failures",
    "FAIL_METRICS",
    "REPLAY_FAIL_METRICS",
    "format_replay_table",
    "format_trace_table",
    "STATUS_RULES",
]

#: metric -> (count/value field, share field or None); ``overflow`` leaves out the values the MX
#: floor rule clamps, ``clamped`` counts those alone (both from the record's overflow fields)
FAIL_METRICS = {
    "overflow": ("overflow", "overflow_pct"),
    "clamped": ("overflow", "overflow_pct"),
    "underflow": ("underflow", "underflow_pct"),
    "subnormal": ("subnormal", "subnormal_pct"),
    "nan": ("nan", None),
    "inf": ("inf", None),
    "lost": ("lost", None),
    "sqnr_db": ("sqnr_db", None),
    "rel_mse": ("rel_mse", None),
    "amax": ("amax", None),
}
#: ``fp8sim replay`` rules, per policy x tensor x step record: ``overflow`` / ``underflow`` the
#: values that overflow / underflow in the cast (count, or ``%`` of the finite / nonzero finite
#: values), ``events`` the tensor's overflow events (its amax overflowed) under the policy so far,
#: that step included
REPLAY_FAIL_METRICS = {
    "overflow": ("overflow", "overflow_pct"),
    "underflow": ("underflow", "underflow_pct"),
    "events": ("events", None),
}
#: ``--fail-on`` words of ``analyze``: crossed by a record of that status or worse
STATUS_RULES = ("critical", "warning")
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_RULE_RE = re.compile(r"^\s*([a-z_0-9]+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+|[-+]?inf)\s*(%?)\s*$")


def sqnr_value(rec: dict[str, Any], metric: str = "sqnr_db") -> float | None:
    """A record's ``sqnr_db`` or ``rel_mse`` as a float, its non-finite values restored from
    ``sqnr_case`` (:func:`analysis.stats.sqnr_case`): exact gives +inf dB (rel_mse 0), unbounded
    -inf dB (rel_mse inf); None when undefined (no finite value)."""
    v = rec.get(metric)
    if v is not None:
        return v
    case = rec.get("sqnr_case")
    if case == "exact":
        return math.inf if metric == "sqnr_db" else 0.0
    if case == "unbounded":
        return -math.inf if metric == "sqnr_db" else math.inf
    return None


def sort_worst_first(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By class, then overflow share, underflow share, and SQNR (lowest first)."""

    def key(r: dict[str, Any]):
        return (
            STATUS_ORDER[r["status"]],
            worst_first(r["overflow_pct"]),  # a NaN figure first: it is never sorted out of sight
            worst_first(r["underflow_pct"]),
            worst_first(sqnr_value(r), higher_is_worse=False),  # undefined last
            r["name"],
        )

    return sorted(records, key=key)


def _num(v: Any, fmt: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, fmt)


def _sqnr_cell(r: dict[str, Any]) -> str:
    """SQNR in dB; ``exact`` only for a record without any error (rel_mse 0), ``-inf`` when the
    error is not finite or the signal is 0, ``-`` when no value was finite (undefined)."""
    v = sqnr_value(r)
    if v is None:
        return "-"
    if math.isinf(v):
        return "exact" if v > 0 else "-inf"
    return _num(v, ".1f")


def _pct(count: int, pct: float) -> str:
    if count == 0:
        return "0"
    return f"{count} ({pct:.3g}%)"


#: what never goes into a table cell as it is: C0/C1 control characters (a newline would break
#: the row, an escape sequence restyle the terminal), Unicode line/paragraph separators and the
#: bidirectional overrides (they reorder the text shown)
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    c = m.group()
    return _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape_cell(text: str) -> str:
    """``text`` for one line of a table: line breaks written ``\\n`` / ``\\r`` as the one-line
    error messages write them (``fp8sim.errors.one_line``), a tab ``\\t``, the other
    :data:`_UNSAFE` characters ``\\xNN`` / ``\\uNNNN``. Unlike ``one_line`` nothing is stripped
    or cut: no part of a name is lost. JSON keeps the raw text."""
    return _UNSAFE.sub(_escape, text)


def text_table(headers: Sequence[str], rows: list[list[str]], right: set[int]) -> str:
    """A plain-text table: columns padded to their widest cell, those in ``right`` (indices)
    right-aligned, each cell escaped to one line (:func:`escape_cell`)."""
    rows = [[escape_cell(c) for c in row] for row in rows]  # one line per row, whatever a name holds
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _tensor_cells(records: list[dict[str, Any]]) -> Callable[[dict[str, Any]], str]:
    """record -> its tensor cell: the name; ``name (file)`` when tensors of that name come from
    more than one file (the file's base name, or its whole path where base names repeat too)."""
    files: dict[str, set] = {}
    for r in records:
        files.setdefault(r["name"], set()).add(r.get("file"))
    shown: dict[tuple[str, Any], str] = {}
    for name, fs in files.items():
        if len(fs) < 2:
            continue
        bases = {f: os.path.basename(os.path.normpath(f)) if f else "?" for f in fs}
        unique = len(set(bases.values())) == len(fs)
        for f in fs:
            shown[name, f] = f"{name} ({bases[f] if unique else f})"
    return lambda r: shown.get((r["name"], r.get("file")), r["name"])


def format_table(records: list[dict[str, Any]], *, limit: int | None = None) -> str:
    """The terminal table, rows in the given order (sort first), at most ``limit`` rows."""
    headers = ["status", "tensor", "format", "scaling", "numel", "amax", "scale",
               "overflow", "underflow", "subnormal", "sqnr_db"]  # fmt: skip
    shown = records if limit is None else records[:limit]
    specials = any(r.get("nan") or r.get("inf") for r in shown)  # the column only when it says something
    if specials:
        headers.insert(7, "nan/inf")
    tensor = _tensor_cells(records)
    rows = []
    for r in shown:
        rows.append(
            [
                r["status"],
                tensor(r) + (" (what-if)" if r.get("what_if") else ""),
                r["format"],
                r["scaling"],
                str(r["numel"]),
                _num(math.inf if r["amax"] is None else r["amax"]),  # null: inf (see FailRule)
                _num(r["scale"]),
                ("clamped " if clamped_by_mx_floor(r) else "") + _pct(r["overflow"], r["overflow_pct"]),
                _pct(r["underflow"], r["underflow_pct"]),
                _pct(r["subnormal"], r["subnormal_pct"]),
                _sqnr_cell(r),
            ]
        )
        if specials:
            nan, inf = r.get("nan", 0), r.get("inf", 0)
            rows[-1].insert(7, f"{nan}/{inf}" if nan or inf else "-")
    text = text_table(headers, rows, right=set(range(4, len(headers))))
    if any(clamped_by_mx_floor(r) for r in shown):
        text += ("\nclamped: under mx (the OCP MX floor rule) a block's largest values can scale above the "
                 "format's max; the spec clamps them to it by design (mx:rceil rounds the scale up instead)")
    if limit is not None and len(records) > limit:
        text += f"\n... {len(records) - limit} more (use --top 0 for all, or --json)"
    return text


@dataclass(frozen=True)
class FailRule:
    """One ``--fail-on`` rule: ``metric op value`` (``percent``: compare the share)."""

    metric: str
    op: str
    value: float
    percent: bool

    def __str__(self) -> str:
        if self.metric in STATUS_RULES:
            return self.metric
        return f"{self.metric}{self.op}{self.value:g}{'%' if self.percent else ''}"

    def crossed(self, rec: dict[str, Any]) -> bool:
        if self.metric in STATUS_RULES:  # a status word: that status or worse
            return STATUS_ORDER[rec["status"]] <= STATUS_ORDER[self.metric]
        count_field, share_field = FAIL_METRICS.get(self.metric) or REPLAY_FAIL_METRICS[self.metric]
        key = share_field if self.percent else count_field
        if key not in rec:  # e.g. trace rows have no sqnr_db: the rule does not apply
            return False
        v = rec[key]
        if self.metric in ("overflow", "clamped") and clamped_by_mx_floor(rec) != (self.metric == "clamped"):
            v = 0  # MX floor clamping counts as clamped only; other overflow never does
        if v is None and self.metric in ("sqnr_db", "rel_mse"):
            v = sqnr_value(rec, self.metric)  # exact or unbounded: +-inf
        elif v is None and self.metric == "amax":  # never NaN: a null amax is inf (a float64
            v = math.inf  # value beyond float32's range)
        if v is None:  # undefined
            return False
        if isinstance(v, float) and math.isnan(v):  # a NaN figure crosses every rule on it: it
            return True  # cannot be shown to keep to one, and a gate must not let it through
        return _OPS[self.op](v, self.value)


#: metrics whose values span the whole line (+-inf included); the others are never negative
_SIGNED_METRICS = ("sqnr_db",)
#: metrics that can be inf (sqnr_db of an exact cast, rel_mse of an unbounded error, a null
#: amax); counts never are
_INF_METRICS = ("sqnr_db", "rel_mse", "amax")


def _metric_range(metric: str, percent: bool) -> tuple[float, float, bool]:
    """(lowest value, highest value, whether the highest is reached) of a rule's metric: a share
    lies in 0..100 %, a count in 0..inf (inf never reached), sqnr_db in -inf..inf, rel_mse and
    amax in 0..inf."""
    if percent:
        return 0.0, 100.0, True
    lo = -math.inf if metric in _SIGNED_METRICS else 0.0
    return lo, math.inf, metric in _INF_METRICS


def _always_or_never(op: str, c: float, lo: float, hi: float, hi_attained: bool) -> str | None:
    """"always" / "never" when ``value OP c`` holds for every / no value in the metric's range
    ``lo..hi`` (``lo`` always reached, ``hi`` when ``hi_attained``), else None."""
    top_passed = c > hi or (c == hi and not hi_attained)  # no value reaches c
    if op == ">":
        return "never" if c >= hi else "always" if c < lo else None
    if op == ">=":
        return "never" if top_passed else "always" if c <= lo else None
    if op == "<":
        return "never" if c <= lo else "always" if top_passed else None
    return "never" if c < lo else "always" if c >= hi else None  # <=


def _bound(v: float, percent: Any) -> str:
    return f"{v:g}{'%' if percent else ''}"


def parse_fail_on(spec: str, metrics: dict[str, tuple[str, str | None]] = FAIL_METRICS) -> list[FailRule]:
    """Parse ``"overflow>0,underflow>1%"`` with METRIC one of ``metrics`` (:data:`FAIL_METRICS`,
    or :data:`REPLAY_FAIL_METRICS`), or, with :data:`FAIL_METRICS`, a status word of
    :data:`STATUS_RULES`; ValueError naming the bad rule and the valid forms."""
    rules = []
    words = STATUS_RULES if metrics is FAIL_METRICS else ()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part.lower() in words:
            rules.append(FailRule(part.lower(), "", 0.0, False))
            continue
        m = _RULE_RE.match(part.lower())
        if not m or m.group(1) not in metrics:
            also = f", or a status: {' or '.join(words)}" if words else ""
            raise ValueError(
                f"--fail-on rule {part!r}: expected METRIC OP VALUE[%] with METRIC in "
                f"{', '.join(metrics)} and OP in >, >=, <, <= (e.g. overflow>0,underflow>1%){also}"
            )
        metric, op, value, pct = m.groups()
        if pct and metrics[metric][1] is None:
            raise ValueError(f"--fail-on rule {part!r}: {metric} has no share; drop the %")
        try:
            val = float(value)
        except ValueError:
            raise ValueError(f"--fail-on rule {part!r}: {value!r} is not a number") from None
        if pct and val > 100:
            raise ValueError(f"--fail-on rule {part!r}: a share is at most 100%, so the rule "
                             "would always or never fire")  # fmt: skip
        verdict = _always_or_never(op, val, *_metric_range(metric, bool(pct)))
        if verdict:
            lo, hi, hi_attained = _metric_range(metric, bool(pct))
            where = ("is never negative" if lo == 0 and val <= lo else
                     "is a count, never inf" if val >= hi and not hi_attained else
                     f"is at most {_bound(hi, pct)}" if val >= hi else
                     f"lies in {_bound(lo, pct)}..{_bound(hi, pct)}")  # fmt: skip
            raise ValueError(f"--fail-on rule {part!r}: {metric} {where}, so the rule would "
                             f"{verdict} fire")  # fmt: skip
        rules.append(FailRule(metric, op, val, bool(pct)))
    if not rules:
        raise ValueError("--fail-on: no rules given (e.g. overflow>0,underflow>1%)")
    return rules


def failures(records: list[dict[str, Any]], rules: Sequence[FailRule]) -> list[tuple[FailRule, dict]]:
    """(rule, record) for every record that crosses a rule."""
    return [(rule, r) for r in records for rule in rules if rule.crossed(r)]


def format_replay_table(summaries: list[dict[str, Any]]) -> str:
    """Side-by-side policy summary (one row per policy)."""
    headers = ["policy", "events", "overflow", "worst tensor @ step", "median underflow",
               "worst underflow", "exact"]  # fmt: skip
    rows = []
    for s in summaries:
        if not s.get("records"):
            rows.append([s["policy"], "0", "0", "-", "-", "-", "-"])
            continue
        lo, hi = s["overflow_bounds"]
        ov = str(lo) if lo == hi else f"{lo}..{hi}"
        worst = f"{s['worst_tensor']} @ {s['worst_step']}"
        wu = f"{s['worst_underflow_pct']:.3g}% ({s['worst_underflow_tensor']} @ {s['worst_underflow_step']})"
        rows.append(
            [s["policy"], str(s["events"]), ov, worst, f"{s['median_underflow_pct']:.3g}%", wu,
             f"{s['exact_pct']:.0f}%"]  # fmt: skip
        )
    return text_table(headers, rows, right={1, 2, 4, 6})


def format_trace_table(rows: list[dict[str, Any]]) -> str:
    """A trace's recorded statistics, one row per tensor, in the given order (sort first).
    ``overflow`` and ``underflow`` cover every step; ``worst underflow`` and the steps per status
    (``crit / warn``) the steps after the warm-up, which has its own column."""
    body = []
    for r in rows:
        n_warm = r.get("warmup_steps", 0)
        warm = "-"
        if n_warm:
            wu = r.get("warmup_worst_underflow_pct")
            warm = f"{n_warm} step{'s' if n_warm > 1 else ''}" + (f": underflow {wu:.3g}%" if wu is not None else "")
        worst = (f"{r['worst_underflow_pct']:.3g}% @ {r['worst_underflow_step']}"
                 if r.get("worst_underflow_step") is not None else "-")  # fmt: skip
        body.append([
            r["status"], r["name"], r["role"], r["format"], str(r["steps"]),
            f"{r['amax']:.3g}" if r["amax"] is not None else "-",
            f"{r['overflow']} in {r['overflow_steps']} steps" if r["overflow"] else "0",
            f"{r['underflow_pct']:.3g}%", worst,
            f"{r.get('critical_steps', 0)} / {r.get('warning_steps', 0)}", warm,
        ])  # fmt: skip
    return text_table(["status", "tensor", "role", "format", "steps", "max amax", "overflow",
                       "underflow", "worst underflow", "crit / warn steps", "warm-up"], body,
                      right={4, 5, 6, 7, 8, 9})  # fmt: skip
