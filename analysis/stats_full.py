"""The cast figures of full float32 blocks under one scale for the whole tensor (the common case:
tensor scaling, or none), faster than :func:`analysis.stats_blocks._cast_block_f32` and equal to
it, bit for bit, sums included.

- The counts need no rounded value: for a positive finite scale the rounding is non-decreasing
  in |x|'s bits ``ux``, so "rounds to 0", "rounds below min_normal" and "does not overflow" are
  ``ux <= t`` for thresholds that :func:`_cast_thresholds` finds once per part by bisection over
  the exact rounding (:func:`analysis.stats_blocks._round_bits`); each count is one comparison
  per element (zeros included, as every cast kernel counts them: stats.py takes them off).
- A block of ``_BLOCK`` elements is read as four quarters side by side: element k with k + 256,
  k + 512 and k + 768. Their squared errors fold in registers into the first two levels of the
  block's pairwise sum, ``(e[k] + e[k+512]) + (e[k+256] + e[k+768])``, so the sum is the very value
  :func:`analysis.stats_blocks._pairwise_sum` gives over the block's errors.
- Two variants (e4m3 and e5m2, say) share one read of the block (:func:`_cast_full_pair_f32`).
- The hardware prefetcher does not follow four short streams, so the loop asks for the next
  block's cache lines as it goes (measured: without it the kernel took twice its in-cache time
  reading from memory).

The kernels return the block's largest ``ux``: a block where it exceeds a variant's no-overflow
threshold (an overflow, a NaN or an inf) is redone by the general kernel for that variant.
"""

from __future__ import annotations

import numpy as np
from numba.core import types
from numba.extending import overload

from fp8sim.analysis.stats_blocks import _BLOCK, _INF_BITS, _MAG, _QUARTER, _pairwise_sum, _round_bits
from fp8sim._numba.bitcast import add32, and32
from fp8sim._numba.bitcast import bits_f32 as _bits_f32
from fp8sim._numba.bitcast import f32_bits as _f32_bits
from fp8sim._numba.jit import jit_inline, jit_serial
from fp8sim._numba.fma import square_add
from fp8sim._numba.prefetch import prefetch

_LARGEST_FINITE = np.uint32(0x7F7FFFFF)  # bits of float32's max
_ONE = np.uint32(1)
#: elements of a float32 cache line (64 bytes)
_LINE32 = 16
#: steps of the quarter loop between prefetches (a sixteenth of the next block each: a block's
#: worth in all); 64 rather than 16 restarts the vectorized inner loop (and its reductions) a
#: quarter as often (1.03-1.04x end to end, interleaved), fewer would ask for too much at once
_STEP = 64


@jit_serial
def _last_below(limit, sc, shift, half_m1, keep, minnorm_bits, csub):
    """The largest finite float32 magnitude bits ``ux`` whose :func:`_round_bits` is below
    ``limit`` (a bisection: the rounding is non-decreasing in ``ux``, and 0 rounds to 0)."""
    lo = np.uint32(0)
    hi = _LARGEST_FINITE
    if _round_bits(hi, sc, shift, half_m1, keep, minnorm_bits, csub) < limit:
        return hi
    while hi - lo > np.uint32(1):  # invariant: lo below the limit, hi not
        mid = np.uint32(lo + (hi - lo) // np.uint32(2))
        if _round_bits(mid, sc, shift, half_m1, keep, minnorm_bits, csub) < limit:
            lo = mid
        else:
            hi = mid
    return lo


@jit_serial
def _cast_thresholds(sc, shift, half_m1, keep, max_bits, minnorm_bits, csub, out):
    """The cast's figures of a float32 as thresholds on its magnitude bits ``ux``, for one
    positive finite scale ``sc``: ``out[0]`` the largest ux that rounds to 0, ``out[1]`` the
    largest that rounds below ``min_normal``, ``out[2]`` the largest that does not overflow.
    So, for finite x: underflow iff 0 < ux <= out[0], subnormal iff out[0] < ux <= out[1],
    overflow iff ux > out[2] (exactly :func:`analysis.stats_blocks._cast_block`'s tests)."""
    out[0] = _last_below(_ONE, sc, shift, half_m1, keep, minnorm_bits, csub)
    out[1] = _last_below(minnorm_bits, sc, shift, half_m1, keep, minnorm_bits, csub)
    out[2] = _last_below(np.uint32(max_bits + _ONE), sc, shift, half_m1, keep, minnorm_bits,
                         csub)  # fmt: skip


@jit_inline
def _err_f32(ux, sc, si, c_add, c_min):
    """``deq - |x|`` (float32, exact) of one float32 magnitude ``ux`` that does not overflow,
    through the FPU rounding of :func:`analysis.stats_blocks._cast_block_f32` (see there)."""
    a = np.float32(_bits_f32(ux) * sc)
    c = _bits_f32(max(add32(and32(_f32_bits(a), _INF_BITS), c_add), c_min))
    return np.float32(np.float32(((a + c) - c) * si) - _bits_f32(ux))


@jit_inline
def _err_sq4(u0, u1, u2, u3, sc, si, c_add, c_min):
    """``(e0 + e2) + (e1 + e3)`` of four quarters' squared errors (float64): two pairwise levels.
    ``e0 + e2`` is ``square_add(d0, e2)``, one fused operation with the same value (the square of
    a float32 is exact in float64: :mod:`fp8sim._fma`)."""
    d2 = np.float64(_err_f32(u2, sc, si, c_add, c_min))
    d3 = np.float64(_err_f32(u3, sc, si, c_add, c_min))
    return (square_add(_err_f32(u0, sc, si, c_add, c_min), d2 * d2)
            + square_add(_err_f32(u1, sc, si, c_add, c_min), d3 * d3))  # fmt: skip


@jit_inline
def _at_most4(u0, u1, u2, u3, t):
    """How many of u0..u3 are at most t (one comparison each)."""
    return add32(add32(u0 <= t, u1 <= t), add32(u2 <= t, u3 <= t))


@jit_inline
def _fpu_consts(shift, csub):
    """(c_add, c_min) of :func:`_err_f32` for a format: the exponent offset of the rounding
    constant, and the bits of the fixed subnormal one."""
    return np.uint32(shift << np.uint32(23)), _f32_bits(csub)


@jit_inline
def _quarters(xs):
    return (xs[:_QUARTER], xs[_QUARTER : 2 * _QUARTER], xs[2 * _QUARTER : 3 * _QUARTER],
            xs[3 * _QUARTER : 4 * _QUARTER])  # fmt: skip


@jit_inline
def _magnitudes4(x0, x1, x2, x3, k):
    """Element k of each quarter as |x|'s float32 bits, and the largest of the four."""
    u0 = and32(_f32_bits(x0[k]), _MAG)
    u1 = and32(_f32_bits(x1[k]), _MAG)
    u2 = and32(_f32_bits(x2[k]), _MAG)
    u3 = and32(_f32_bits(x3[k]), _MAG)
    return u0, u1, u2, u3, max(max(u0, u1), max(u2, u3))


@jit_inline
def _prefetch_step(nxt, g):
    """At step g of the quarter loop, ask for 4 of the next block's lines (all by the end)."""
    n = nxt.size
    if n:
        for j in range(_STEP // 4):
            prefetch(nxt, min(n - 1, 4 * g + _LINE32 * j))


@jit_serial
def _cast_full_block_f32(xs, nxt, sc, si, shift, csub, thr, buf):
    """One variant's figures of a full float32 block (``_BLOCK`` elements) under one scale, with
    the thresholds ``thr`` of :func:`_cast_thresholds`: (largest ux, underflow, subnormal, sum of
    (deq - x)^2), the counts as :func:`analysis.stats_blocks._cast_block`'s (zeros included).
    Valid when the largest ux is at most ``thr[2]``. ``nxt``: the next block (or an empty
    slice), prefetched."""
    c_add, c_min = _fpu_consts(shift, csub)
    t0 = np.uint32(thr[0])
    t1 = np.uint32(thr[1])
    x0, x1, x2, x3 = _quarters(xs)
    under = np.uint32(0)
    sub = np.uint32(0)
    top = np.uint32(0)
    for g in range(0, _QUARTER, _STEP):
        _prefetch_step(nxt, g)
        for k in range(g, g + _STEP):
            u0, u1, u2, u3, m4 = _magnitudes4(x0, x1, x2, x3, k)
            top = max(top, m4)
            under = add32(under, _at_most4(u0, u1, u2, u3, t0))  # rounds to 0
            sub = add32(sub, _at_most4(u0, u1, u2, u3, t1))  # rounds below min_normal
            buf[k] = _err_sq4(u0, u1, u2, u3, sc, si, c_add, c_min)
    return top, under, sub, _pairwise_sum(buf, _QUARTER)


@jit_serial
def _cast_full_pair_f32(xs, nxt, sc_a, si_a, shift_a, csub_a, thr_a, sc_b, si_b, shift_b, csub_b,
                        thr_b, buf_a, buf_b):  # fmt: skip
    """:func:`_cast_full_block_f32` for two variants in one read of the block: (largest ux,
    underflow a, subnormal a, sum a, underflow b, subnormal b, sum b)."""
    c_add_a, c_min_a = _fpu_consts(shift_a, csub_a)
    c_add_b, c_min_b = _fpu_consts(shift_b, csub_b)
    t0_a = np.uint32(thr_a[0])
    t0_b = np.uint32(thr_b[0])
    t1_a = np.uint32(thr_a[1])
    t1_b = np.uint32(thr_b[1])
    x0, x1, x2, x3 = _quarters(xs)
    under_a = np.uint32(0)
    under_b = np.uint32(0)
    sub_a = np.uint32(0)
    sub_b = np.uint32(0)
    top = np.uint32(0)
    for g in range(0, _QUARTER, _STEP):
        _prefetch_step(nxt, g)
        for k in range(g, g + _STEP):
            u0, u1, u2, u3, m4 = _magnitudes4(x0, x1, x2, x3, k)
            top = max(top, m4)
            under_a = add32(under_a, _at_most4(u0, u1, u2, u3, t0_a))
            under_b = add32(under_b, _at_most4(u0, u1, u2, u3, t0_b))
            sub_a = add32(sub_a, _at_most4(u0, u1, u2, u3, t1_a))
            sub_b = add32(sub_b, _at_most4(u0, u1, u2, u3, t1_b))
            buf_a[k] = _err_sq4(u0, u1, u2, u3, sc_a, si_a, c_add_a, c_min_a)
            buf_b[k] = _err_sq4(u0, u1, u2, u3, sc_b, si_b, c_add_b, c_min_b)
    return (top, under_a, sub_a, _pairwise_sum(buf_a, _QUARTER), under_b, sub_b,
            _pairwise_sum(buf_b, _QUARTER))  # fmt: skip


_NONE = np.uint32(0xFFFFFFFF)  # "largest ux" of a block the float32 kernels do not take


def _cast_full(xs, nxt, sc, si, shift, csub, thr, buf):
    """:func:`_cast_full_block_f32` for a float32 block; for float64 blocks a largest ux above
    every threshold (the general kernel takes them) (numba code only)."""
    raise NotImplementedError("numba-only dispatcher")


def _cast_full_pair(xs, nxt, sc_a, si_a, shift_a, csub_a, thr_a, sc_b, si_b, shift_b, csub_b,
                    thr_b, buf_a, buf_b):  # fmt: skip
    """:func:`_cast_full_pair_f32` for a float32 block, as :func:`_cast_full` (numba only)."""
    raise NotImplementedError("numba-only dispatcher")


@overload(_cast_full)
def _cast_full_impl(xs, nxt, sc, si, shift, csub, thr, buf):
    if xs.dtype == types.float32:
        return lambda xs, nxt, sc, si, shift, csub, thr, buf: _cast_full_block_f32(
            xs, nxt, sc, si, shift, csub, thr, buf
        )
    return lambda xs, nxt, sc, si, shift, csub, thr, buf: (_NONE, _NONE, _NONE, 0.0)


@overload(_cast_full_pair)
def _cast_full_pair_impl(xs, nxt, sc_a, si_a, shift_a, csub_a, thr_a, sc_b, si_b, shift_b,
                         csub_b, thr_b, buf_a, buf_b):  # fmt: skip
    if xs.dtype == types.float32:
        def impl(xs, nxt, sc_a, si_a, shift_a, csub_a, thr_a, sc_b, si_b, shift_b, csub_b, thr_b,
                 buf_a, buf_b):  # fmt: skip
            return _cast_full_pair_f32(xs, nxt, sc_a, si_a, shift_a, csub_a, thr_a, sc_b, si_b,
                                       shift_b, csub_b, thr_b, buf_a, buf_b)  # fmt: skip

        return impl

    def none(xs, nxt, sc_a, si_a, shift_a, csub_a, thr_a, sc_b, si_b, shift_b, csub_b, thr_b,
             buf_a, buf_b):  # fmt: skip
        return _NONE, _NONE, _NONE, 0.0, _NONE, _NONE, 0.0

    return none


# the prefetches of one block's loop (4 lines per step) cover the next block's lines
assert _QUARTER % _STEP == 0 and _BLOCK // _LINE32 == (_STEP // 4) * (_QUARTER // _STEP)
