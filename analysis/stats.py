"""Single-pass FP8 statistics of a tensor under several formats x scalings.

For each requested (format, scaling) -- a *variant* -- the figures are those of the cast
``fp8sim.scaling.quantize_scaled(x, fmt, granularity, rounding="rne", saturate=True)`` followed by
``dequantize``, computed without materializing either:

* ``overflow``: finite values whose scaled magnitude ``float32(float32(x) * scale)`` rounds (RNE,
  unbounded exponent) above ``fmt.max``; the saturating cast then clamps them to max.
* ``underflow``: nonzero finite values that become 0.
* ``subnormal``: values whose cast result is nonzero and below ``fmt.min_normal``.
* ``sqnr_db = 10 log10(sum x^2 / sum (deq - x)^2)`` and ``rel_mse = sum (deq - x)^2 / sum x^2``
  over the finite values, ``deq = float32(decode(code) * scale_inv)`` as ``dequantize`` gives it.
* ``lost``: elements of MX blocks whose shared scale is NaN (the block holds a NaN or inf; the MX
  spec makes the whole block NaN). They are left out of the figures above.

Scalings: ``none`` (scale 1: a plain cast) or any :func:`fp8sim.scaling.parse_granularity` spec
(``tensor``, ``row``, ``col``, ``block:RxC``, ``mx``, ``mx:rceil``), just in time from each group's
amax with ``scale_from_amax`` / ``mx_shared_scale`` -- the scaling module's own functions.

Passes, per chunk of the flat tensor (bounded memory, files read lazily): pass A is one numba pass
computing the format-independent figures (NaN/inf/zero counts, amax, sum x^2, the log2|x|
histogram) and every requested granularity's per-group amax; pass B is one numba pass computing
every variant's figures at once. A just-in-time tensor scale needs the whole tensor's amax before
the first cast, hence two passes; everything else is fused. Inside a pass, a chunk is split into
parts run on threads (the numba functions release the GIL), each part into L1-sized blocks whose
loops are branch-free so LLVM vectorizes them; the cast works on float32 bit patterns (RNE as an
integer add in the normal range, a float32 add of a constant at the subnormal quantum).

Counts are exact (tests compare them with ``quantize_scaled`` + ``dequantize``); the two sums are
float64 accumulations in a fixed order (blocks of four interleaved partial sums), equal to the
exactly rounded sum to ~1e-12 relative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from fp8sim._jit import jit_serial
from fp8sim.formats import FloatFormat, get_format
from fp8sim.scaling import Granularity, mx_shared_scale, parse_granularity, scale_from_amax, view2d
from fp8sim.trace import EXPONENT_MAX, EXPONENT_MIN

__all__ = [
    "Variant",
    "VariantStats",
    "TensorStats",
    "parse_variants",
    "tensor_stats",
    "LOG2_EXPONENTS",
    "DEFAULT_CHUNK",
]

#: binades of the log2|x| histogram: floor(log2 float32(|x|)); the ends are sentinels for float64
#: values outside float32's range (as in fp8sim.trace)
LOG2_EXPONENTS = np.arange(EXPONENT_MIN, EXPONENT_MAX + 1)
#: elements per chunk (4 MiB of float32)
DEFAULT_CHUNK = 1 << 20
_N_LOG2 = EXPONENT_MAX - EXPONENT_MIN + 1


# ------------------------------------------------------------------------------------------
# variants
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One format x scaling to evaluate. ``scaling``: ``"none"`` or a granularity spec."""

    fmt: FloatFormat
    scaling: str
    margin: float = 0.0
    pow2: bool = False

    @property
    def granularity(self) -> Granularity:
        return parse_granularity("tensor" if self.scaling == "none" else self.scaling)


def _check_format(fmt: FloatFormat) -> None:
    f32_max = float(np.finfo(np.float32).max)
    if not (fmt.signed and fmt.has_subnormals) or fmt.mantissa_bits > 22:
        raise ValueError(
            f"format {fmt.name}: analysis needs a signed element format with subnormals and at "
            "most 22 mantissa bits (e8m0 is a scale format)"
        )
    if fmt.max >= f32_max or fmt.min_subnormal < 2.0**-149:
        raise ValueError(f"format {fmt.name}: its range exceeds float32's")


def parse_variants(
    formats: Sequence[str], scalings: Sequence[str], *, margin: float = 0.0, pow2: bool = False
) -> list[Variant]:
    """Every format x scaling, validated (ValueError naming the bad name and the valid ones)."""
    out = []
    if not formats or not scalings:
        raise ValueError("need at least one format and one scaling")
    for f in formats:
        fmt = get_format(f.strip())
        _check_format(fmt)
        for s in scalings:
            s = s.strip().lower()
            if s != "none":
                g = parse_granularity(s)
                s = g.spec
                if g.kind == "mx" and (margin or pow2):
                    raise ValueError("margin/pow2 do not apply to mx scaling (E8M0 rule)")
            out.append(Variant(fmt, s, float(margin), bool(pow2)))
    return out


# ------------------------------------------------------------------------------------------
# numba kernels
# ------------------------------------------------------------------------------------------
@intrinsic
def _f32_bits(typingctx, x):
    """The uint32 bit pattern of a float32 (an LLVM bitcast)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, u):
    """The float32 with bit pattern ``u`` (the low 32 bits of an integer)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


def _parts(n: int) -> int:
    """Thread parts for n elements: at most one per numba thread, at least 64 Ki elements each."""
    return max(1, min(numba.get_num_threads(), n // (1 << 16)))


#: elements per inner block: the float64 scratch buffers stay in L1
_BLOCK = 2048
_SKIP = 0xFFFFFFFF  # "no histogram entry" marker (zero, NaN, inf)
# squares of |v| >= _BIG (float64 only) could overflow a sum: they are summed as (v * _DOWN)^2
# in a second, "high" sum worth _DOWN**-2 = 2**_HIGH_EXP times its value (see _combine); the
# low sum stays below 2**1023 for up to 2**63 elements, the high one too
_BIG = 2.0**480
_DOWN = 2.0**-540
_HIGH_EXP = 1080
_SUB = 0xFFFFFFFE  # "float32 subnormal: find the bin in the scatter loop" marker


@jit_serial
def _sum4(buf, m):
    """Sum of buf[:m] with four interleaved accumulators (a fixed order: deterministic)."""
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    q = m // 4
    for k in range(q):
        s0 += buf[4 * k]
        s1 += buf[4 * k + 1]
        s2 += buf[4 * k + 2]
        s3 += buf[4 * k + 3]
    for k in range(4 * q, m):
        s0 += buf[k]
    return (s0 + s1) + (s2 + s3)


@jit_serial
def _scan_block(xs, buf, ubuf, log2):
    """Format-independent figures of one block ``xs`` (a contiguous view, <= _BLOCK long).

    A branch-free first loop (LLVM vectorizes it): NaN/inf/zero counts, the max float32 bits of
    the finite |x| (bit patterns order like magnitudes), x^2 into ``buf``, and each value's
    log2 bin into ``ubuf``; then the histogram scatter into 4 interleaved copies of ``log2``
    (no store-to-load chains on a hot bin). Returns (nan, inf, zero, amax bits, sum x^2).
    """
    m = xs.size
    nan = 0
    inf = 0
    zero = 0
    mxb = np.uint32(0)
    big = 0
    for k in range(m):
        v = np.float64(xs[k])
        ax = abs(v)
        nan += np.int64(v != v)
        inf += np.int64(ax == np.inf)
        zero += np.int64(v == 0.0)
        u = _f32_bits(np.float32(ax))
        mxb = max(mxb, u & (np.uint32(0) - np.uint32(ax < np.inf)))  # finite x only
        big += np.int64(ax >= _BIG) & np.int64(ax < np.inf)
        buf[k] = v * v if ax < _BIG else 0.0
    sqh = 0.0
    if big:  # rare: float64 values whose squares overflow
        for k in range(m):
            ax = abs(np.float64(xs[k]))
            if ax >= _BIG and ax < np.inf:
                w = ax * _DOWN
                sqh += w * w
    top = np.uint32(EXPONENT_MAX - EXPONENT_MIN)
    for k in range(m):
        v = np.float64(xs[k])
        ax = abs(v)
        u = _f32_bits(np.float32(ax))
        eb = u >> np.uint32(23)
        # bin = floor(log2) - EXPONENT_MIN: normal eb - 127 + 150; eb 255 (a float64 beyond
        # float32) and u == 0 (a nonzero float64 below it) are the sentinels; float32
        # subnormals are resolved in the scatter loop
        idx = eb + np.uint32(23)
        idx = top if eb == np.uint32(255) else idx
        idx = np.uint32(_SUB) if eb == np.uint32(0) else idx
        idx = np.uint32(0) if u == np.uint32(0) else idx
        ubuf[k] = idx if ((ax < np.inf) & (v != 0.0)) else np.uint32(_SKIP)
    sq = _sum4(buf, m)
    for k in range(m):
        b = ubuf[k]
        if b >= np.uint32(_SUB):
            if b == np.uint32(_SKIP):
                continue
            u = _f32_bits(np.float32(abs(np.float64(xs[k]))))
            e = -150  # float32 subnormal: floor(log2) from the leading one
            while u > 0:
                u >>= np.uint32(1)
                e += 1
            b = np.uint32(e - EXPONENT_MIN)
        log2[k & 3, b] += 1
    return nan, inf, zero, mxb, sq, sqh


@jit_serial
def _tile_amax(xs):
    """(max float32 bits of |x| over non-NaN elements (inf included), NaN count) of a tile."""
    mxb = np.uint32(0)
    nan = 0
    for k in range(xs.size):
        v = np.float64(xs[k])
        nan += np.int64(v != v)
        u = _f32_bits(np.float32(abs(v)))
        mxb = max(mxb, u & (np.uint32(0) - np.uint32(v == v)))
    return mxb, nan


@jit_serial
def _cast_block(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf):
    """The saturating RNE cast ``float32(float32(x) * sc)`` of one block and its figures.

    Works on float32 bit patterns: in the normal range the RNE rounding to m mantissa bits is the
    integer add ``(u + 2**(shift-1) - 1 + lsb) & keep`` (a carry moves into the exponent as it
    should); below ``min_normal`` the quantum is fixed and ``(a + csub) - csub`` rounds to it in
    float32 (csub = 2**(emin - m + 23)). Overflow: the rounded bits exceed max's bits (an inf
    product too). Branch-free so LLVM vectorizes it. Returns (overflow, underflow, subnormal,
    sum of (deq - x)^2) over the finite elements.
    """
    m = xs.size
    over = 0
    under = 0
    sub = 0
    big = 0
    for k in range(m):
        ax = abs(np.float64(xs[k]))
        fin = np.int64(ax < np.inf)
        a = np.float32(np.float32(ax) * sc)
        u = _f32_bits(a)
        ur = np.uint32((u + half_m1 + ((u >> shift) & np.uint32(1))) & keep)
        us = _f32_bits((a + csub) - csub)
        qb = us if u < minnorm_bits else ur
        ovb = np.int64(qb > max_bits) & fin
        over += ovb
        under += fin & np.int64(qb == 0) & np.int64(ax != 0)
        sub += fin & np.int64(qb != 0) & np.int64(qb < minnorm_bits)
        qb = max_bits if ovb else qb
        d = np.float64(np.float32(_bits_f32(qb) * si)) - ax
        big += fin & np.int64(abs(d) >= _BIG)
        buf[k] = d * d if abs(d) < _BIG else 0.0
    qh = 0.0
    if big:  # rare: float64 errors whose squares overflow (same cast as above)
        for k in range(m):
            ax = abs(np.float64(xs[k]))
            if not ax < np.inf:
                continue
            a = np.float32(np.float32(ax) * sc)
            u = _f32_bits(a)
            ur = np.uint32((u + half_m1 + ((u >> shift) & np.uint32(1))) & keep)
            us = _f32_bits((a + csub) - csub)
            qb = us if u < minnorm_bits else ur
            qb = max_bits if qb > max_bits else qb
            d = abs(np.float64(np.float32(_bits_f32(qb) * si)) - ax)
            if d >= _BIG:
                w = d * _DOWN
                qh += w * w
    return over, under, sub, _sum4(buf, m), qh


@jit_serial
def _part_a(x, s, e, i0, ncols, gran, local_off, log2, gamax, gnan):
    """Pass A over elements [s, e) of the chunk: see :func:`_pass_a`."""
    buf = np.empty(_BLOCK, np.float64)
    ubuf = np.empty(_BLOCK, np.uint32)
    nan = 0
    inf = 0
    zero = 0
    mxb = np.uint32(0)
    sq = 0.0
    sqh = 0.0
    for b0 in range(s, e, _BLOCK):
        b1 = min(e, b0 + _BLOCK)
        n1, n2, n3, mb, q, qh = _scan_block(x[b0:b1], buf, ubuf, log2)
        sqh += qh
        nan += n1
        inf += n2
        zero += n3
        mxb = mb if mb > mxb else mxb
        sq += q
    if gran.shape[0] > 0:
        i = s
        r = (i0 + i) // ncols
        c = (i0 + i) - r * ncols
        while i < e:
            seg = min(ncols - c, e - i)
            for g in range(gran.shape[0]):
                R = gran[g, 0]
                C = gran[g, 1]
                Gc = gran[g, 2]
                row_base = local_off[g] + (r // R - gran[g, 3]) * Gc
                cc = c
                while cc < c + seg:
                    t = cc // C
                    stop = min((t + 1) * C, c + seg)
                    mb, nn = _tile_amax(x[i + cc - c : i + stop - c])
                    if mb > gamax[row_base + t]:
                        gamax[row_base + t] = mb
                    gnan[row_base + t] += nn
                    cc = stop
            i += seg
            r += 1
            c = 0
    return nan, inf, zero, mxb, sq, sqh


def _run_parts(fn, n: int, n_parts: int, make_args) -> None:
    """Run ``fn(*make_args(p, s, e))`` over ``n_parts`` contiguous parts of ``range(n)``, on
    threads (the numba functions release the GIL); each part writes only its own outputs."""
    per = (n + n_parts - 1) // n_parts
    bounds = [(p, p * per, min(n, (p + 1) * per)) for p in range(n_parts)]
    if n_parts == 1:
        return [fn(*make_args(*bounds[0]))]
    return list(_executor().map(lambda b: fn(*make_args(*b)), bounds))


_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR = ThreadPoolExecutor(max_workers=numba.get_num_threads())
    return _EXECUTOR


def _pass_a(x, i0, ncols, gran, local_off, n_local, n_parts):
    """Format-independent figures of one chunk and each granularity's per-group amax.

    x: the chunk (float32/float64), flat C-order elements i0 .. i0+x.size of the (M, ncols) view.
    gran[g] = (R, C, Gc, first grid row of this chunk); granularity g's local grid starts at
    local_off[g] in a per-part buffer of n_local entries.
    Returns per part: counts (P, 3) = nan, inf, zero; amax bits (P,) (float32 bits of the max
    finite |float32(x)|); sig2 (P, 2) = sum x^2 over finite as a (low, high) pair (see _combine); log2 (P, 4, n_log2);
    gamax (P, n_local) group amax as float32 bits (NaN skipped); gnan (P, n_local) NaN counts.
    """
    log2 = np.zeros((n_parts, 4, EXPONENT_MAX - EXPONENT_MIN + 1), np.int64)
    gamax = np.zeros((n_parts, n_local), np.uint32)
    gnan = np.zeros((n_parts, n_local), np.int64)
    out = _run_parts(
        _part_a, x.size, n_parts,
        lambda p, s, e: (x, s, e, i0, ncols, gran, local_off, log2[p], gamax[p], gnan[p]),
    )  # fmt: skip
    counts = np.array([o[:3] for o in out], np.int64).reshape(n_parts, 3)
    amax = np.array([o[3] for o in out], np.uint32)
    sig2 = np.array([(o[4], o[5]) for o in out], np.float64).reshape(n_parts, 2)
    return counts, amax, sig2, log2, gamax, gnan


@jit_serial
def _part_b(x, s, e, i0, ncols, vint, vflt, scales, sinvs, counts, err2):
    """Pass B over elements [s, e) of the chunk: see :func:`_pass_b`."""
    buf = np.empty(_BLOCK, np.float64)
    i = s
    r = (i0 + i) // ncols
    c = (i0 + i) - r * ncols
    while i < e:
        seg = min(ncols - c, e - i)
        for v in range(vint.shape[0]):
            R = vint[v, 0]
            C = vint[v, 1]
            Gc = vint[v, 2]
            shift = np.uint32(vint[v, 4])
            half_m1 = np.uint32((1 << (vint[v, 4] - 1)) - 1)
            keep = ~np.uint32((1 << vint[v, 4]) - 1)
            max_bits = np.uint32(vint[v, 5])
            minnorm_bits = np.uint32(vint[v, 6])
            csub = np.float32(vflt[v, 0])
            row_base = vint[v, 3] + (r // R - vint[v, 7]) * Gc
            cc = c
            while cc < c + seg:
                t = cc // C
                stop = min((t + 1) * C, c + seg)
                sc = scales[row_base + t]
                si = sinvs[row_base + t]
                a0 = i + cc - c
                a1 = i + stop - c
                if si != si:  # NaN MX scale: the whole block is NaN
                    for j in range(a0, a1):
                        counts[v, 3] += np.int64(abs(np.float64(x[j])) < np.inf)
                else:
                    for b0 in range(a0, a1, _BLOCK):
                        b1 = min(a1, b0 + _BLOCK)
                        o, u, sb, q, qh = _cast_block(
                            x[b0:b1], sc, si, shift, half_m1, keep, max_bits, minnorm_bits,
                            csub, buf,
                        )  # fmt: skip
                        counts[v, 0] += o
                        counts[v, 1] += u
                        counts[v, 2] += sb
                        err2[v, 0] += q
                        err2[v, 1] += qh
                cc = stop
        i += seg
        r += 1
        c = 0


def _pass_b(x, i0, ncols, vint, vflt, scales, sinvs, n_parts):
    """Every variant's figures over one chunk (one pass; parts on threads).

    vint[v] = (R, C, Gc, scale offset, shift = 23 - mantissa bits, float32 bits of fmt.max,
    float32 bits of fmt.min_normal, first grid row of the chunk); vflt[v] = (2**(emin - m + 23),
    fmt.max, fmt.min_normal). scales / sinvs: each variant's scale grid rows that the chunk
    touches, flat (float32), variant v's from offset vint[v, 3]. Returns per part:
    counts (P, V, 4) = overflow, underflow, subnormal, lost; err2 (P, V, 2) = sum (deq - x)^2
    as (low, high) pairs.
    """
    nv = vint.shape[0]
    counts = np.zeros((n_parts, nv, 4), np.int64)
    err2 = np.zeros((n_parts, nv, 2), np.float64)
    _run_parts(
        _part_b, x.size, n_parts,
        lambda p, s, e: (x, s, e, i0, ncols, vint, vflt, scales, sinvs, counts[p], err2[p]),
    )  # fmt: skip
    return counts, err2


# ------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------
@dataclass
class VariantStats:
    """Figures of one format x scaling (see the module docstring). ``scale``: the smallest group
    scale (the tensor's scale for ``tensor``/``none``), ``scale_max`` the largest."""

    format: str
    scaling: str
    scale: float
    scale_max: float
    overflow: int
    underflow: int
    subnormal: int
    lost: int
    err2: float
    sqnr_db: float  # inf when there is no error at all
    rel_mse: float


@dataclass
class TensorStats:
    """One tensor's format-independent figures and its variants.

    ``amax``: max finite ``|float32(x)|``; ``sig2``: sum of x^2 over finite values (float64);
    ``log2_counts[i]``: values with ``floor(log2 float32(|x|)) == LOG2_EXPONENTS[i]``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nan: int = 0
    inf: int = 0
    zero: int = 0
    amax: float = 0.0
    sig2: float = 0.0
    log2_counts: np.ndarray = field(default_factory=lambda: np.zeros(_N_LOG2, np.int64))
    variants: list[VariantStats] = field(default_factory=list)
    file: str = ""

    @property
    def finite(self) -> int:
        return self.numel - self.nan - self.inf

    @property
    def nonzero(self) -> int:
        """Finite nonzero values."""
        return self.finite - self.zero

    def records(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per variant: name, shape, dtype, numel, format, scaling, amax,
        scale, overflow, underflow, subnormal, nan, inf, sqnr_db, rel_mse, plus file, zero,
        scale_max, lost and the shares (percent: overflow of finite, underflow and subnormal
        of nonzero). Non-finite floats become None (sqnr_db None with rel_mse 0: no error at all;
        both None: undefined)."""
        out = []
        for v in self.variants:
            out.append(
                {
                    "name": self.name,
                    "file": self.file,
                    "shape": list(self.shape),
                    "dtype": self.dtype,
                    "numel": self.numel,
                    "format": v.format,
                    "scaling": v.scaling,
                    "amax": _finite_or_none(self.amax),
                    "scale": _finite_or_none(v.scale),
                    "scale_max": _finite_or_none(v.scale_max),
                    "overflow": v.overflow,
                    "underflow": v.underflow,
                    "subnormal": v.subnormal,
                    "nan": self.nan,
                    "inf": self.inf,
                    "zero": self.zero,
                    "lost": v.lost,
                    "sqnr_db": _finite_or_none(v.sqnr_db),
                    "rel_mse": _finite_or_none(v.rel_mse),
                    "overflow_pct": 100.0 * v.overflow / self.finite if self.finite else 0.0,
                    "underflow_pct": 100.0 * v.underflow / self.nonzero if self.nonzero else 0.0,
                    "subnormal_pct": 100.0 * v.subnormal / self.nonzero if self.nonzero else 0.0,
                }
            )
        return out


def _mant_exp(pair: np.ndarray) -> tuple[float, int]:
    """A (low, high) sum pair as ``m * 2**e``: the high sum counts 2**_HIGH_EXP times its value."""
    lo, hi = float(pair[0]), float(pair[1])
    if hi > 0:
        return hi + math.ldexp(lo, -_HIGH_EXP), _HIGH_EXP
    return lo, 0


def _combine(pair: np.ndarray) -> float:
    """The value of a (low, high) sum pair (inf when beyond float64)."""
    m, e = _mant_exp(pair)
    try:
        return math.ldexp(m, e)
    except OverflowError:
        return math.inf


def _finite_or_none(v: float) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------
def _as_reader(x: Any) -> tuple[Callable[[int, int], np.ndarray], tuple[int, ...], str]:
    """(read(start, stop) -> float32/float64, shape, dtype name) of an array, tensor or source."""
    if hasattr(x, "read") and hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "numel"):
        return x.read, tuple(x.shape), str(x.dtype)
    from fp8sim.emulator import as_float_array

    if type(x).__module__.startswith("torch"):
        dtype = str(x.dtype).replace("torch.", "")
    else:
        dtype = np.asarray(x).dtype.name
    arr, _ = as_float_array(x)
    flat = np.ascontiguousarray(arr).reshape(-1)
    return (lambda a, b: flat[a:b]), tuple(arr.shape), dtype


def tensor_stats(
    x: Any,
    variants: Sequence[Variant],
    *,
    name: str = "",
    chunk: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> TensorStats:
    """Statistics of ``x`` (numpy array, CPU torch tensor or a ``dumps.TensorSource``) under every
    variant, reading it chunk by chunk (twice: pass A, then pass B).

    ``progress(n)`` is called with the number of elements each pass finished (2 x numel in all).
    Raises TypeError for non-float input.
    """
    read, shape, dtype = _as_reader(x)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    res = TensorStats(name=name, shape=shape, dtype=dtype, numel=numel)
    if numel == 0:
        return res
    m, n = view2d(shape)
    chunk = max(1, int(chunk))

    # distinct granularities (none needs no amax)
    grans: list[Granularity] = []
    for v in variants:
        if v.scaling != "none" and v.granularity not in grans:
            grans.append(v.granularity)
    g_tiles = []
    for g in grans:
        r, c = g.tile(m, n)
        g_tiles.append((r, c, -(-n // c), -(-m // r)))
    g_amax = [np.zeros(gr * gc, np.uint32) for (_, _, gc, gr) in g_tiles]  # float32 bits
    g_nan = [np.zeros(gr * gc, bool) for (_, _, gc, gr) in g_tiles]  # group holds a NaN

    # ---- pass A ----
    counts = np.zeros(3, np.int64)
    amax_bits = np.uint32(0)
    sig2 = np.zeros(2, np.float64)  # (low sum, high sum): see _combine
    log2 = np.zeros(_N_LOG2, np.int64)
    for start in range(0, numel, chunk):
        xc = read(start, min(numel, start + chunk))
        first_row = start // n
        last_row = (start + xc.size - 1) // n
        # granularities the kernel tiles (tensor's amax comes from the chunk's own amax)
        tiled = [k for k, g in enumerate(grans) if g.kind != "tensor"]
        gran = np.zeros((len(tiled), 4), np.int64)
        local_off = np.zeros(len(tiled) + 1, np.int64)
        for j, k in enumerate(tiled):
            r, c, gc, _ = g_tiles[k]
            lo, hi = first_row // r, last_row // r
            gran[j] = (r, c, gc, lo)
            local_off[j + 1] = local_off[j] + (hi - lo + 1) * gc
        cnt, am, sq, lg, gam, gnn = _pass_a(
            xc, start, n, gran, local_off, int(local_off[-1]), _parts(xc.size)
        )
        counts += cnt.sum(axis=0)
        amax_bits = max(amax_bits, am.max())
        sig2 += sq.sum(axis=0)
        log2 += lg.sum(axis=(0, 1))
        for k, g in enumerate(grans):
            if g.kind == "tensor":  # NaN skipped, an inf counts (as quantize_scaled does)
                a = np.uint32(0x7F800000) if cnt[:, 1].sum() else am.max()
                g_amax[k][0] = max(g_amax[k][0], a)
        for j, k in enumerate(tiled):
            a, b = int(local_off[j]), int(local_off[j + 1])
            lo = int(gran[j, 3]) * int(gran[j, 2])
            tgt = slice(lo, lo + (b - a))
            g_amax[k][tgt] = np.maximum(g_amax[k][tgt], gam[:, a:b].max(axis=0))
            g_nan[k][tgt] |= gnn[:, a:b].sum(axis=0) > 0
        if progress is not None:
            progress(xc.size)
    res.nan, res.inf, res.zero = (int(v) for v in counts)
    res.amax = float(np.array([amax_bits], np.uint32).view(np.float32)[0])
    res.sig2, res.log2_counts = _combine(sig2), log2

    # ---- pass B, with each chunk's scales from the scaling module's own rules ----
    # (scales are made per chunk, for the grid rows the chunk touches: an MX scale grid of a
    # 4 GB tensor is never held whole)
    vint = np.zeros((len(variants), 8), np.int64)
    vflt = np.zeros((len(variants), 3), np.float64)
    shapes = []
    for k, v in enumerate(variants):
        fmt = v.fmt
        if v.scaling == "none":
            r, c, gc, gi = m, n, 1, -1
        else:
            gi = grans.index(v.granularity)
            r, c, gc, _ = g_tiles[gi]
        shapes.append((r, gc, gi))
        mb = fmt.mantissa_bits
        vint[k, :7] = (
            r, c, gc, 0, 23 - mb,
            int(np.float32(fmt.max).view(np.uint32)),
            int(np.float32(fmt.min_normal).view(np.uint32)),
        )  # fmt: skip
        vflt[k] = (2.0 ** (fmt.emin - mb + 23), fmt.max, fmt.min_normal)

    def chunk_scales(v: Variant, gi: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(multipliers, scale_inv) of grid entries [lo, hi) of variant v (float32)."""
        if gi < 0:
            return np.ones(1, np.float32), np.ones(1, np.float32)
        gam = g_amax[gi][lo:hi].view(np.float32)
        if v.granularity.kind == "mx":
            a = np.where(g_nan[gi][lo:hi], np.float32(np.nan), gam).astype(np.float32)
            sinv = mx_shared_scale(a, v.fmt, v.granularity.mx_rule)
            with np.errstate(invalid="ignore", divide="ignore"):
                return (np.float32(1) / sinv).astype(np.float32), sinv
        mult = scale_from_amax(gam, v.fmt, margin=v.margin, pow2=v.pow2).reshape(-1)
        return mult, (np.float32(1) / mult).astype(np.float32)

    vcounts = np.zeros((len(variants), 4), np.int64)
    verr = np.zeros((len(variants), 2), np.float64)
    smin = np.full(len(variants), np.inf)
    smax = np.full(len(variants), -np.inf)
    for start in range(0, numel if variants else 0, chunk):
        xc = read(start, min(numel, start + chunk))
        first_row, last_row = start // n, (start + xc.size - 1) // n
        sc_parts, si_parts = [], []
        off = 0
        for k, v in enumerate(variants):
            r, gc, gi = shapes[k]
            lo, hi = first_row // r, last_row // r
            mult, sinv = chunk_scales(v, gi, lo * gc, (hi + 1) * gc)
            sc_parts.append(mult)
            si_parts.append(np.asarray(sinv, np.float32).reshape(-1))
            vint[k, 3] = off
            vint[k, 7] = lo
            off += mult.size
            fin = mult[np.isfinite(mult)]
            if fin.size:
                smin[k] = min(smin[k], float(fin.min()))
                smax[k] = max(smax[k], float(fin.max()))
        cnt, e2 = _pass_b(xc, start, n, vint, vflt, np.concatenate(sc_parts),
                          np.concatenate(si_parts), _parts(xc.size))  # fmt: skip
        vcounts += cnt.sum(axis=0)
        verr += e2.sum(axis=0)
        if progress is not None:
            progress(xc.size)

    s_m, s_e = _mant_exp(sig2)
    for k, v in enumerate(variants):
        e_m, e_e = _mant_exp(verr[k])
        e2 = _combine(verr[k])
        if e_m == 0.0:
            sqnr, rel = math.inf, 0.0
        elif s_m > 0:
            sqnr = 10.0 * (math.log10(s_m / e_m) + (s_e - e_e) * math.log10(2.0))
            try:
                rel = math.ldexp(e_m / s_m, e_e - s_e)
            except OverflowError:
                rel = math.inf
        else:
            sqnr, rel = -math.inf, math.inf
        res.variants.append(
            VariantStats(
                format=v.fmt.name,
                scaling=v.scaling,
                scale=float(smin[k]) if smax[k] >= smin[k] else math.nan,
                scale_max=float(smax[k]) if smax[k] >= smin[k] else math.nan,
                overflow=int(vcounts[k, 0]),
                underflow=int(vcounts[k, 1]),
                subnormal=int(vcounts[k, 2]),
                lost=int(vcounts[k, 3]),
                err2=e2,
                sqnr_db=sqnr,
                rel_mse=rel,
            )
        )
    return res
