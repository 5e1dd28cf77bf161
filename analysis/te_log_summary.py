"""What Transformer Engine's debug logs (:mod:`fp8sim.trace.te_logs`) tell, per tensor, and what
a scaling policy would have done with the amaxes they hold.

The logs hold statistics only -- no histogram and no full tensor -- so:

* per tensor (:func:`summarize_te_log`): the largest amax, the worst underflow share of each
  recipe's cast as TE counted it (FP8 codes equal to 0, true zeros included), the delayed-scaling
  overflow share, the range of ``scale_inv`` and the largest MSE -- each with the log's precision
  (a share logged ``0.0000`` is said as ``< 0.00005%``);
* per policy (:func:`replay_te_log`): the scale each step would get from the logged amaxes and
  whether the amax itself overflows (an *event*; exact unless the amax's 4-decimal interval
  straddles the threshold, then ``None``). Overflow and underflow *counts* under another policy
  need the values' distribution, which the logs do not hold: they are not computed.
"""

from __future__ import annotations

from typing import Sequence

from fp8sim.formats import get_format
from fp8sim.trace.te_logs import TeDebugLog, TeStat

__all__ = ["summarize_te_log", "replay_te_log", "te_log_notes", "TE_FORMATS"]

#: the format each TE tensor is cast to under the HYBRID recipe (E4M3 forward, E5M2 backward)
TE_FORMATS = {"activation": "e4m3", "weight": "e4m3", "output": "e4m3", "gradient": "e5m2",
              "wgrad": "e5m2", "dgrad": "e5m2"}  # fmt: skip


def _share(s: TeStat) -> str:
    return "< 0.00005%" if s.below_precision else f"{s.value:.4f}%"


def _amax_series(log: TeDebugLog, layer: str, tensor: str) -> list[tuple[int, float, float]]:
    """(iteration, lo, hi) of the amax: ``cur_amax`` where logged, else max(|min|, |max|)."""
    cur = log.series(layer, tensor, "cur_amax")
    if cur:
        return [(s.iteration, s.lo, s.hi) for s in cur]
    lo = {s.iteration: s for s in log.series(layer, tensor, "min")}
    hi = {s.iteration: s for s in log.series(layer, tensor, "max")}
    out = []
    for it in sorted(set(lo) & set(hi)):
        a, b = lo[it], hi[it]
        out.append((it, max(abs(a.value) - 0.00005, abs(b.value) - 0.00005, 0.0),
                    max(abs(a.value), abs(b.value)) + 0.00005))  # fmt: skip
    return out


def summarize_te_log(log: TeDebugLog) -> list[dict]:
    """One row per (layer, tensor): ``layer, tensor, iterations, amax`` (largest, None if not
    logged), ``underflow`` ({recipe stat: worst share as text}), ``overflow`` (delayed scaling,
    worst share as text), ``scale_inv`` ((min, max) over the recipes' logged values),
    ``mse`` (largest), ``ranks_differ`` (statistics whose ranks logged different values)."""
    rows = []
    for layer, tensor in log.tensors():
        names = log.stat_names(layer, tensor)
        its = {k[3] for k in log.stats if k[:2] == (layer, tensor)}
        amax = _amax_series(log, layer, tensor)
        under, over, scale_inv, mse, differ = {}, None, [], None, []
        for st in names:
            ser = log.series(layer, tensor, st)
            differ += [st] if any(s.ranks_differ for s in ser) else []
            worst = max(ser, key=lambda s: s.value)
            if st.endswith("underflows%") or st.endswith("underflows%_columnwise"):
                under[st] = _share(worst)
            elif "overflows%" in st:
                over = _share(worst)
            elif "scale_inv_min" in st:
                scale_inv.append(min(s.value for s in ser))
            elif "scale_inv_max" in st:
                scale_inv.append(worst.value)
            elif st.endswith("_mse") or st.endswith("_mse_columnwise"):
                mse = worst.value if mse is None else max(mse, worst.value)
        rows.append({"layer": layer, "tensor": tensor, "iterations": len(its),
                     "amax": max(h for _, _, h in amax) - 0.00005 if amax else None,
                     "underflow": under, "overflow": over,
                     "scale_inv": (min(scale_inv), max(scale_inv)) if scale_inv else None,
                     "mse": mse, "ranks_differ": differ})  # fmt: skip
    return rows


def te_log_notes(path: str, log: TeDebugLog) -> list[dict]:
    """``analyze``'s notes for a TE debug log: one line per tensor, and what cannot be said."""
    notes = [{"file": path, "name": None,
              "note": f"Transformer Engine debug log, {len(log.files)} rank file(s): statistics only (4 decimals; "
                      "no histogram, so no FP8 figures under other formats or scalings)"}]  # fmt: skip
    for r in summarize_te_log(log):
        parts = [f"{r['iterations']} iterations"]
        if r["amax"] is not None:
            parts.append(f"amax {r['amax']:.4g}")
        parts += [f"{k} worst {v}" for k, v in r["underflow"].items()]
        if r["overflow"] is not None:
            parts.append(f"delayed-scaling overflow worst {r['overflow']}")
        if r["scale_inv"] is not None:
            parts.append(f"scale_inv {r['scale_inv'][0]:.4g}..{r['scale_inv'][1]:.4g}")
        if r["mse"] is not None:
            parts.append(f"mse max {r['mse']:.4g}")
        if r["ranks_differ"]:
            parts.append(f"ranks differ in {', '.join(r['ranks_differ'])} (kept per rank, never summed)")
        notes.append({"file": path, "name": f"{r['layer']}.{r['tensor']}", "note": "; ".join(parts)})
    return notes


def replay_te_log(log: TeDebugLog, policies: Sequence[str], formats: dict[str, str] | None = None) -> list[dict]:
    """Per policy, layer and tensor: ``(iteration, scale, event)`` from the logged amaxes, in
    order (see the module docstring). ``formats``: TE tensor name -> format (default
    :data:`TE_FORMATS`). ``event`` is None where the amax's interval straddles the threshold."""
    import numpy as np

    from fp8sim.policies import parse_policy
    from fp8sim.trace import cast_thresholds

    fmts = {**TE_FORMATS, **(formats or {})}
    out = []
    for spec in policies:
        pol = parse_policy(spec)
        if pol.granularity != "tensor":
            raise ValueError(f"policy {spec!r}: {pol.granularity} scaling needs block amaxes, which TE's logs "
                             "do not hold (they log whole-tensor statistics)")  # fmt: skip
        for layer, tensor in log.tensors():
            fmt = get_format(fmts[tensor])
            thr = cast_thresholds(fmt, "rne")
            name = f"{layer}.{tensor}"
            steps = []
            for it, lo, hi in _amax_series(log, layer, tensor):
                mid = (lo + hi) / 2
                scale = float(pol.scale_for(name, fmt, current_amax=mid))
                over = [float(np.float32(np.float32(a) * np.float32(scale))) for a in (lo, hi)]
                hit = [p > thr.overflow_at or (thr.overflow_tie and p == thr.overflow_at) for p in over]
                steps.append((it, scale, hit[0] if hit[0] == hit[1] else None))
                pol.observe(name, mid, fmt)
            out.append({"policy": pol.spec, "layer": layer, "tensor": tensor, "steps": steps})
    return out


def split_te_logs(inputs) -> tuple[object, list[dict], list[str]]:
    """``(other inputs or None, notes, TE log paths)``: the Transformer Engine debug logs among
    ``analyze``'s inputs (a path whose statistics logs :func:`fp8sim.trace.te_logs.te_log_files`
    finds), read into notes, and the inputs left (None when nothing is left)."""
    import os

    from fp8sim.trace.te_logs import read_te_logs, te_log_files

    given = [inputs] if not isinstance(inputs, (list, tuple)) else list(inputs)
    rest, notes, paths = [], [], []
    for x in given:
        if isinstance(x, (str, os.PathLike)) and os.path.exists(x) and te_log_files(x):
            notes += te_log_notes(os.fspath(x), read_te_logs(x))
            paths.append(os.fspath(x))
        else:
            rest.append(x)
    if not paths:
        return inputs, [], []
    return (rest if rest else None), notes, paths
