"""Compact histograms of |x| and the rounding thresholds that make their counts exact.

The numerics behind the trace format (:mod:`fp8sim.trace` stores these histograms per tensor
and step): from a histogram, the number of values that overflow or underflow a format under any
power-of-two scale follows exactly, and under any other scale as a tight bracket.

The histogram of |x|
--------------------
Every finite nonzero value is binned by ``a = float32(|x|) = 2**e * (1 + f)``, 0 <= f < 1:
the bin is ``(e, m, inexact)`` with ``m = floor(f * 2**k)`` (the k leading mantissa bits) and
``inexact = f * 2**k != m`` (whether any lower bit is set). Bin ids
``(e - EXPONENT_MIN) * 2**(k+1) + 2*m + inexact`` increase with |x|, and bin ``(e, m, 0)`` holds
only values exactly equal to its lower edge ``2**e * (1 + m/2**k)``.

Why this is exact: for round-to-nearest the overflow threshold of a format with ``M`` mantissa bits
is ``max + ulp(max)/2``, a number with ``M + 1`` mantissa bits, and the underflow threshold
``min_subnormal / 2`` is a power of two. Multiplying by a power-of-two scale ``2**j`` moves a value
by whole binades without rounding (in float32's normal range). So with ``k >= M + 1`` both
thresholds, divided by ``2**j``, are lower edges of an exact bin: values above a threshold are
whole bins, values equal to it (the tie, decided by the rounding rule) are exactly the exact bin.
``k = 5`` (the default) covers every 8-bit format (e3m4 has the most mantissa bits, 4).

Exactness holds for every input dtype, because the cast sees ``float32(x)`` too (float64 inputs
are rounded to float32 first). Two sentinel binades hold float64 values outside float32's range:
``e = EXPONENT_MIN`` nonzero values whose float32 is 0 (they underflow under any scale),
``e = EXPONENT_MAX`` finite values whose float32 is inf (they overflow under any scale). Exactness
needs the scaled threshold values in float32's normal range: true for every 8-bit format and any
scale with ``|log2 scale| < 100``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fp8sim.formats import FloatFormat, get_format

__all__ = [
    "AbsHistogram",
    "CastThresholds",
    "cast_thresholds",
    "EXPONENT_MIN",
    "EXPONENT_MAX",
    "DEFAULT_HIST_MANTISSA_BITS",
    "COUNT_ROUNDINGS",
    "check_mantissa_bits",
    "num_bins",
    "bin_id",
]

#: the histogram's binades: EXPONENT_MIN is the "nonzero, float32(|x|) == 0" sentinel (float32's
#: smallest subnormal is 2**-149), EXPONENT_MAX the "finite, float32(|x|) == inf" sentinel
EXPONENT_MIN = -150
EXPONENT_MAX = 128
DEFAULT_HIST_MANTISSA_BITS = 5
#: float32's smallest normal and largest finite values: scaled thresholds outside that range
#: meet the product's float32 rounding (subnormal) or overflow, which bins alone cannot see
_F32_TINY = 2.0**-126
_F32_MAX = float(np.finfo(np.float32).max)
#: rounding modes for which over/underflow is a pure function of |x| (thresholds)
COUNT_ROUNDINGS = ("rne", "rna", "rtz")


# ------------------------------------------------------------------------------------------
# rounding thresholds
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CastThresholds:
    """Where a scaled magnitude ``p`` over- or underflows in one format and rounding mode.

    ``p`` overflows iff ``p > overflow_at`` or (``overflow_tie`` and ``p == overflow_at``);
    a nonzero ``p`` underflows iff ``p < underflow_at`` or (``underflow_tie`` and
    ``p == underflow_at``). ``*_e, *_m`` give the threshold as ``2**e * (1 + m/2**m_bits)``.
    """

    overflow_at: float
    overflow_tie: bool
    overflow_e: int
    overflow_m: int
    underflow_at: float
    underflow_tie: bool
    underflow_e: int
    underflow_m: int
    m_bits: int  # mantissa bits the thresholds need


def cast_thresholds(fmt: str | FloatFormat, rounding: str = "rne") -> CastThresholds:
    """Over/underflow thresholds of ``fmt`` under ``rounding`` (one of :data:`COUNT_ROUNDINGS`).

    rne: overflow above ``max + ulp/2``; the tie overflows iff max's mantissa is odd (it rounds
    to the even neighbour above). Underflow at or below ``min_subnormal/2`` (the tie goes to 0).
    rna: ties go away from zero: the overflow tie overflows, the underflow tie does not.
    rtz: overflow at or above ``max + ulp`` (what truncates above max before the clamp);
    underflow below ``min_subnormal``.

    "Rounds above max" means: rounded with the format's precision and an unbounded exponent,
    the result exceeds ``fmt.max`` -- whatever the saturation rule then makes of it.
    """
    fmt = get_format(fmt)
    if rounding not in COUNT_ROUNDINGS:
        raise ValueError(
            f"over/underflow counts from thresholds need rounding in {COUNT_ROUNDINGS}, "
            f"got {rounding!r} (directed and stochastic modes depend on more than |x|)"
        )
    if not fmt.has_zero or not fmt.signed:
        raise ValueError(f"format {fmt.name} has no zero or no sign; over/underflow undefined")
    mb = fmt.mantissa_bits
    max_m = fmt.max_code & ((1 << mb) - 1)
    if rounding == "rtz":
        # max + ulp is the first value that truncates to something above max
        e, m = (fmt.emax, 2 * (max_m + 1)) if max_m + 1 < (1 << mb) else (fmt.emax + 1, 0)
        return CastThresholds(
            fmt.max + 2.0 ** (fmt.emax - mb), True, e, m,
            fmt.min_subnormal, False, fmt.emin - mb, 0,
            mb + 1,
        )  # fmt: skip
    tie_up = (max_m & 1) == 1 if rounding == "rne" else True
    return CastThresholds(
        fmt.max + 2.0 ** (fmt.emax - mb - 1), tie_up, fmt.emax, 2 * max_m + 1,
        fmt.min_subnormal / 2, rounding == "rne", fmt.emin - mb - 1, 0,
        mb + 1,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# the bins: one definition, used by the numba kernel and the torch ops (fp8sim.trace.statistics)
# ------------------------------------------------------------------------------------------
def num_bins(k: int) -> int:
    """The number of bin ids of a histogram keeping ``k`` mantissa bits (ids are ``0..n-1``)."""
    return (EXPONENT_MAX - EXPONENT_MIN + 1) << (k + 1)


def bin_id(exponent, mantissa_top, inexact, k):
    """The bin id of ``2**exponent * (1 + f)`` whose ``k`` leading mantissa bits are
    ``mantissa_top = floor(f * 2**k)`` and ``inexact = f * 2**k != mantissa_top`` (0 or 1).

    Plain arithmetic on Python ints, numpy or torch integer arrays alike (the numba kernel
    compiles this same function); the sentinel binades are ``exponent = EXPONENT_MIN`` (nonzero,
    float32(|x|) == 0) and ``EXPONENT_MAX`` (finite, float32(|x|) == inf), with mantissa 0 and
    inexact 1."""
    return ((exponent - EXPONENT_MIN) << (k + 1)) + 2 * mantissa_top + inexact


# ------------------------------------------------------------------------------------------
# the histogram object
# ------------------------------------------------------------------------------------------
class AbsHistogram:
    """Sparse histogram of ``float32(|x|)`` over finite nonzero values (see the module docstring).

    Attributes: ``bins`` (sorted uint32 bin ids), ``counts`` (int64), ``mantissa_bits`` (k),
    ``zero``, ``nan``, ``inf`` (counts of values outside the histogram), ``numel``.
    """

    def __init__(
        self,
        bins: np.ndarray,
        counts: np.ndarray,
        mantissa_bits: int,
        *,
        zero: int = 0,
        nan: int = 0,
        inf: int = 0,
    ) -> None:
        self.bins = np.asarray(bins, dtype=np.uint32)
        self.counts = np.asarray(counts, dtype=np.int64)
        if self.bins.shape != self.counts.shape:
            raise ValueError("histogram bins and counts differ in length")
        self.mantissa_bits = int(mantissa_bits)
        self.zero, self.nan, self.inf = int(zero), int(nan), int(inf)
        self._ids = self.bins.astype(np.int64)
        self._cum = np.concatenate([[0], np.cumsum(self.counts)])

    @property
    def nonzero(self) -> int:
        """Finite nonzero values (the histogram's total)."""
        return int(self._cum[-1])

    @property
    def numel(self) -> int:
        return self.nonzero + self.zero + self.nan + self.inf

    def _count_below(self, bin_id: int) -> int:
        """Values in bins with id < bin_id."""
        return int(self._cum[np.searchsorted(self._ids, bin_id, side="left")])

    def _bin_id(self, e: int, m_top: int, m_bits: int) -> int:
        """Exact bin of ``2**e * (1 + m_top/2**m_bits)``; needs m_bits <= k."""
        return bin_id(e, m_top << (self.mantissa_bits - m_bits), 0, self.mantissa_bits)

    def _check(self, thr: CastThresholds, fmt: FloatFormat) -> None:
        if thr.m_bits > self.mantissa_bits:
            raise ValueError(
                f"exact counts for {fmt.name} need a histogram with >= {thr.m_bits} mantissa bits; "
                f"this one keeps {self.mantissa_bits}"
            )

    def overflow(self, fmt: str | FloatFormat, scale_exp: int, rounding: str = "rne") -> int:
        """Exact count of values overflowing ``fmt`` when scaled by ``2**scale_exp``."""
        fmt = get_format(fmt)
        thr = cast_thresholds(fmt, rounding)
        self._check(thr, fmt)
        edge = self._bin_id(thr.overflow_e - int(scale_exp), thr.overflow_m, thr.m_bits)
        return self.nonzero - self._count_below(edge if thr.overflow_tie else edge + 1)

    def underflow(self, fmt: str | FloatFormat, scale_exp: int, rounding: str = "rne") -> int:
        """Exact count of nonzero values rounding to zero in ``fmt`` when scaled by ``2**scale_exp``."""
        fmt = get_format(fmt)
        thr = cast_thresholds(fmt, rounding)
        self._check(thr, fmt)
        edge = self._bin_id(thr.underflow_e - int(scale_exp), thr.underflow_m, thr.m_bits)
        return self._count_below(edge + 1 if thr.underflow_tie else edge)

    def _value_bin(self, v: float) -> int:
        """The bin id holding float64 ``v > 0`` (finite): ids below it hold only smaller values,
        ids above it only larger ones."""
        fr, ex = math.frexp(v)
        f = (2.0 * fr - 1.0) * 2.0**self.mantissa_bits
        m = int(f)
        return bin_id(ex - 1, m, int(f != m), self.mantissa_bits)

    def _bin_counted(self, bin_id: int, threshold: float, inclusive: bool, s32: np.float32) -> int:
        """For one bin: 1 if every value v in it has ``p = float32(v * s) > threshold`` (``>=``
        with ``inclusive``), 0 if none has, -1 if that depends on where in the bin v lies.
        Exact: an exact bin is one value; an open bin's values are the float32s strictly between
        its edges, and p is non-decreasing in v, so its smallest and largest decide."""
        k = self.mantissa_bits
        e = (bin_id >> (k + 1)) + EXPONENT_MIN
        if e == EXPONENT_MIN:  # float32(|x|) == 0: p = 0
            return 0
        if e == EXPONENT_MAX:  # float32(|x|) == inf: p = inf
            return 1
        m2 = bin_id & ((1 << (k + 1)) - 1)
        edge = np.float32(math.ldexp(1.0 + (m2 >> 1) / 2.0**k, e))
        if m2 & 1 == 0:
            vals = (edge,)
        else:
            nxt = np.float32(math.ldexp(1.0 + ((m2 >> 1) + 1) / 2.0**k, e))
            vals = (np.nextafter(edge, np.float32(np.inf)), np.nextafter(nxt, np.float32(0)))
        with np.errstate(over="ignore"):
            hit = [float(v * s32) >= threshold if inclusive else float(v * s32) > threshold
                   for v in vals]  # fmt: skip
        return 1 if all(hit) else (0 if not any(hit) else -1)

    def _scaled_above(self, threshold: float, scale: float, inclusive: bool) -> tuple[int, int]:
        """(lower, upper) bound of the count of values with ``p = float32(float32(|x|) *
        float32(scale)) > threshold`` (``>=`` with ``inclusive``), for a positive finite scale
        and threshold. The float32 product is within ``d = max(threshold * 2**-20, 2**-148)`` of
        the exact one near the threshold, so only bins that meet ``[(threshold - d) / scale,
        (threshold + d) / scale]`` can go either way; each of those is decided by
        :meth:`_bin_counted`. The bounds differ only by the values of open bins that straddle
        the threshold, and are equal whenever no value lies in such a bin."""
        s32 = np.float32(scale)
        s = float(s32)
        if threshold > _F32_MAX:  # only a product that overflows to inf is above it
            threshold, inclusive = _F32_MAX, False
        d = max(threshold * 2.0**-20, 2.0**-148)
        lo_t, hi_t = (threshold - d) / s, (threshold + d) / s
        first = 1 << (self.mantissa_bits + 1)  # the first id above the float32-zero sentinel
        top = (EXPONENT_MAX - EXPONENT_MIN) << (self.mantissa_bits + 1)  # the float32-inf one
        if not lo_t < math.inf:  # only float32 infs reach the threshold
            n = self.nonzero - self._count_below(top)
            return n, n
        b_lo = max(first, self._value_bin(lo_t)) if lo_t > 0 else first
        b_hi = min(top - 1, self._value_bin(hi_t)) if hi_t < math.inf else top - 1
        # bins above the window: values above hi_t (or float32 infs), all counted
        sure = self.nonzero - self._count_below(max(b_hi + 1, first))
        i0 = int(np.searchsorted(self._ids, b_lo, side="left"))
        i1 = int(np.searchsorted(self._ids, b_hi, side="right"))
        maybe = 0
        for i in range(i0, i1):
            c = self._bin_counted(int(self._ids[i]), threshold, inclusive, s32)
            if c == 1:
                sure += int(self.counts[i])
            elif c == -1:
                maybe += int(self.counts[i])
        return sure, sure + maybe

    def overflow_bounds(
        self, fmt: str | FloatFormat, scale: float, rounding: str = "rne"
    ) -> tuple[int, int]:
        """(lower, upper) bound of the overflow count under any positive ``scale``.

        Equal (exact) when ``scale`` is a power of two (and the histogram keeps the mantissa
        bits the format's thresholds need; a coarser one gives a bracket), and whenever no value
        lies in an open bin whose scaled values straddle the threshold (see
        :meth:`_scaled_above`: the float32 rounding of the product, ties included, is taken into
        account).
        """
        fmt = get_format(fmt)
        j = _pow2_exponent(scale)
        thr = cast_thresholds(fmt, rounding)
        bins_exact = thr.m_bits <= self.mantissa_bits and thr.overflow_at >= _F32_TINY
        if j is not None and abs(j) < 100 and bins_exact:  # exact by bins (module docstring)
            n = self.overflow(fmt, j, rounding)
            return n, n
        if not (0 < float(np.float32(scale)) < math.inf):
            return 0, 0
        return self._scaled_above(thr.overflow_at, scale, thr.overflow_tie)

    def underflow_bounds(
        self, fmt: str | FloatFormat, scale: float, rounding: str = "rne"
    ) -> tuple[int, int]:
        """(lower, upper) bound of the underflow count under any positive ``scale`` (as
        :meth:`overflow_bounds`)."""
        fmt = get_format(fmt)
        j = _pow2_exponent(scale)
        thr = cast_thresholds(fmt, rounding)
        bins_exact = thr.m_bits <= self.mantissa_bits and thr.underflow_at >= _F32_TINY
        if j is not None and abs(j) < 100 and bins_exact:  # exact by bins (module docstring)
            n = self.underflow(fmt, j, rounding)
            return n, n
        if not (0 < float(np.float32(scale)) < math.inf):
            return self.nonzero, self.nonzero
        # a nonzero p underflows iff it is not above the threshold (the tie as the rule says)
        lo, hi = self._scaled_above(thr.underflow_at, scale, not thr.underflow_tie)
        return self.nonzero - hi, self.nonzero - lo

    def count_scaled_above(
        self, threshold: float, scale: float, *, inclusive: bool = False
    ) -> tuple[int, int]:
        """(lower, upper) bound of the number of values with ``float32(|x| * scale) >
        threshold`` (``>=`` if ``inclusive``); exact (equal bounds) unless values lie in an open
        bin that straddles ``threshold / scale`` (see :meth:`_scaled_above`)."""
        s = float(np.float32(scale))
        if not (s > 0 and threshold > 0):
            return (self.nonzero, self.nonzero) if threshold <= 0 < s else (0, 0)
        return self._scaled_above(float(threshold), s, inclusive)

    def binades(self) -> tuple[np.ndarray, np.ndarray]:
        """(exponents e, counts) of values with ``floor(log2 float32(|x|)) == e``, e ascending.

        The sentinel binades appear as EXPONENT_MIN / EXPONENT_MAX.
        """
        e = (self._ids >> (self.mantissa_bits + 1)) + EXPONENT_MIN
        if e.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        uniq, inv = np.unique(e, return_inverse=True)
        return uniq, np.bincount(inv, weights=self.counts, minlength=uniq.size).astype(np.int64)

    def max_value(self) -> float:
        """Upper edge of the highest occupied bin (>= max finite |x|); 0.0 if empty."""
        if self._ids.size == 0:
            return 0.0
        k = self.mantissa_bits
        top = int(self._ids[-1])
        e = (top >> (k + 1)) + EXPONENT_MIN
        m = (top >> 1) & ((1 << k) - 1)
        return float(2.0**e * (1 + (m + (top & 1)) / 2.0**k))

    def __repr__(self) -> str:
        return (
            f"AbsHistogram(nonzero={self.nonzero}, zero={self.zero}, nan={self.nan}, "
            f"inf={self.inf}, bins={self.bins.size}, k={self.mantissa_bits})"
        )


def _pow2_exponent(scale: float) -> int | None:
    """j if float32(scale) == 2**j exactly, else None."""
    s = float(np.float32(scale))
    if not (s > 0 and math.isfinite(s)):
        return None
    fr, ex = math.frexp(s)
    return ex - 1 if fr == 0.5 else None


def check_mantissa_bits(k: int) -> None:
    """ValueError unless ``k``, the mantissa bits a histogram keeps, is an int in 0..10."""
    if not (isinstance(k, (int, np.integer)) and 0 <= k <= 10):
        raise ValueError(f"hist_mantissa_bits must be an int in 0..10, got {k!r}")
