"""Replay scaling policies over a recorded trace: what each policy would have done, step by step
(the columns; :func:`fp8sim.analysis.replay` wraps them in a result).

For every policy (a spec, parsed by :func:`fp8sim.scaling_config.parse_scaling`, fresh state) the
trace's records are fed in order (steps ascending; within a step in recording order) to the same
:class:`~fp8sim.quantizer.Quantizer` that casts in training. Per record:

1. ``scale = quantizer.scale_for(name, amax)`` (the recorded amax);
2. from the record's |x| histogram, the overflow and underflow counts of the cast
   ``encode(float32(float32(x) * scale))`` under the trace's rounding -- exact when ``scale`` is a
   power of two, else a (lower, upper) bracket (the histogram bin that straddles the threshold);
   an *overflow event* when the amax itself rounds above ``fmt.max`` after scaling (exact);
3. ``quantizer.observe(name, amax, numel=..., n_at_max=..., overflow=...)``, where ``n_at_max``
   counts values that land on ``+-fmt.max`` in the saturating cast, infs included (the FP8-LM
   auto-scaling signal, as ``policy.quantize`` counts it; for a non-power-of-two scale the
   midpoint of its bracket).

The trace's own scales (what the run did) appear as the pseudo-policy ``recorded``, with the
recorder's exact counts. Shares: overflow of the finite values, underflow of the nonzero finite
values.

Block-scaled policies (``nvfp4...``, ``mx``, ``mx:rceil``, ``current:gran=block:RxC`` -- with
``pow2`` Transformer Engine's Float8BlockScaling -- and ``current:gran=row|col``) need each
group's amax, which a per-tensor record does not hold: they are replayed only at the records
whose full tensor the trace saved (``--save-every``), and the others are counted as ``skipped``.
There the counts are exact, those of :func:`fp8sim.analysis.stats.tensor_stats` for the
policy's cast of the saved tensor (round to nearest even, saturating: what ``fp8sim analyze
--scaling ...`` reports): ``overflow`` the values whose scaled magnitude rounds above the
format's max, ``underflow`` the nonzero finite values that become 0; ``event`` is ``overflow >
0`` (some group's amax overflowed); ``scale`` the multiplier of the group holding the tensor
amax (``quantizer.scale_for``). NVFP4 policies cast to E2M1 whatever the recorded format, with the
E4M3 block scales and the tensor scale of :mod:`fp8sim.nvfp4` (compressed-tensors' variant,
whose cast divides, is not replayed: ``analyze`` does not count it either). ``mx`` and block
``current`` policies keep the recorded format and need a round-to-nearest-even trace.
``mx`` (the OCP ``floor`` rule) is also replayed exactly without a saved tensor at the records
that hold a block-relative histogram (an MX-cast model's records, or ``record(...,
block_stats="mx")``; :func:`fp8sim.trace.block_stats.mx_floor_counts`), except records with a
NaN/inf block or a block whose amax is below ``2**-112``, which need the saved tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from fp8sim.formats import get_format
from fp8sim.trace import TraceReader, cast_thresholds

__all__ = ["PolicyReplay", "replay_policies", "RECORDED", "summary_rows", "needs_full_tensors"]

#: name of the pseudo-policy made of the trace's own scales and counts
RECORDED = "recorded"

_COLS = (
    "step", "tensor", "scale", "exact", "overflow_lo", "overflow_hi", "underflow_lo",
    "underflow_hi", "event", "finite", "nonzero",
)  # fmt: skip


@dataclass
class PolicyReplay:
    """One policy's replay: columns per record (numpy arrays, record order) and its summary.

    Columns: ``step``, ``tensor`` (index into ``names``), ``scale``, ``exact`` (pow2 scale: counts
    exact), ``overflow_lo/hi``, ``underflow_lo/hi`` (equal when exact), ``event`` (the amax
    overflowed), ``finite``, ``nonzero`` (share denominators). ``skipped``: records left out (a
    block-scaled policy at a record without a saved full tensor).
    """

    policy: str
    names: list[str]
    cols: dict[str, np.ndarray] = field(default_factory=dict)
    skipped: int = 0

    @property
    def overflow(self) -> np.ndarray:
        """Best estimate of overflow per record (exact when ``exact``; else bracket midpoint)."""
        return (self.cols["overflow_lo"] + self.cols["overflow_hi"]) / 2.0

    @property
    def underflow(self) -> np.ndarray:
        return (self.cols["underflow_lo"] + self.cols["underflow_hi"]) / 2.0

    @property
    def overflow_share(self) -> np.ndarray:
        return _share(self.overflow, self.cols["finite"])

    @property
    def underflow_share(self) -> np.ndarray:
        return _share(self.underflow, self.cols["nonzero"])

    def summary(self) -> dict:
        """events, overflow total, the worst record (tensor, step) by overflow share then
        underflow share, median and worst underflow share (percent), share of exact records."""
        c = self.cols
        n = int(c["step"].size)
        out: dict = {"policy": self.policy, "records": n, "skipped": self.skipped}
        if n == 0:
            return out | {"events": 0, "overflow": 0, "worst_tensor": None, "worst_step": None,
                          "median_underflow_pct": 0.0, "worst_underflow_pct": 0.0,
                          "exact_pct": 100.0}  # fmt: skip
        ov, us = self.overflow_share, self.underflow_share
        worst = int(np.lexsort((us, ov))[-1])
        wu = int(np.argmax(us))
        out.update(
            events=int(c["event"].sum()),
            overflow=float(self.overflow.sum()),
            overflow_bounds=[int(c["overflow_lo"].sum()), int(c["overflow_hi"].sum())],
            worst_tensor=self.names[int(c["tensor"][worst])],
            worst_step=int(c["step"][worst]),
            worst_overflow_pct=100.0 * float(ov[worst]),
            median_underflow_pct=100.0 * float(np.median(us)),
            worst_underflow_pct=100.0 * float(us[wu]),
            worst_underflow_tensor=self.names[int(c["tensor"][wu])],
            worst_underflow_step=int(c["step"][wu]),
            exact_pct=100.0 * float(c["exact"].mean()),
        )
        return out

    def grid(self, what: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, matrix tensors x steps) of ``overflow_share`` / ``underflow_share`` (NaN where
        a tensor has no record at a step)."""
        steps = np.unique(self.cols["step"])
        mat = np.full((len(self.names), steps.size), np.nan)
        vals = getattr(self, what)
        mat[self.cols["tensor"], np.searchsorted(steps, self.cols["step"])] = vals
        return steps, mat


def _share(count: np.ndarray, total: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, count / np.maximum(total, 1), 0.0)


def _event(amax: float, scale: float, fmt, rounding: str) -> bool:
    """Whether ``float32(float32(amax) * scale)`` rounds above fmt.max (exact)."""
    if not math.isfinite(amax):
        return False
    p = float(np.float32(np.float32(amax) * np.float32(scale)))
    thr = cast_thresholds(fmt, rounding)
    return p > thr.overflow_at or (thr.overflow_tie and p == thr.overflow_at)


def _at_max(hist, fmt, scale: float) -> tuple[int, int]:
    """Bracket of values that land on +-max in the saturating RNE cast: those rounding to max
    or above. The boundary is ``max - ulp/2``; its tie goes to max iff max's mantissa is even."""
    mb = fmt.mantissa_bits
    half_ulp = 2.0 ** (fmt.emax - mb - 1)
    even = (fmt.max_code & ((1 << mb) - 1)) % 2 == 0
    return hist.count_scaled_above(fmt.max - half_ulp, scale, inclusive=even)


class _Replayed:
    """One policy spec under replay: its typed config and granularity, one policy state shared
    by a :class:`~fp8sim.quantizer.Quantizer` per recorded format (the scale decisions)."""

    def __init__(self, spec: str) -> None:
        from fp8sim.policies import build_policy
        from fp8sim.scaling_config import parse_scaling, scaling_spec

        self.config, self.granularity = parse_scaling(spec)
        self.spec = scaling_spec(self.config, self.granularity)
        self.policy = build_policy(self.config)
        self._quantizers: dict[str, object] = {}

    def quantizer(self, fmt):
        """The quantizer of a recorded format (NVFP4 decides for E2M1 whatever the format)."""
        from fp8sim.quantizer import Quantizer
        from fp8sim.recipes import CastConfig

        if fmt.name not in self._quantizers:
            cast_fmt = get_format("e2m1") if self.granularity.kind == "nvfp4" else fmt
            self._quantizers[fmt.name] = Quantizer(CastConfig(cast_fmt, self.config, self.granularity),
                                                   policy=self.policy)
        return self._quantizers[fmt.name]


def needs_full_tensors(policy) -> bool:
    """Whether a policy spec scales per group (block, MX, NVFP4, row, col), so that it is
    replayed from the trace's saved full tensors only."""
    from fp8sim.scaling_config import parse_scaling

    if not isinstance(policy, str):
        return policy.granularity != "tensor"  # a policy object (its spec's granularity)
    return parse_scaling(policy)[1].kind != "tensor"


def _block_variant(pol: _Replayed, spec: str, rounding: str) -> Callable:
    """A function ``fmt -> analysis Variant`` of a block-scaled policy's cast (the recorded
    format, or E2M1 for NVFP4), after checking it can be replayed (ValueError otherwise)."""
    from fp8sim.analysis.stats import parse_variants

    g = pol.granularity
    margin, pow2 = 0.0, False
    if g.kind == "nvfp4":
        if g.variant == "compressed-tensors":
            raise ValueError(f"policy {spec!r}: the compressed-tensors NVFP4 variant is not replayed "
                             "(its cast divides; replay counts te, torchao, torchao-block)")  # fmt: skip
    elif rounding != "rne":
        raise ValueError(f"policy {spec!r}: block-scaled policies are replayed with round to "
                         f"nearest even; this trace rounds {rounding}")  # fmt: skip
    elif g.kind != "mx":  # current with row, col or block:RxC
        c = pol.config
        if getattr(c, "epsilon", 0.0) != 0.0:
            raise ValueError(f"policy {spec!r}: epsilon is not replayed for {g.spec} scaling "
                             "(give epsilon=0)")  # fmt: skip
        if c.NAME != "current":
            raise ValueError(f"policy {spec!r}: {c.NAME} scaling per {g.spec} is not replayed (current only)")
        margin, pow2 = float(c.margin), bool(c.pow2)
    cache: dict[str, object] = {}

    def variant(fmt) -> object:
        if fmt.name not in cache:  # NVFP4: e2m1 whatever fmt is
            cache[fmt.name] = parse_variants([fmt.name], [g.spec], margin=margin, pow2=pow2)[0]
        return cache[fmt.name]

    return variant


def _from_block_stats(pol: _Replayed) -> bool:
    """Whether ``pol`` (MX with the OCP ``floor`` rule) replays exactly from a record's
    block-relative histogram (:func:`fp8sim.trace.block_stats.mx_floor_counts`)."""
    from fp8sim.granularity import E8M0Rule

    g = pol.granularity
    return g.kind == "mx" and g.mx_rule == E8M0Rule.FLOOR


def _relative_exact(rec, fmt) -> bool:
    """Whether ``rec`` holds a block-relative histogram from which the MX floor rule's counts in
    ``fmt`` are exact: no block whose values are lost (NaN/inf), none too small to judge, and an
    element format whose emax the histogram covers."""
    b = rec.blocks
    return (b is not None and b.rel is not None and b.nan_blocks == 0 and b.rel_unsafe == 0
            and fmt.emax <= 15)  # fmt: skip


def _any_relative(reader: TraceReader) -> bool:
    """Whether some record of ``reader`` holds a block-relative histogram (an MX cast's)."""
    return any(r.blocks is not None and r.blocks.rel is not None for r in reader.records())


def replay_policies(
    trace: TraceReader | str,
    specs: Sequence[str],
    *,
    include_recorded: bool = True,
    progress: Callable[[int], None] | None = None,
) -> list[PolicyReplay]:
    """Replay each policy spec over ``trace`` (see the module docstring). Returns one
    :class:`PolicyReplay` per distinct policy (``current`` and ``current:margin=0`` are one),
    plus ``recorded`` first when ``include_recorded``.

    Block-scaled policies (:func:`needs_full_tensors`) are replayed at the records whose full
    tensor the trace saved, the others counted in ``skipped``. Raises ValueError for a bad spec,
    and for a block-scaled policy over a trace that saved no full tensor (or that it cannot
    replay: see the module docstring). ``progress(n)`` is called per record and policy.
    """
    from fp8sim.analysis.stats import tensor_stats

    reader = trace if isinstance(trace, TraceReader) else TraceReader(trace)
    rounding = reader.rounding
    policies = []
    for spec in specs:
        pol = _Replayed(spec)
        if all(pol.spec != p.spec for _, p, _ in policies):  # the same policy spelled twice: once
            block = _block_variant(pol, spec, rounding) if pol.granularity.kind != "tensor" else None
            policies.append((spec, pol, block))
    saved = set(reader.saved_tensors()) if any(b for _, _, b in policies) else set()
    for spec, pol, block in policies:
        if block is not None and not saved and not (_from_block_stats(pol) and _any_relative(reader)):
            raise ValueError(
                f"policy {spec!r}: {pol.granularity.spec} scaling needs per-block amaxes, which a "
                "per-tensor record does not hold, and this trace saved no full tensor to replay "
                "it from (record with --save-every K)"
            )
    names = [t.name for t in reader.tensors]
    outs = []
    if include_recorded:
        outs.append((RECORDED, None, None, {c: [] for c in _COLS}))
    outs += [(spec, pol, block, {c: [] for c in _COLS}) for spec, pol, block in policies]
    skipped = [0] * len(outs)
    fmts: dict[str, object] = {}

    for rec in reader.records():
        if rec.numel == 0:  # an idle MoE expert's step: nothing was cast, no policy observed it
            continue
        fmt = fmts.get(rec.format) or fmts.setdefault(rec.format, get_format(rec.format))
        finite = rec.numel - rec.nan - rec.inf
        nonzero = finite - rec.zero
        tid = reader.tensor(rec.name).index
        full = None  # the saved tensor's figures under every block policy, computed once
        if (rec.step, rec.name) in saved:
            blocks = [(k, block(fmt)) for k, (_, _, block, _) in enumerate(outs) if block]
            if blocks:
                st = tensor_stats(reader.load_tensor(rec.step, rec.name), [v for _, v in blocks])
                full = (st, {k: vs for (k, _), vs in zip(blocks, st.variants)})
        for k, (spec, pol, block, cols) in enumerate(outs):
            if pol is None:
                scale = rec.scale
                ov = (rec.overflow, rec.overflow)
                un = (rec.underflow, rec.underflow)
                exact = True
                row = (finite, nonzero, _event(rec.amax, scale, fmt, rounding))
            elif block is not None and full is None and _from_block_stats(pol) and _relative_exact(rec, fmt):
                from fp8sim.trace.block_stats import mx_floor_counts

                q = pol.quantizer(fmt)
                scale = q.scale_for(rec.name, rec.amax)
                over, under, _ = mx_floor_counts(rec.blocks, fmt, reader.hist_mantissa_bits)
                ov, un, exact = (over, over), (under, under), True
                q.observe(rec.name, rec.amax, numel=rec.numel)
                row = (finite, nonzero, over > 0)
            elif block is not None:
                if full is None:
                    skipped[k] += 1
                    if progress is not None:
                        progress(1)
                    continue
                st, vs = full[0], full[1][k]
                q = pol.quantizer(fmt)
                scale = q.scale_for(rec.name, rec.amax)
                ov, un, exact = (vs.overflow, vs.overflow), (vs.underflow, vs.underflow), True
                q.observe(rec.name, rec.amax, numel=st.numel)
                row = (st.finite, st.nonzero, vs.overflow > 0)
            else:
                q = pol.quantizer(fmt)
                scale = q.scale_for(rec.name, rec.amax)
                ov = rec.hist.overflow_bounds(fmt, scale, rounding)
                un = rec.hist.underflow_bounds(fmt, scale, rounding)
                exact = ov[0] == ov[1] and un[0] == un[1]
                am = _at_max(rec.hist, fmt, scale)
                q.observe(
                    rec.name, rec.amax, numel=rec.numel,
                    n_at_max=int(round(sum(am) / 2)) + rec.inf,  # +-inf saturate to +-max
                    overflow=int(round(sum(ov) / 2)),
                )  # fmt: skip
                row = (finite, nonzero, _event(rec.amax, scale, fmt, rounding))
            for c, v in zip(
                _COLS,
                (rec.step, tid, scale, exact, ov[0], ov[1], un[0], un[1], row[2], row[0], row[1]),
            ):  # fmt: skip
                cols[c].append(v)
            if progress is not None:
                progress(1)
    result = []
    dtypes = (np.int64, np.int32, np.float64, bool, np.int64, np.int64, np.int64, np.int64,
              bool, np.int64, np.int64)  # fmt: skip
    for k, (spec, pol, _, cols) in enumerate(outs):
        arrays = {c: np.asarray(cols[c], dtype=dt) for c, dt in zip(_COLS, dtypes)}
        result.append(PolicyReplay(spec if pol is None else pol.spec, names, arrays, skipped[k]))
    return result


def summary_rows(replays: Sequence[PolicyReplay]) -> list[dict]:
    """The side-by-side summary: one dict per policy (see :meth:`PolicyReplay.summary`)."""
    return [r.summary() for r in replays]
