"""Block kernels of the analysis statistics (see :mod:`analysis.stats.passes` for the passes
that run them): per L1-sized block of a chunk, the format-independent figures
(:func:`scan_figures`) and one variant's cast figures (:func:`cast_figures`, the one
implementation of the cast), in float64 (general) and float32 (32-bit lanes) versions that give
the same figures to the last bit; the fixed-order sums they use; the amax of a tile.
Loops are branch-free so that LLVM vectorizes them. Float32 input takes kernels in 32-bit integer
lanes (:func:`fp8sim._numba.bitcast.add32` and friends: numba would widen uint32 arithmetic to 64 bits
and halve the lanes); float64 input the general kernels.
"""

from __future__ import annotations

import numpy as np

from numba.core import types
from numba.extending import overload

from fp8sim._numba.bitcast import add32, and32, shr32
from fp8sim._numba.bitcast import bits_f32 as _bits_f32
from fp8sim._numba.bitcast import f32_bits as _f32_bits
from fp8sim._numba.jit import jit_inline, jit_serial
from fp8sim.trace import EXPONENT_MAX, EXPONENT_MIN

__all__ = ["N_LOG2", "N_HIST_COPIES", "BLOCK", "HIGH_EXP", "pairwise_sum", "scan_figures",
           "cast_figures", "tile_amax"]  # fmt: skip

#: log2|x| histogram bins (floor(log2 float32(|x|)) - EXPONENT_MIN; the ends are sentinels)
N_LOG2 = EXPONENT_MAX - EXPONENT_MIN + 1
#: copies of the exponent-byte histogram a part scatters into (element k into copy k % 8): no
#: store-to-load chain on a hot bin
N_HIST_COPIES = 8

#: elements per inner block: the block, its float64 scratch and the histogram copies stay in L1
BLOCK = 1024
#: a full block is read as four quarters side by side, whose sums of squares fold in registers
#: into the first two levels of the block's pairwise sum (:func:`_squares_full_block_f32`)
_QUARTER = BLOCK // 4
_MAG = np.uint32(0x7FFFFFFF)  # float32 magnitude bits
_MIN_NORMAL32 = np.uint32(0x00800000)  # bits of 2**-126
_ONE = np.uint32(1)
_EXP_SHIFT = np.uint32(23)
# squares of |v| >= _BIG (float64 only) could overflow a sum: they are summed as (v * _DOWN)^2
# in a second, "high" sum worth _DOWN**-2 = 2**HIGH_EXP times its value (see
# stats.figures._combine);
# the low sum stays below 2**1023 for up to 2**63 elements, the high one too
_BIG = 2.0**480
_DOWN = 2.0**-540
HIGH_EXP = 1080


@jit_serial
def pairwise_sum(buf, m):
    """Pairwise sum of buf[:m] (a fixed order: deterministic), overwriting buf: each level adds
    the upper half onto the lower half elementwise (a loop LLVM vectorizes, where an ordered
    sum would run one scalar add at a time), down to 16 values summed in order."""
    while m > 16:
        h = m // 2
        o = m - h
        lo = buf[:h]
        hi = buf[o : o + h]
        for k in range(h):
            lo[k] += hi[k]
        m = o
    s = 0.0
    for k in range(m):
        s += buf[k]
    return s


@jit_serial
def _count_exponent_bytes(xs, hist):
    """``hist[k % 8, b] += 1`` for each element k of ``xs`` whose float32 has exponent byte b.

    Eight copies, the loop unrolled by eight: an element waits on the store of the same copy's
    counter only eight elements back, so a hot bin does not serialize the loop (uint32: a part
    holds fewer than 2**32 elements per copy).
    """
    m = xs.size
    q = m // 8
    for i in range(q):
        b = xs[8 * i : 8 * i + 8]
        hist[0, shr32(and32(_f32_bits(np.float32(b[0])), _MAG), _EXP_SHIFT)] += 1
        hist[1, shr32(and32(_f32_bits(np.float32(b[1])), _MAG), _EXP_SHIFT)] += 1
        hist[2, shr32(and32(_f32_bits(np.float32(b[2])), _MAG), _EXP_SHIFT)] += 1
        hist[3, shr32(and32(_f32_bits(np.float32(b[3])), _MAG), _EXP_SHIFT)] += 1
        hist[4, shr32(and32(_f32_bits(np.float32(b[4])), _MAG), _EXP_SHIFT)] += 1
        hist[5, shr32(and32(_f32_bits(np.float32(b[5])), _MAG), _EXP_SHIFT)] += 1
        hist[6, shr32(and32(_f32_bits(np.float32(b[6])), _MAG), _EXP_SHIFT)] += 1
        hist[7, shr32(and32(_f32_bits(np.float32(b[7])), _MAG), _EXP_SHIFT)] += 1
    for k in range(8 * q, m):
        hist[0, shr32(and32(_f32_bits(np.float32(xs[k])), _MAG), _EXP_SHIFT)] += 1


@jit_serial
def _byte_count(hist, b):
    """Elements counted so far with exponent byte b (all copies)."""
    t = 0
    for j in range(hist.shape[0]):
        t += np.int64(hist[j, b])
    return t


@jit_serial
def _bin_subnormals(xs, hsub):
    """``hsub[floor(log2|x|) - EXPONENT_MIN] += 1`` for each element whose float32 is subnormal,
    its floor(log2) from the leading one (the exponent byte says 0 for all of them)."""
    for k in range(xs.size):
        u = and32(_f32_bits(np.float32(xs[k])), _MAG)
        if u != np.uint32(0) and u < _MIN_NORMAL32:
            e = -150
            while u > np.uint32(0):
                u >>= np.uint32(1)
                e += 1
            hsub[e - EXPONENT_MIN] += 1


@jit_serial
def _scan_block(xs, buf, hist, hsub):
    """Format-independent figures of one block ``xs`` (float32 or float64, contiguous).

    A branch-free loop (vectorized): NaN/inf/zero counts, the max float32 bits of the finite |x|
    (bit patterns order like magnitudes), the count of float32 subnormals, x^2 into ``buf``.
    Then every element's float32 exponent byte is counted into ``hist[k % 8, byte]`` (zero and
    subnormals land in byte 0, NaN/inf and float64 values beyond float32 in byte 255: the caller
    separates them with the counts), and only if the block holds float32 subnormals, their
    floor(log2) from the leading one goes into ``hsub`` (indexed like the final histogram).
    Returns (nan, inf, zero, amax bits, sum x^2 low, high).
    """
    m = xs.size
    nan = np.uint32(0)
    inf = np.uint32(0)
    zero = np.uint32(0)
    nsub = np.uint32(0)
    big = np.uint32(0)
    mxb = np.uint32(0)
    for k in range(m):
        v = np.float64(xs[k])
        ax = abs(v)
        fin = ax < np.inf
        u = and32(_f32_bits(np.float32(xs[k])), _MAG)
        nan = add32(nan, v != v)
        inf = add32(inf, ax == np.inf)
        zero = add32(zero, v == 0.0)
        nsub = add32(nsub, (u != np.uint32(0)) & (u < _MIN_NORMAL32))
        mxb = max(mxb, u if fin else np.uint32(0))
        big = add32(big, fin & (ax >= _BIG))
        buf[k] = v * v if ax < _BIG else 0.0
    sqh = 0.0
    if big:  # rare: float64 values whose squares overflow
        for k in range(m):
            ax = abs(np.float64(xs[k]))
            if ax >= _BIG and ax < np.inf:
                w = ax * _DOWN
                sqh += w * w
    _count_exponent_bytes(xs, hist)
    if nsub:  # rare
        _bin_subnormals(xs, hsub)
    return nan, inf, zero, mxb, pairwise_sum(buf, m), sqh


@jit_inline
def _round_bits(ux, sc, shift, half_m1, keep, minnorm_bits, csub):
    """The float32 bits of ``float32(float32(|x|) * sc)`` rounded to nearest even on the format's
    grid, before saturation (``ux``: the bits of float32 |x|). In the normal range the rounding
    to m mantissa bits is the integer add ``(u + 2**(shift-1) - 1 + lsb) & keep`` (a carry moves
    into the exponent as it should); below ``min_normal`` the quantum is fixed and
    ``(a + csub) - csub`` rounds to it in float32 (csub = 2**(emin - m + 23))."""
    a = np.float32(_bits_f32(ux) * sc)
    u = _f32_bits(a)
    ur = and32(add32(add32(u, half_m1), and32(shr32(u, shift), _ONE)), keep)
    us = _f32_bits((a + csub) - csub)
    return us if u < minnorm_bits else ur


@jit_serial
def _cast_block(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf):
    """The saturating RNE cast ``float32(float32(x) * sc)`` of one block and its figures.

    Works on float32 bit patterns (:func:`_round_bits`). Overflow: the rounded bits exceed max's
    bits (an inf product too). Branch-free so LLVM vectorizes it. Leaves ``(deq - x)^2`` of each
    element in ``buf[:m]`` (0 for NaN/inf inputs; the caller sums a whole block at once) and
    returns (overflow, finite elements that round to 0, finite elements that round below
    min_normal, the "high" sum of squares too large for float64). The two middle counts include
    the zeros (the caller takes the tensor's zeros off once: underflow = the first minus the
    zeros, subnormal = the second minus the first), so no kernel needs a zero test.
    """
    m = xs.size
    over = np.uint32(0)
    under = np.uint32(0)
    sub = np.uint32(0)
    big = np.uint32(0)
    for k in range(m):
        ax = abs(np.float64(xs[k]))
        fin = ax < np.inf
        ux = and32(_f32_bits(np.float32(xs[k])), _MAG)
        qb = _round_bits(ux, sc, shift, half_m1, keep, minnorm_bits, csub)
        ovb = fin & (qb > max_bits)
        over = add32(over, ovb)
        under = add32(under, fin & (qb == np.uint32(0)))
        sub = add32(sub, fin & (qb < minnorm_bits))
        qb = max_bits if ovb else qb
        d = abs(np.float64(np.float32(_bits_f32(qb) * si)) - ax)
        big = add32(big, fin & (d >= _BIG))
        buf[k] = d * d if d < _BIG else 0.0  # NaN/inf inputs: d is NaN/inf, left out
    qh = 0.0
    if big:  # rare: float64 errors whose squares overflow (same cast as above)
        for k in range(m):
            ax = abs(np.float64(xs[k]))
            if not ax < np.inf:
                continue
            ux = _f32_bits(np.float32(ax))
            qb = _round_bits(ux, sc, shift, half_m1, keep, minnorm_bits, csub)
            qb = max_bits if qb > max_bits else qb
            d = abs(np.float64(np.float32(_bits_f32(qb) * si)) - ax)
            if d >= _BIG:
                w = d * _DOWN
                qh += w * w
    return over, under, sub, qh


# ------------------------------------------------------------------------------------------
# float32 input: the same figures with fewer float64 operations
# ------------------------------------------------------------------------------------------
_INF_BITS = np.uint32(0x7F800000)


@jit_serial
def _squares_full_block_f32(xs, buf):
    """(max float32 bits of |x|, the sum of x^2) of a full float32 block without NaN/inf: the
    value :func:`pairwise_sum` gives over the squares, its first two levels done in registers
    (element k with k + 256, k + 512 and k + 768; the block is
    in L1 already, the exponent bytes having been counted); a float32's square is exact in float64,
    so the first level's adds are the only roundings, as in the pairwise sum."""
    x0 = xs[:_QUARTER]
    x1 = xs[_QUARTER : 2 * _QUARTER]
    x2 = xs[2 * _QUARTER : 3 * _QUARTER]
    x3 = xs[3 * _QUARTER : 4 * _QUARTER]
    mxb = np.uint32(0)
    for k in range(_QUARTER):
        m01 = max(and32(_f32_bits(x0[k]), _MAG), and32(_f32_bits(x1[k]), _MAG))
        m23 = max(and32(_f32_bits(x2[k]), _MAG), and32(_f32_bits(x3[k]), _MAG))
        mxb = max(mxb, max(m01, m23))
        v0 = np.float64(x0[k])  # a float32's square is exact in float64
        v1 = np.float64(x1[k])
        v2 = np.float64(x2[k])
        v3 = np.float64(x3[k])
        buf[k] = (v0 * v0 + v2 * v2) + (v1 * v1 + v3 * v3)  # (x0^2 + x2^2) + (x1^2 + x3^2)
    return mxb, pairwise_sum(buf, _QUARTER)


@jit_serial
def _scan_block_f32(xs, buf, hist, hsub):
    """:func:`_scan_block` for float32 blocks (the same results, fewer operations).

    The exponent bytes are counted first: byte 255 holds exactly the NaNs and infs, byte 0 the
    zeros and the subnormals, so only a block with such bytes is looked at again, and a block
    without NaN/inf takes its amax and squares without masking.
    """
    m = xs.size
    low0 = _byte_count(hist, 0)
    high0 = _byte_count(hist, 255)
    _count_exponent_bytes(xs, hist)
    n_low = _byte_count(hist, 0) - low0  # zeros + subnormals
    n_high = _byte_count(hist, 255) - high0  # NaN + inf
    mxb = np.uint32(0)
    nan = 0
    zero = 0
    if n_high:
        for k in range(m):
            u = and32(_f32_bits(xs[k]), _MAG)
            fin = u < _INF_BITS
            nan += np.int64(u > _INF_BITS)
            mxb = max(mxb, u if fin else np.uint32(0))
            v = np.float64(xs[k] if fin else np.float32(0))
            buf[k] = v * v
        sq = pairwise_sum(buf, m)
    elif m == BLOCK:
        mxb, sq = _squares_full_block_f32(xs, buf)
    else:
        for k in range(m):
            mxb = max(mxb, and32(_f32_bits(xs[k]), _MAG))
            v = np.float64(xs[k])
            buf[k] = v * v
        sq = pairwise_sum(buf, m)
    if n_low:
        for k in range(m):
            zero += np.int64(and32(_f32_bits(xs[k]), _MAG) == np.uint32(0))
        if zero < n_low:  # float32 subnormals
            _bin_subnormals(xs, hsub)
    return nan, n_high - nan, zero, mxb, sq, 0.0


@jit_serial
def _cast_block_f32(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf):
    """:func:`_cast_block` for float32 blocks (the same results, fewer operations).

    The RNE rounding to m mantissa bits is one float32 add and subtract of ``C``, the power of
    two whose ulp is the quantum at ``a``: ``C = 2**(e + 23 - m)`` for ``a`` in binade ``e``,
    at least ``csub`` (the fixed subnormal quantum), so ``(a + C) - C`` is ``a`` rounded to
    nearest even by the FPU at the right position, a carry into the next binade included. Only
    for formats with ``emax + 23 - m <= 127`` (every format up to 16 bits but bf16-like wide
    ones; the caller checks): there ``C`` is a float32 for every ``a`` up to the next binade
    above max, and a larger ``a`` (whose ``C`` bits overflow) comes out NaN, inf or about ``a``,
    above max either way.

    This fast loop assumes no element overflows and none is NaN/inf (it tracks the largest
    result instead of masking): a block where one does is redone by :func:`_cast_block`.
    Without saturation the error ``deq - |x|`` is exact in float32 (RNE keeps ``deq`` within a
    factor 2 of ``|x|`` or makes it 0: Sterbenz's lemma), so its float64 square is the general
    kernel's.
    """
    m = xs.size
    under = np.uint32(0)
    sub = np.uint32(0)
    top = np.uint32(0)
    c_min = _f32_bits(csub)
    c_add = np.uint32(shift << np.uint32(23))
    for k in range(m):
        ux = and32(_f32_bits(xs[k]), _MAG)
        a = np.float32(_bits_f32(ux) * sc)
        c = _bits_f32(max(add32(and32(_f32_bits(a), _INF_BITS), c_add), c_min))
        qb = _f32_bits((a + c) - c)
        top = max(top, qb)
        under = add32(under, qb == np.uint32(0))
        sub = add32(sub, qb < minnorm_bits)
        dd = np.float64(np.float32(np.float32(_bits_f32(qb) * si) - _bits_f32(ux)))
        buf[k] = dd * dd
    if top > max_bits:  # an overflow, a NaN or an inf
        return _cast_block(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf)
    return np.uint32(0), under, sub, 0.0


def scan_figures(xs, buf, hist, hsub):
    """:func:`_scan_block` or, for float32 blocks, :func:`_scan_block_f32` (chosen at compile
    time, inside numba code only)."""
    raise NotImplementedError("numba-only dispatcher")


def cast_figures(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf, fast32):
    """:func:`_cast_block` or, for float32 blocks of a format it takes (``fast32``),
    :func:`_cast_block_f32` (numba code only)."""
    raise NotImplementedError("numba-only dispatcher")


@overload(scan_figures)
def _scan_impl(xs, buf, hist, hsub):
    kernel = _scan_block_f32 if xs.dtype == types.float32 else _scan_block
    return lambda xs, buf, hist, hsub: kernel(xs, buf, hist, hsub)


@overload(cast_figures)
def _cast_impl(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf, fast32):
    if xs.dtype != types.float32:
        return lambda xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf, fast32: (
            _cast_block(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf)
        )

    def impl(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf, fast32):
        if fast32:
            return _cast_block_f32(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits,
                                   csub, buf)  # fmt: skip
        return _cast_block(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf)

    return impl


@jit_serial
def tile_amax(xs):
    """(max float32 bits of |x| over non-NaN elements (inf included), NaN count) of a tile."""
    mxb = np.uint32(0)
    nan = 0
    for k in range(xs.size):
        v = np.float64(xs[k])
        nan += np.int64(v != v)
        u = and32(_f32_bits(np.float32(v)), _MAG)
        mxb = max(mxb, u if v == v else np.uint32(0))
    return mxb, nan
