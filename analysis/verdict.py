"""A per-layer verdict from a trace: can this layer's tensor of this role go FP8, and how?

One :class:`~fp8sim.analysis.records.LayerVerdict` per traced tensor, i.e. per layer and role.
The layer is the tensor's name without its role suffix (``.input``, ``.weight``,
``.grad_output``, ``.weight_grad``: how the recorder names a linear layer's casts); a name
without such a suffix is its own layer. The tensor is judged in the format the trace records for
it (the recipe's format for that role: E5M2 for ``grad_output`` under ``te-delayed``), under the
trace's rounding.

Warm-up
    A tensor's records before the first one whose recorded scale differs from 1, when its
    first record has scale 1 and a later one does not: the steps a delayed-scaling policy casts
    at its initial scale 1 because it has seen no amax yet. A tensor whose scale is 1 throughout
    (static scaling), or whose first scale is not 1 (just-in-time scaling), has no warm-up.
    The warm-up records are reported apart (their overflow and worst underflow under the
    recorded scales) and left out of the verdict.

The rule, over the records after warm-up (records of one step summed into that step's shares):

a. Margin: if the recorded scales overflowed at steps whose overflow share reaches the status
   rule's warning share (``overflow_warning``, :mod:`fp8sim.analysis.status`: a handful of
   saturated values asks for nothing), ``margin`` is the smallest whole number N >= 1 of
   binades such that every record of those steps, cast with its recorded scale divided by 2**N,
   has no overflowing value (from its |x| histogram; exact for a power-of-two scale, else the
   upper end of the bracket). The policy sees the same amaxes, so its margin N divides each of
   its scales by exactly 2**N.
b. Underflow under ideal just-in-time power-of-two per-tensor scaling: each record cast with
   ``2**floor(log2(fmt.max / amax))`` (it never overflows), its underflow counted from the
   histogram. If the worst step's share is below the status rule's warning threshold
   (``underflow_warning``): ``needs margin N`` when (a) found overflow, else ``ok``.
c. Otherwise per-tensor scaling loses too much. If the trace saved full tensors of this tensor
   at steps after warm-up, ``row``, ``block:1x128`` and ``mx`` are cast exactly from each of
   them (as ``fp8sim analyze --scaling`` does): the scaling whose worst saved step has the
   smallest underflow share is the best; below the threshold: ``needs finer scaling (best:
   X)``, else ``keep in higher precision``.
d. Without saved tensors, an estimate from the histograms: a finer scaling gives a group whose
   amax lies :data:`FINER_HEADROOM_BINADES` binades below the tensor's a scale that many binades
   larger. If the worst step's underflow share with the just-in-time scale raised by that many
   binades is below the threshold: ``needs finer scaling (estimate)``, else ``keep in higher
   precision (estimate)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fp8sim.analysis.records import LayerVerdict
from fp8sim.analysis.status import Thresholds, warmup_length
from fp8sim.formats import get_format

__all__ = ["ROLE_SUFFIXES", "FINER_SCALINGS", "FINER_HEADROOM_BINADES", "layer_of", "layer_verdicts",
           "format_verdict_table"]  # fmt: skip

#: a recorded tensor's name is ``<layer><suffix>``: the recorder's names of a linear's casts
ROLE_SUFFIXES = (".input", ".weight", ".grad_output", ".weight_grad")
#: the finer scalings tried from saved full tensors, coarsest first (ties go to the first)
FINER_SCALINGS = ("row", "block:1x128", "mx")
#: the histogram criterion's assumption: a finer scaling's groups sit this many binades below
#: the tensor amax (a group scale 2**8 larger than the tensor scale)
FINER_HEADROOM_BINADES = 8
#: margins tried before giving up (a value beyond float32's range overflows under any scale)
_MAX_MARGIN = 128


def layer_of(name: str) -> str:
    """The layer of a recorded tensor: its name without a :data:`ROLE_SUFFIXES` suffix."""
    for suffix in ROLE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def _jit_exponent(amax: float, fmt) -> int | None:
    """j with 2**j <= fmt.max / amax < 2**(j+1), clamped to the histogram's exact range; None
    for an amax that is 0 or not finite (nothing to scale)."""
    if not (amax > 0 and math.isfinite(amax)):
        return None
    fr, ex = math.frexp(fmt.max / amax)  # fmt.max / amax = fr * 2**ex, 0.5 <= fr < 1
    return max(-99, min(99, ex - 1))


def _margin_needed(rec, fmt, rounding: str) -> int:
    """Smallest N >= 1 with no overflow at ``rec.scale / 2**N`` (histogram upper bound);
    :data:`_MAX_MARGIN` + 1 when none up to it removes it."""
    n0 = 1
    if rec.amax > 0 and math.isfinite(rec.amax) and rec.scale > 0:
        n0 = max(1, math.floor(math.log2(rec.amax * rec.scale / fmt.max)))
    for n in range(n0, _MAX_MARGIN + 1):
        if rec.hist.overflow_bounds(fmt, rec.scale / 2.0**n, rounding)[1] == 0:
            # n0 may overshoot by one where the ratio is just above a power of two
            while n > 1 and rec.hist.overflow_bounds(fmt, rec.scale / 2.0 ** (n - 1), rounding)[1] == 0:
                n -= 1
            return n
    return _MAX_MARGIN + 1


class _Steps:
    """Per-step sums of (underflow, nonzero) for several counts of one tensor."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[int]] = {}

    def add(self, step: int, *counts: int) -> None:
        acc = self.by_step.setdefault(step, [0] * len(counts))
        for i, c in enumerate(counts):
            acc[i] += int(c)

    def worst(self, under: int, nonzero: int) -> tuple[float, int | None]:
        """(worst step's share in percent, that step) of columns ``under`` / ``nonzero``."""
        best, at = 0.0, None
        for step, acc in sorted(self.by_step.items()):
            share = 100.0 * acc[under] / acc[nonzero] if acc[nonzero] else 0.0
            if at is None or share > best:
                best, at = share, step
        return best, at


def _finer_from_saved(reader: Any, name: str, fmt, steps: list[int]) -> tuple[str, float]:
    """(best finer scaling, its worst underflow share in percent over ``steps``) from the saved
    full tensors (exact casts, round to nearest even, saturating)."""
    from fp8sim.analysis.stats import parse_variants, tensor_stats

    variants = parse_variants([fmt.name], list(FINER_SCALINGS))
    worst = [0.0] * len(variants)
    for step in steps:
        st = tensor_stats(reader.load_tensor(step, name), variants, name=name)
        for i, v in enumerate(st.variants):
            share = 100.0 * v.underflow / st.nonzero if st.nonzero else 0.0
            worst[i] = max(worst[i], share)
    i = int(np.argmin(worst))  # the first of equal ones: the coarsest
    return FINER_SCALINGS[i], worst[i]


def layer_verdicts(path: str, reader: Any, th: Thresholds = Thresholds(), *,
                   what_if: bool = False) -> list[LayerVerdict]:  # fmt: skip
    """The verdict per traced tensor (layer x role) of the trace ``reader`` (a
    :class:`fp8sim.trace.TraceReader`) at ``path``, with the status thresholds ``th``
    (:mod:`fp8sim.analysis.status`). The rule: the module docstring. In catalogue order; tensors
    without records are left out, and so are the casts the run did not perform (``what_if``
    tensors of the catalogue) unless ``what_if``. Raises ValueError for a corrupt chunk or saved
    tensor."""
    underflow_warning = th.underflow_warning
    rounding = reader.rounding
    fmts: dict[str, Any] = {}
    per: dict[int, list] = {}
    for rec in reader.records():
        if rec.numel == 0:  # an idle MoE expert's step: nothing was cast
            continue
        per.setdefault(reader.tensor(rec.name).index, []).append(rec)
    saved: dict[str, list[int]] = {}
    for step, name in reader.saved_tensors():
        saved.setdefault(name, []).append(step)
    out = []
    for t in reader.tensors:
        recs = per.get(t.index)
        if not recs or (t.what_if and not what_if):
            continue
        fmt = fmts.get(recs[0].format) or fmts.setdefault(recs[0].format, get_format(recs[0].format))
        n_warm = warmup_length([r.scale for r in recs])
        warm, post = recs[:n_warm], recs[n_warm:]
        # the steps whose overflow share makes their cast a warning or worse: only their
        # overflow asks for a margin (a handful of saturated values does not)
        step_over = _Steps()
        for r in post:
            step_over.add(r.step, r.overflow, r.numel - r.nan - r.inf)
        loud = {s for s, (o, fin) in step_over.by_step.items() if fin and 100.0 * o / fin >= th.overflow_warning}
        warm_steps = _Steps()
        for r in warm:
            warm_steps.add(r.step, r.underflow, r.hist.nonzero, r.overflow)
        post_steps = _Steps()
        margin = 0
        over_steps = set()
        for r in post:
            rf = fmts.get(r.format) or fmts.setdefault(r.format, get_format(r.format))
            j = _jit_exponent(r.amax, rf)
            jit_under = 0 if j is None else r.hist.underflow_bounds(rf, 2.0**j, rounding)[1]
            wide = 0
            if j is not None:
                jw = min(99, j + FINER_HEADROOM_BINADES)
                wide = r.hist.underflow_bounds(rf, 2.0**jw, rounding)[1]
            post_steps.add(r.step, r.underflow, r.hist.nonzero, jit_under, wide, r.overflow)
            if r.overflow > 0:
                over_steps.add(r.step)
                if r.step in loud:
                    margin = max(margin, _margin_needed(r, rf, rounding))
        overflow = sum(int(r.overflow) for r in post)
        rec_un, _ = post_steps.worst(0, 1)
        jit_un, jit_step = post_steps.worst(2, 1)
        wide_un, _ = post_steps.worst(3, 1)
        finer, best, basis = None, None, "histogram"
        if margin > _MAX_MARGIN:
            verdict, text = "keep in higher precision", "keep in higher precision (overflows under any margin)"
        elif jit_un < underflow_warning:
            verdict = "needs margin" if margin else "ok"
            text = f"needs margin {margin}" if margin else "ok"
        else:
            post_set = {r.step for r in post}
            steps = [s for s in saved.get(t.name, []) if s in post_set]
            if steps:
                basis = "saved tensors"
                best, finer = _finer_from_saved(reader, t.name, fmt, steps)
                if finer < underflow_warning:
                    verdict, text = "needs finer scaling", f"needs finer scaling (best: {best})"
                else:
                    verdict, text = "keep in higher precision", "keep in higher precision"
            else:
                basis, finer = "estimate", wide_un
                if wide_un < underflow_warning:
                    verdict, text = "needs finer scaling", "needs finer scaling (estimate)"
                else:
                    verdict, text = "keep in higher precision", "keep in higher precision (estimate)"
            if margin and verdict == "needs finer scaling":
                text += f"; recorded scales need margin {margin}"
        warm_un = warm_steps.worst(0, 1)[0] if warm else None
        out.append(LayerVerdict(
            trace=path, layer=layer_of(t.name), role=t.role, tensor=t.name, what_if=t.what_if, format=fmt.name,
            verdict=verdict, text=text, margin=margin or None, best_scaling=best, basis=basis,
            steps=len(post_steps.by_step), overflow=overflow, overflow_steps=len(over_steps),
            underflow_pct=rec_un, jit_underflow_pct=jit_un, jit_underflow_step=jit_step,
            finer_underflow_pct=finer, warmup_steps=len(warm_steps.by_step),
            warmup_first_step=warm[0].step if warm else None,
            warmup_last_step=warm[-1].step if warm else None,
            warmup_overflow=sum(int(r.overflow) for r in warm), warmup_worst_underflow_pct=warm_un,
        ))  # fmt: skip
    return out


def format_verdict_table(verdicts: list[LayerVerdict]) -> str:
    """One line per layer and role: verdict, the evidence, and the warm-up apart."""
    from fp8sim.analysis.report import text_table

    rows = []
    for v in verdicts:
        why = f"jit pow2 worst underflow {v.jit_underflow_pct:.3g}%"
        if v.finer_underflow_pct is not None:
            why += f"; {v.best_scaling or 'finer (estimate)'} {v.finer_underflow_pct:.3g}%"
        if v.overflow:
            few = "" if v.margin else " (below the warning share: no margin needed)"
            why = f"recorded overflow {v.overflow} in {v.overflow_steps} steps{few}; " + why
        if v.warmup_steps:
            span = (f"step {v.warmup_first_step}" if v.warmup_first_step == v.warmup_last_step
                    else f"steps {v.warmup_first_step}-{v.warmup_last_step}")  # fmt: skip
            warm = f"{span}: underflow {v.warmup_worst_underflow_pct:.3g}%"
            if v.warmup_overflow:
                warm += f", overflow {v.warmup_overflow}"
        else:
            warm = "-"
        rows.append([v.layer, v.role + (" (what-if)" if v.what_if else ""), v.format, v.text, str(v.steps), why, warm])
    return text_table(["layer", "role", "format", "verdict", "steps", "why (after warm-up)", "warm-up"],
                      rows, right={4})  # fmt: skip
