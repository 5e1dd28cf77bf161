"""One pass over a tensor for the trace: its |x| histogram, zero/NaN/inf counts, max finite |x|
and the overflow/underflow counts of a scaled cast -- computed where the tensor lives.

Two engines give bit-identical results (``tests/test_trace_statistics.py`` checks them on the
same inputs, edge values included); the bins are defined once, by
:func:`fp8sim.trace.histogram.bin_id`:

* ``numba``: one parallel pass over a host array (numpy, or a CPU tensor);
* ``torch``: torch ops (``frexp`` + ``bincount``) on the tensor's own device. Nothing is copied to
  the host: :func:`device_statistics` returns one small int64 tensor on that device
  (:data:`STAT_FIELDS` after the dense histogram), which the caller moves when it likes
  (a CUDA caller batches a step's results into one non-blocking copy).

:func:`histogram_and_counts` picks the engine by device: ``torch`` for an accelerator's tensor,
``numba`` for host data (measured faster on CPU: see the commit that chose it).

Semantics of the counts (both engines): ``a = float32(|x|)`` (float64 inputs are rounded to
float32 first, as the cast sees them); NaN, +-inf and +-0 are counted apart and left out of the
histogram; ``q = float32(a * float32(scale))``; a finite nonzero value overflows iff ``q`` is above
the format's overflow threshold (or equal and the tie overflows), else underflows iff below the
underflow threshold (or equal and the tie underflows) -- :func:`fp8sim.trace.cast_thresholds`.
``amax`` is the largest finite |x| in the input's precision (0.0 when there is none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from fp8sim._numba.jit import jit_inline, jit_kernel
from fp8sim.emulator import as_float_array
from fp8sim.formats import FloatFormat, get_format
from fp8sim.trace.histogram import (
    DEFAULT_HIST_MANTISSA_BITS,
    EXPONENT_MAX,
    EXPONENT_MIN,
    AbsHistogram,
    bin_id,
    cast_thresholds,
    check_mantissa_bits,
    num_bins,
)

__all__ = ["HistogramCounts", "histogram_and_counts", "abs_histogram", "device_statistics", "unpack_statistics",
           "STAT_FIELDS", "ENGINES"]  # fmt: skip

#: the engines; ``auto`` is torch for a tensor on an accelerator, numba for host data
ENGINES = ("auto", "numba", "torch")
#: what follows the dense histogram in :func:`device_statistics`'s result, in order (``amax``: the
#: float64 bits of max finite |x|)
STAT_FIELDS = ("nan", "inf", "zero", "overflow", "underflow", "amax")
#: elements the torch engine processes at a time (bounds its temporaries to ~40 bytes each)
_TORCH_CHUNK = 1 << 24


@dataclass
class HistogramCounts:
    """What one pass over a tensor gives: its sparse |x| histogram and its counts."""

    bins: np.ndarray  # uint32, sorted
    counts: np.ndarray  # int64
    numel: int
    zero: int
    nan: int
    inf: int
    overflow: int
    underflow: int
    amax: float  # max finite |x| (0.0 if none)


# ------------------------------------------------------------------------------------------
# numba: host arrays
# ------------------------------------------------------------------------------------------
_bin_id = jit_inline(bin_id)


@jit_inline
def _store_counts(stats, p, zero, nan, inf, over, under):
    """Part ``p``'s counts into row ``p`` of the kernels' ``stats`` (zero, nan, inf, overflow,
    underflow)."""
    stats[p, 0] = zero
    stats[p, 1] = nan
    stats[p, 2] = inf
    stats[p, 3] = over
    stats[p, 4] = under


@jit_kernel
def _abs_hist_kernel(x, scale, ov_at, ov_tie, un_at, un_tie, k, n_bins, n_parts):
    """One pass over flat ``x`` (float32 or float64): per part a dense |x| histogram, and counts.

    Returns (hist (n_parts, n_bins) int64, stats (n_parts, 5) int64 = zero, nan, inf, overflow,
    underflow, amax (n_parts,) float64 over finite values).
    """
    n = x.size
    hist = np.zeros((n_parts, n_bins), np.int64)
    stats = np.zeros((n_parts, 5), np.int64)
    amax = np.zeros(n_parts, np.float64)
    per = (n + n_parts - 1) // n_parts
    scale_k = 2.0**k
    lo_id = _bin_id(EXPONENT_MIN, 0, 1, k)
    hi_id = _bin_id(EXPONENT_MAX, 0, 1, k)
    for p in numba.prange(n_parts):
        start = p * per
        stop = min(n, start + per)
        zero = 0
        nan = 0
        inf = 0
        over = 0
        under = 0
        mx = 0.0
        for i in range(start, stop):
            v = np.float64(x[i])
            if v != v:
                nan += 1
                continue
            a = abs(v)
            if a == np.inf:
                inf += 1
                continue
            if a == 0.0:
                zero += 1
                continue
            if a > mx:
                mx = a
            a32 = np.float64(np.float32(a))
            if a32 == 0.0:
                b = lo_id
            elif a32 == np.inf:
                b = hi_id
            else:
                fr, ex = math.frexp(a32)  # a32 = fr * 2**ex, 0.5 <= fr < 1
                f = (2.0 * fr - 1.0) * scale_k
                m = int(f)
                b = _bin_id(ex - 1, m, 1 if f != m else 0, k)
            hist[p, b] += 1
            q = np.float64(np.float32(a32 * scale))  # float32(float32(x) * scale)
            if q > ov_at or (ov_tie and q == ov_at):
                over += 1
            elif q < un_at or (un_tie and q == un_at):
                under += 1
        _store_counts(stats, p, zero, nan, inf, over, under)
        amax[p] = mx
    return hist, stats, amax


@jit_kernel
def _abs_hist_kernel_f32(x, u, over_from, under_to, k, n_bins, n_parts):
    """:func:`_abs_hist_kernel` for float32 ``x`` (``u``: the same memory as uint32), from the
    bits: the bin from the exponent and mantissa fields (a subnormal normalized first), and the
    overflow / underflow tests as integer compares of ``|x|``'s bits -- ``float32(|x| * scale)``
    is monotone in ``|x|``, so a finite nonzero ``|x|`` overflows iff its bits are ``>=
    over_from`` and underflows iff they are ``<= under_to`` (:func:`_cast_bit_bounds`).

    Returns (hist, stats, amax) as :func:`_abs_hist_kernel` does."""
    n = u.size
    hist = np.zeros((n_parts, n_bins), np.int64)
    stats = np.zeros((n_parts, 5), np.int64)
    amax = np.zeros(n_parts, np.float64)
    per = (n + n_parts - 1) // n_parts
    shift = 23 - k
    low = (1 << shift) - 1
    for p in numba.prange(n_parts):
        start = p * per
        stop = min(n, start + per)
        zero = 0
        nan = 0
        inf = 0
        over = 0
        under = 0
        top = 0  # the largest finite |x| seen, as bits (monotone for nonnegative floats)
        at = -1
        for i in range(start, stop):
            a = np.int64(u[i]) & 0x7FFFFFFF
            if a >= 0x7F800000:
                if a == 0x7F800000:
                    inf += 1
                else:
                    nan += 1
                continue
            if a == 0:
                zero += 1
                continue
            if a > top:
                top = a
                at = i
            e = a >> 23
            if e != 0:  # normal: 2**(e - 127) * 1.m
                m = a & 0x7FFFFF
                e -= 127
            else:  # subnormal: m * 2**-149, the leading one moved out
                lead = 22
                while (a >> lead) == 0:
                    lead -= 1
                m = (a - (np.int64(1) << lead)) << (23 - lead)
                e = lead - 149
            hist[p, _bin_id(e, m >> shift, 1 if (m & low) != 0 else 0, k)] += 1
            if a >= over_from:
                over += 1
            elif a <= under_to:
                under += 1
        _store_counts(stats, p, zero, nan, inf, over, under)
        amax[p] = abs(np.float64(x[at])) if at >= 0 else 0.0
    return hist, stats, amax


def _cast_bit_bounds(scale32: float, thr) -> tuple[int, int]:
    """``(over_from, under_to)``: the bits of the smallest finite positive float32 ``a`` whose
    ``float32(a * scale32)`` overflows (``0x7F800000`` if none does), and of the largest whose
    product underflows (0 if none does), by bisection over the ordered bit patterns."""

    def product(bits: int) -> float:
        a = np.array([bits], np.uint32).view(np.float32)[0]
        with np.errstate(over="ignore", under="ignore"):
            return float(np.float32(np.float64(a) * scale32))

    def overflows(bits: int) -> bool:
        q = product(bits)
        return q > thr.overflow_at or (thr.overflow_tie and q == thr.overflow_at)

    def underflows(bits: int) -> bool:
        q = product(bits)
        return q < thr.underflow_at or (thr.underflow_tie and q == thr.underflow_at)

    lo, hi = 1, 0x7F800000  # overflows(hi) taken true: the first that does lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if overflows(mid):
            hi = mid
        else:
            lo = mid + 1
    over_from = lo
    lo, hi = 0, 0x7F7FFFFF  # underflows(lo) taken true: the last that does lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if underflows(mid):
            lo = mid
        else:
            hi = mid - 1
    return over_from, lo


def _host_array(x: Any) -> np.ndarray:
    """Flat float32/float64 array of ``x`` (numpy, or a CPU torch tensor), no rounding."""
    return np.ascontiguousarray(as_float_array(x, "x")[0]).reshape(-1)


def _numba_counts(x: Any, fmt: FloatFormat, scale: float, rounding: str, k: int) -> HistogramCounts:
    a = _host_array(x)
    thr = cast_thresholds(fmt, rounding)
    n_parts = max(1, min(numba.get_num_threads(), a.size // (1 << 16)))
    scale32 = float(np.float32(scale))
    if a.dtype == np.float32:
        over_from, under_to = _cast_bit_bounds(scale32, thr)
        hist, stats, amax = _abs_hist_kernel_f32(a, a.view(np.uint32), over_from, under_to, k, num_bins(k), n_parts)
    else:
        hist, stats, amax = _abs_hist_kernel(
            a, scale32, thr.overflow_at, thr.overflow_tie,
            thr.underflow_at, thr.underflow_tie, k, num_bins(k), n_parts,
        )  # fmt: skip
    dense = hist.sum(axis=0)
    nz = np.flatnonzero(dense)
    s = stats.sum(axis=0)
    return HistogramCounts(
        nz.astype(np.uint32), dense[nz], int(a.size), int(s[0]), int(s[1]), int(s[2]),
        int(s[3]), int(s[4]), float(amax.max()) if amax.size else 0.0,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# torch: any device
# ------------------------------------------------------------------------------------------
def device_statistics(x: Any, fmt: FloatFormat, scale: float, rounding: str, k: int) -> Any:
    """The statistics of torch tensor ``x`` computed with torch ops on ``x``'s device, as one
    int64 tensor on that device: the dense histogram (:func:`fp8sim.trace.histogram.num_bins`
    entries), then :data:`STAT_FIELDS`. Launches work only: no host synchronisation. Read it
    back with :func:`unpack_statistics`."""
    import torch

    thr = cast_thresholds(fmt, rounding)
    nb = num_bins(k)
    flat = x.detach().reshape(-1)
    dev = flat.device
    # ids nb .. nb+2: NaN, inf, zero, counted by the same bincount as the histogram
    hist = torch.zeros(nb + 3, dtype=torch.int64, device=dev)
    over = torch.zeros((), dtype=torch.int64, device=dev)
    under = torch.zeros((), dtype=torch.int64, device=dev)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    amax = torch.zeros((), dtype=wide, device=dev)
    s32 = torch.tensor(float(np.float32(scale)), dtype=torch.float32, device=dev)
    f32 = (thr.overflow_at, thr.underflow_at)
    if any(float(np.float32(t)) != t for t in f32):  # compared in float32 below
        raise ValueError(f"{fmt.name}: thresholds {f32} are not float32 values")
    lo_id, hi_id = bin_id(EXPONENT_MIN, 0, 1, k), bin_id(EXPONENT_MAX, 0, 1, k)
    for start in range(0, flat.numel(), _TORCH_CHUNK):
        v = flat[start:start + _TORCH_CHUNK].to(wide)
        a = v.abs()
        nan, inf, zero = torch.isnan(v), a == math.inf, a == 0
        live = ~(nan | inf | zero)  # finite nonzero
        a32 = a.to(torch.float32)  # float64 inputs rounded once, as the cast sees them
        fr, ex = torch.frexp(a32)  # a32 = fr * 2**ex, 0.5 <= fr < 1 (exact in float32)
        f = (fr * 2 - 1) * (1 << k)
        m = f.to(torch.int32)  # floor: f >= 0
        ids = bin_id(ex.to(torch.int32) - 1, m, (f != m).to(torch.int32), k)
        ids = torch.where(a32 == 0, lo_id, torch.where(a32 == math.inf, hi_id, ids))
        ids = torch.where(live, ids, torch.where(nan, nb, torch.where(inf, nb + 1, nb + 2)))
        hist += torch.bincount(ids, minlength=nb + 3)
        q = a32 * s32  # float32(a32 * scale): one rounding
        ov = q > thr.overflow_at
        if thr.overflow_tie:
            ov |= q == thr.overflow_at
        un = q < thr.underflow_at
        if thr.underflow_tie:
            un |= q == thr.underflow_at
        over += (ov & live).sum()
        under += (un & ~ov & live).sum()
        amax = torch.maximum(amax, torch.where(live, a, 0).amax() if a.numel() else amax)
    amax_bits = amax.to(torch.float64).reshape(1).view(torch.int64)
    return torch.cat([hist[:nb], hist[nb:], over.reshape(1), under.reshape(1), amax_bits])


def unpack_statistics(row: np.ndarray, numel: int, k: int) -> HistogramCounts:
    """The :class:`HistogramCounts` of one :func:`device_statistics` result on the host (an int64
    numpy array) for a tensor of ``numel`` elements."""
    nb = num_bins(k)
    dense = row[:nb]
    nz = np.flatnonzero(dense)
    nan, inf, zero, over, under = (int(v) for v in row[nb:nb + 5])
    amax = float(row[nb + 5:nb + 6].view(np.float64)[0])
    return HistogramCounts(nz.astype(np.uint32), dense[nz].astype(np.int64), int(numel), zero, nan, inf,
                           over, under, amax)  # fmt: skip


# ------------------------------------------------------------------------------------------
# the entry point
# ------------------------------------------------------------------------------------------
def histogram_and_counts(
    x: Any, fmt: FloatFormat, scale: float, rounding: str, k: int, *, engine: str = "auto"
) -> HistogramCounts:
    """One pass over ``x`` (numpy array or torch tensor, any float dtype, any device): the
    histogram of |x| keeping ``k`` mantissa bits, the zero / NaN / inf counts, max finite |x|,
    and the overflow/underflow counts of ``encode(float32(float32(x) * float32(scale)))`` in
    ``fmt`` under ``rounding`` (one of :data:`fp8sim.trace.COUNT_ROUNDINGS`).

    ``engine``: :data:`ENGINES`; ``auto`` computes a tensor on an accelerator there (only the
    result is copied back) and host data with numba."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    is_torch = type(x).__module__.startswith("torch")
    on_host = not is_torch or x.device.type == "cpu"
    if engine == "numba" or (engine == "auto" and on_host):
        if is_torch and not on_host:
            x = x.detach().cpu()
        return _numba_counts(x, fmt, scale, rounding, k)
    if not is_torch:
        import torch

        x = torch.from_numpy(_host_array(x))
    row = device_statistics(x, fmt, scale, rounding, k).cpu().numpy()
    return unpack_statistics(row, x.numel(), k)


def abs_histogram(x: Any, mantissa_bits: int = DEFAULT_HIST_MANTISSA_BITS) -> AbsHistogram:
    """The trace histogram of a numpy array or torch tensor (one pass, on the tensor's device:
    :func:`histogram_and_counts`)."""
    check_mantissa_bits(mantissa_bits)
    r = histogram_and_counts(x, get_format("e4m3"), 1.0, "rne", mantissa_bits)
    return AbsHistogram(r.bins, r.counts, mantissa_bits, zero=r.zero, nan=r.nan, inf=r.inf)
