"""The numba passes behind :func:`analysis.stats.tensor_stats` (see its module docstring).

Pass A (format-independent figures and per-group amaxes) and pass B (every variant's cast
figures at once), each split into parts run on threads, each part into L1-sized blocks with
branch-free loops; the cast works on float32 bit patterns.
"""

from __future__ import annotations

import numba
import numpy as np

from fp8sim._bitcast import bits_f32 as _bits_f32
from fp8sim._bitcast import f32_bits as _f32_bits
from fp8sim._jit import jit_serial
from fp8sim.abs_histogram import EXPONENT_MAX, EXPONENT_MIN

# ------------------------------------------------------------------------------------------
# numba kernels
# ------------------------------------------------------------------------------------------


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
