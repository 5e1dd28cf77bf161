"""The numba passes behind :func:`analysis.stats.tensor_stats` (see its module docstring).

Pass A (only when a variant needs a just-in-time scale): each granularity's group amaxes, the
tensor's finite amax and inf count. Pass B: everything else in one read of the data -- the
format-independent figures (NaN/inf/zero counts, amax, sum x^2, the log2|x| histogram) and
every variant's cast figures -- block by block, so each L1-sized block is loaded from memory once
and every variant's cast reads it from L1.

Each pass splits a chunk into parts whose number depends on the chunk's size only (``prange``
over the parts, taken by the threads one at a time; each part writes only its own outputs, summed
in part order, so the figures depend neither on thread timing nor on the thread count), each part
into blocks of ``_BLOCK`` elements with branch-free loops that LLVM vectorizes. Float32 input
takes kernels in 32-bit integer lanes (:func:`fp8sim._bitcast.add32` and friends: numba would
widen uint32 arithmetic to 64 bits and halve the lanes); float64 input the general kernels. Both
give the same figures on the same values, to the last bit (tested).
"""

from __future__ import annotations

import numba
import numpy as np

from numba.core import types
from numba.extending import overload

from fp8sim._bitcast import add32, and32, shr32
from fp8sim._bitcast import bits_f32 as _bits_f32
from fp8sim._bitcast import f32_bits as _f32_bits
from fp8sim._jit import jit_kernel, jit_serial
from fp8sim.abs_histogram import EXPONENT_MAX, EXPONENT_MIN

#: log2|x| histogram bins (floor(log2 float32(|x|)) - EXPONENT_MIN; the ends are sentinels)
N_LOG2 = EXPONENT_MAX - EXPONENT_MIN + 1
#: copies of the exponent-byte histogram a part scatters into (element k into copy k % 8): no
#: store-to-load chain on a hot bin
N_HIST_COPIES = 8


def _parts(n: int) -> int:
    """Parts of a chunk of n elements: 64 Ki elements or more each, at most 64, whatever the
    thread count (so the figures, summed part by part in order, do not depend on it). The
    threads take parts as they finish the previous one (``_run``): on a shared machine one slow
    thread then costs its share of the time, not half the pass."""
    return max(1, min(64, n // (1 << 16)))


def _run(kernel, *args) -> None:
    """Run a ``prange``-over-parts kernel with dynamic scheduling (one part at a time)."""
    with numba.parallel_chunksize(1):
        kernel(*args)


#: elements per inner block: the block, its float64 scratch and the histogram copies stay in L1
_BLOCK = 1024
_MAG = np.uint32(0x7FFFFFFF)  # float32 magnitude bits
_MIN_NORMAL32 = np.uint32(0x00800000)  # bits of 2**-126
_ONE = np.uint32(1)
_EXP_SHIFT = np.uint32(23)
# squares of |v| >= _BIG (float64 only) could overflow a sum: they are summed as (v * _DOWN)^2
# in a second, "high" sum worth _DOWN**-2 = 2**_HIGH_EXP times its value (see stats._combine);
# the low sum stays below 2**1023 for up to 2**63 elements, the high one too
_BIG = 2.0**480
_DOWN = 2.0**-540
_HIGH_EXP = 1080


@jit_serial
def _pairwise_sum(buf, m):
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


#: float64 lanes of a block's sum of squares: element k of a block adds into lane k % _LANES
_LANES = 64


@jit_serial
def _lane_sum(buf, m, lanes):
    """Sum of buf[:m] in the lane order: lane j adds buf[j], buf[j + 64], ... in turn (from
    0.0), then the 64 lanes are summed pairwise (:func:`_pairwise_sum`). The float32 scan
    accumulates its squares straight into lanes in this very order, so both give one value."""
    lanes[:] = 0.0
    q = m // _LANES
    for i in range(q):
        row = buf[i * _LANES : i * _LANES + _LANES]
        for j in range(_LANES):
            lanes[j] += row[j]
    for k in range(q * _LANES, m):
        lanes[k - q * _LANES] += buf[k]
    return _pairwise_sum(lanes, _LANES)


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
def _scan_block(xs, buf, lanes, hist, hsub):
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
    if nsub:  # rare: float32 subnormals, binned by their leading one
        for k in range(m):
            u = and32(_f32_bits(np.float32(xs[k])), _MAG)
            if u != np.uint32(0) and u < _MIN_NORMAL32:
                e = -150
                while u > np.uint32(0):
                    u >>= np.uint32(1)
                    e += 1
                hsub[e - EXPONENT_MIN] += 1
    return nan, inf, zero, mxb, _lane_sum(buf, m, lanes), sqh


@jit_serial
def _cast_block(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf):
    """The saturating RNE cast ``float32(float32(x) * sc)`` of one block and its figures.

    Works on float32 bit patterns: in the normal range the RNE rounding to m mantissa bits is the
    integer add ``(u + 2**(shift-1) - 1 + lsb) & keep`` (a carry moves into the exponent as it
    should); below ``min_normal`` the quantum is fixed and ``(a + csub) - csub`` rounds to it in
    float32 (csub = 2**(emin - m + 23)). Overflow: the rounded bits exceed max's bits (an inf
    product too). Branch-free so LLVM vectorizes it. Leaves ``(deq - x)^2`` of each element in
    ``buf[:m]`` (0 for NaN/inf inputs; the caller sums a whole block at once) and returns
    (overflow, underflow, subnormal, the "high" sum of squares too large for float64).
    """
    m = xs.size
    over = np.uint32(0)
    under = np.uint32(0)
    sub = np.uint32(0)
    big = np.uint32(0)
    for k in range(m):
        ax = abs(np.float64(xs[k]))
        fin = ax < np.inf
        a = np.float32(_bits_f32(and32(_f32_bits(np.float32(xs[k])), _MAG)) * sc)
        u = _f32_bits(a)
        ur = and32(add32(add32(u, half_m1), and32(shr32(u, shift), _ONE)), keep)
        us = _f32_bits((a + csub) - csub)
        qb = us if u < minnorm_bits else ur
        ovb = fin & (qb > max_bits)
        over = add32(over, ovb)
        under = add32(under, fin & (qb == np.uint32(0)) & (ax != 0.0))
        sub = add32(sub, fin & (qb != np.uint32(0)) & (qb < minnorm_bits))
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
            a = np.float32(np.float32(ax) * sc)
            u = _f32_bits(a)
            ur = and32(add32(add32(u, half_m1), and32(shr32(u, shift), _ONE)), keep)
            us = _f32_bits((a + csub) - csub)
            qb = us if u < minnorm_bits else ur
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
_MINUS1 = np.uint32(0xFFFFFFFF)


@jit_serial
def _scan_block_f32(xs, buf, lanes, hist, hsub):
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
        sq = _lane_sum(buf, m, lanes)
    else:  # squares straight into the lanes (the order of _lane_sum), rows of 64 vectorized
        lanes[:] = 0.0
        q = m // _LANES
        for i in range(q):
            row = xs[i * _LANES : i * _LANES + _LANES]
            for j in range(_LANES):
                mxb = max(mxb, and32(_f32_bits(row[j]), _MAG))
                v = np.float64(row[j])
                lanes[j] += v * v
        for k in range(q * _LANES, m):
            mxb = max(mxb, and32(_f32_bits(xs[k]), _MAG))
            v = np.float64(xs[k])
            lanes[k - q * _LANES] += v * v
        sq = _pairwise_sum(lanes, _LANES)
    if n_low:
        for k in range(m):
            zero += np.int64(and32(_f32_bits(xs[k]), _MAG) == np.uint32(0))
        if zero < n_low:  # float32 subnormals, binned by their leading one
            for k in range(m):
                u = and32(_f32_bits(xs[k]), _MAG)
                if u != np.uint32(0) and u < _MIN_NORMAL32:
                    e = -150
                    while u > np.uint32(0):
                        u >>= np.uint32(1)
                        e += 1
                    hsub[e - EXPONENT_MIN] += 1
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
    mn1 = add32(minnorm_bits, _MINUS1)
    c_min = _f32_bits(csub)
    c_add = np.uint32(shift << np.uint32(23))
    for k in range(m):
        ux = and32(_f32_bits(xs[k]), _MAG)
        a = np.float32(_bits_f32(ux) * sc)
        c = _bits_f32(max(add32(and32(_f32_bits(a), _INF_BITS), c_add), c_min))
        qb = _f32_bits((a + c) - c)
        top = max(top, qb)
        under = add32(under, (qb == np.uint32(0)) & (ux != np.uint32(0)))
        sub = add32(sub, add32(qb, _MINUS1) < mn1)
        dd = np.float64(np.float32(np.float32(_bits_f32(qb) * si) - _bits_f32(ux)))
        buf[k] = dd * dd
    if top > max_bits:  # an overflow, a NaN or an inf
        return _cast_block(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf)
    return np.uint32(0), under, sub, 0.0


def _scan(xs, buf, lanes, hist, hsub):
    """:func:`_scan_block` or, for float32 blocks, :func:`_scan_block_f32` (chosen at compile
    time, inside numba code only)."""
    raise NotImplementedError("numba-only dispatcher")


def _cast(xs, sc, si, shift, half_m1, keep, max_bits, minnorm_bits, csub, buf, fast32):
    """:func:`_cast_block` or, for float32 blocks of a format it takes (``fast32``),
    :func:`_cast_block_f32` (numba code only)."""
    raise NotImplementedError("numba-only dispatcher")


@overload(_scan)
def _scan_impl(xs, buf, lanes, hist, hsub):
    kernel = _scan_block_f32 if xs.dtype == types.float32 else _scan_block
    return lambda xs, buf, lanes, hist, hsub: kernel(xs, buf, lanes, hist, hsub)


@overload(_cast)
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
def _tensor_amax(xs):
    """(max float32 bits of the finite |x|, inf count) of a contiguous range (vectorized)."""
    mxb = np.uint32(0)
    inf = 0
    for k in range(xs.size):
        ax = abs(np.float64(xs[k]))
        u = and32(_f32_bits(np.float32(xs[k])), _MAG)
        mxb = max(mxb, u if ax < np.inf else np.uint32(0))
        inf += np.int64(ax == np.inf)
    return mxb, inf


@jit_serial
def _tile_amax(xs):
    """(max float32 bits of |x| over non-NaN elements (inf included), NaN count) of a tile."""
    mxb = np.uint32(0)
    nan = 0
    for k in range(xs.size):
        v = np.float64(xs[k])
        nan += np.int64(v != v)
        u = and32(_f32_bits(np.float32(v)), _MAG)
        mxb = max(mxb, u if v == v else np.uint32(0))
    return mxb, nan


@jit_serial
def _scan_range(x, s, e, buf, lanes, base, sig2, hist, hsub):
    """The format-independent figures of elements [s, e), block by block (``_BLOCK`` elements
    from s), added into base (nan, inf, zero, max float32 bits of the finite |x|), sig2 (low,
    high sum of x^2), hist and hsub (see :func:`_scan_block`)."""
    for b0 in range(s, e, _BLOCK):
        b1 = min(e, b0 + _BLOCK)
        n1, n2, n3, mb, q, qh = _scan(x[b0:b1], buf, lanes, hist, hsub)
        base[0] += n1
        base[1] += n2
        base[2] += n3
        base[3] = max(base[3], np.int64(mb))
        sig2[0] += q
        sig2[1] += qh


@jit_serial
def _part_a(x, s, e, i0, ncols, gran, local_off, gamax, gnan, out, scan, base, sig2, hist, hsub):
    """Pass A over elements [s, e) of the chunk: see :func:`_pass_a`."""
    if scan:
        _scan_range(x, s, e, np.empty(_BLOCK, np.float64), np.empty(_LANES, np.float64), base,
                    sig2, hist, hsub)  # fmt: skip
        out[0] = base[3]
        out[1] = base[1]
    else:
        mb, inf = _tensor_amax(x[s:e])
        out[0] = mb
        out[1] = inf
    if gran.shape[0] == 0:
        return
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


@jit_kernel
def _pass_a_kernel(x, n_parts, i0, ncols, gran, local_off, gamax, gnan, out, scan, base, sig2,
                   hist, hsub):  # fmt: skip
    per = (x.size + n_parts - 1) // n_parts
    for p in numba.prange(n_parts):
        s = min(x.size, p * per)
        e = min(x.size, s + per)
        _part_a(x, s, e, i0, ncols, gran, local_off, gamax[p], gnan[p], out[p], scan, base[p],
                sig2[p], hist[p], hsub[p])  # fmt: skip


def _scan_buffers(n_parts: int):
    """Per-part outputs of the format-independent figures (base, sig2, hist, hsub)."""
    return (np.zeros((n_parts, 4), np.int64), np.zeros((n_parts, 2), np.float64),
            np.zeros((n_parts, N_HIST_COPIES, 256), np.uint32),
            np.zeros((n_parts, N_LOG2), np.int64))  # fmt: skip


def _scan_totals(base, sig2, hist, hsub):
    """Sum the per-part format-independent figures (in part order): (tot (4,) = nan, inf, zero,
    float32 bits of the max finite |x|; sig2 (2,); log2 (N_LOG2,) the histogram)."""
    tot = base.sum(axis=0)
    tot[3] = base[:, 3].max() if base.shape[0] else 0
    nan, inf, zero = int(tot[0]), int(tot[1]), int(tot[2])
    by_byte = hist.sum(axis=(0, 1), dtype=np.int64)
    log2 = hsub.sum(axis=0)
    n_sub = int(log2.sum())
    # exponent byte b of a normal float32: floor(log2) = b - 127, bin b - 127 - EXPONENT_MIN
    log2[1 - 127 - EXPONENT_MIN : 255 - 127 - EXPONENT_MIN] += by_byte[1:255]
    log2[0] += by_byte[0] - zero - n_sub  # nonzero values whose float32 is 0
    log2[-1] += by_byte[255] - nan - inf  # finite values whose float32 is inf
    return tot, sig2.sum(axis=0), log2


def _pass_a(x, i0, ncols, gran, local_off, n_local, n_parts, scan=False):
    """The amaxes of one chunk: the tensor's and each tiled granularity's per group; with
    ``scan``, the format-independent figures as well (then pass B need not take them: pass A
    reads memory at the bandwidth's pace with the cores idle, pass B is bound by the casts).

    x: the chunk (float32/float64), flat C-order elements i0 .. i0+x.size of the (M, ncols) view.
    gran[g] = (R, C, Gc, first grid row of this chunk); granularity g's local grid starts at
    local_off[g] in a per-part buffer of n_local entries.
    Returns per part: tensor (P, 2) = (float32 bits of the max finite |float32(x)|, inf count);
    gamax (P, n_local) group amax as float32 bits (NaN skipped, inf counted); gnan (P, n_local)
    NaN counts; then, with ``scan``, :func:`_scan_totals` of the chunk, else None.
    """
    gamax = np.zeros((n_parts, n_local), np.uint32)
    gnan = np.zeros((n_parts, n_local), np.int64)
    out = np.zeros((n_parts, 2), np.int64)
    bufs = _scan_buffers(n_parts)
    _run(_pass_a_kernel, x, n_parts, i0, ncols, gran, local_off, gamax, gnan, out, scan, *bufs)
    return out, gamax, gnan, (_scan_totals(*bufs) if scan else None)


@jit_serial
def _part_b(x, s, e, i0, ncols, vint, vflt, scales, sinvs, scan, base, sig2, hist, hsub, counts,
            err2):  # fmt: skip
    """Pass B over elements [s, e) of the chunk: see :func:`_pass_b`."""
    buf = np.empty(_BLOCK, np.float64)
    lanes = np.empty(_LANES, np.float64)
    for b0 in range(s, e, _BLOCK):
        b1 = min(e, b0 + _BLOCK)
        if scan:
            _scan_range(x, b0, b1, buf, lanes, base, sig2, hist, hsub)
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
            whole = vint[v, 8] != 0  # one scale for the whole tensor: no tiles to walk
            fast32 = vint[v, 9] != 0
            j = b0
            r = (i0 + j) // ncols
            c = (i0 + j) - r * ncols
            while j < b1:
                if whole:
                    t = 0
                    n_el = b1 - j
                    row_base = vint[v, 3]
                else:
                    t = c // C
                    n_el = min(min((t + 1) * C, ncols) - c, b1 - j)
                    row_base = vint[v, 3] + (r // R - vint[v, 7]) * Gc
                sc = scales[row_base + t]
                si = sinvs[row_base + t]
                if si != si:  # NaN MX scale: the whole block is NaN
                    for k in range(j, j + n_el):
                        counts[v, 3] += np.int64(abs(np.float64(x[k])) < np.inf)
                        buf[k - b0] = 0.0
                else:
                    o, u, sb, qh = _cast(
                        x[j : j + n_el], sc, si, shift, half_m1, keep, max_bits, minnorm_bits,
                        csub, buf[j - b0 : j - b0 + n_el], fast32,
                    )  # fmt: skip
                    counts[v, 0] += o
                    counts[v, 1] += u
                    counts[v, 2] += sb
                    err2[v, 1] += qh
                j += n_el
                c += n_el
                if c == ncols:
                    c = 0
                    r += 1
            # the block's squared errors, whatever its tiles: one pairwise sum (a column tile of
            # one element per row would otherwise add them one by one)
            err2[v, 0] += _pairwise_sum(buf, b1 - b0)


@jit_kernel
def _pass_b_kernel(x, n_parts, i0, ncols, vint, vflt, scales, sinvs, scan, base, sig2, hist,
                   hsub, counts, err2):  # fmt: skip
    per = (x.size + n_parts - 1) // n_parts
    for p in numba.prange(n_parts):
        s = min(x.size, p * per)
        e = min(x.size, s + per)
        _part_b(x, s, e, i0, ncols, vint, vflt, scales, sinvs, scan, base[p], sig2[p], hist[p],
                hsub[p], counts[p], err2[p])  # fmt: skip


def _pass_b(x, i0, ncols, vint, vflt, scales, sinvs, n_parts, scan=True):
    """Every variant's figures over one chunk (one read) and, with ``scan``, the
    format-independent figures (when pass A did not take them).

    vint[v] = (R, C, Gc, scale offset, shift = 23 - mantissa bits, float32 bits of fmt.max,
    float32 bits of fmt.min_normal, first grid row of the chunk, 1 if one scale covers the whole
    tensor, 1 if float32 blocks may take :func:`_cast_block_f32`); vflt[v] = (2**(emin - m +
    23), fmt.max, fmt.min_normal). scales / sinvs: each variant's scale grid rows that the chunk
    touches, flat (float32), variant v's from offset vint[v, 3]. Returns, summed over the parts
    (in part order, so the figures depend only on the part count): :func:`_scan_totals` (None
    without ``scan``), counts (V, 4) = overflow, underflow, subnormal, lost; err2 (V, 2) = sum
    (deq - x)^2 as (low, high) pairs (see stats._combine).
    """
    nv = vint.shape[0]
    bufs = _scan_buffers(n_parts)
    counts = np.zeros((n_parts, nv, 4), np.int64)
    err2 = np.zeros((n_parts, nv, 2), np.float64)
    _run(_pass_b_kernel, x, n_parts, i0, ncols, vint, vflt, scales, sinvs, scan, *bufs, counts,
         err2)  # fmt: skip
    return (_scan_totals(*bufs) if scan else None), counts.sum(axis=0), err2.sum(axis=0)
