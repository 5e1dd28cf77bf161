"""fp8sim.analysis.stats_full (and the scan's full-block sum in analysis.stats_blocks) against
independent references.

The cast figures as thresholds on |x|'s bits (checked against a numpy RNE rounding, frexp/rint/
ldexp, on both sides of every threshold), the full-block cast against the general kernel (bit for
bit, sums included), the full-block sum of squares against the plain pairwise sum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fp8sim
from fp8sim.analysis.stats_blocks import _BLOCK, _cast_block, _pairwise_sum, _squares_full_block_f32
from fp8sim.analysis.stats_full import _cast_full_block_f32, _cast_full_pair_f32, _cast_thresholds

FORMATS = ["e4m3", "e5m2", "e3m4", "e4m3fnuz", "e5m2fnuz", "e2m1", "e3m2", "e2m3"]


def _params(fmt):
    """The kernel parameters stats.py builds for a format (shift, half_m1, keep, max bits,
    min_normal bits, csub)."""
    m = fmt.mantissa_bits
    shift = np.uint32(23 - m)
    return (shift, np.uint32((1 << (22 - m)) - 1), ~np.uint32((1 << (23 - m)) - 1),
            np.float32(fmt.max).view(np.uint32), np.float32(fmt.min_normal).view(np.uint32),
            np.float32(2.0 ** (fmt.emin - m + 23)))  # fmt: skip


def _numpy_rounded(ux, sc, fmt):
    """|x| * sc (a float32 product) rounded to nearest even on the format's grid, unbounded
    above (so values past max show as such): numpy's frexp/rint/ldexp in float64."""
    a = (np.asarray(ux, np.uint32).view(np.float32) * np.float32(sc)).astype(np.float64)
    _, e = np.frexp(a)
    e = np.maximum(e - 1, fmt.emin)  # the quantum's exponent, subnormals included
    m = fmt.mantissa_bits
    return np.ldexp(np.rint(np.ldexp(a, m - e)), e - m)


def _scales(rng, fmt):
    amax = np.float32(np.abs(rng.standard_normal()) * 2.0 ** rng.integers(-20, 20))
    return [np.float32(1), np.float32(2.0**-7), np.float32(2.0**9),
            np.float32(np.float32(fmt.max) / amax), np.float32(3e-30), np.float32(1e30),
            np.float32(rng.uniform(0.5, 2.0))]  # fmt: skip


@pytest.mark.parametrize("name", FORMATS)
def test_thresholds_split_the_magnitudes_where_numpy_rounding_does(name):
    fmt = fp8sim.get_format(name)
    shift, half_m1, keep, max_bits, mn_bits, csub = _params(fmt)
    rng = np.random.default_rng(1)
    checked = 0
    for sc in _scales(rng, fmt):
        thr = np.zeros(3, np.int64)
        _cast_thresholds(sc, shift, half_m1, keep, max_bits, mn_bits, csub, thr)
        assert 0 <= thr[0] <= thr[1] <= thr[2] <= 0x7F7FFFFF
        tests = [lambda q: q == 0, lambda q: q < fmt.min_normal, lambda q: q <= fmt.max]
        for t, holds in zip(thr, tests):
            # every magnitude in a window around the threshold, and a spread below and above
            near = np.arange(max(0, t - 300), min(0x7F7FFFFF, t + 300) + 1)
            spread = np.concatenate([rng.integers(0, t + 1, 200), rng.integers(t, 0x7F7FFFFF + 1, 200)])
            ux = np.concatenate([near, spread, [0, t, 0x7F7FFFFF]]).astype(np.uint32)
            with np.errstate(over="ignore"):
                q = _numpy_rounded(ux, sc, fmt)
            assert (holds(q) == (ux <= t)).all(), (name, sc, t)
            checked += ux.size
    assert checked > 10_000


def _block(rng, kind):
    x = (rng.standard_normal(_BLOCK) * np.exp2(rng.integers(-30, 10, _BLOCK))).astype(np.float32)
    x[rng.integers(0, _BLOCK, 20)] = 0.0
    x[rng.integers(0, _BLOCK, 10)] = np.float32(2.0**-140) * rng.integers(1, 100, 10)  # subnormal
    if kind == "overflow":
        x[rng.integers(0, _BLOCK)] = 1e30
    elif kind == "nan":
        x[rng.integers(0, _BLOCK)] = np.nan
    elif kind == "inf":
        x[rng.integers(0, _BLOCK)] = -np.inf
    return x


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["plain", "overflow", "nan", "inf"])
def test_full_block_cast_equals_the_general_kernel(name, kind):
    fmt = fp8sim.get_format(name)
    shift, half_m1, keep, max_bits, mn_bits, csub = _params(fmt)
    rng = np.random.default_rng(2)
    buf = np.zeros(_BLOCK)
    buf2 = np.zeros(_BLOCK)
    seen_under = seen_sub = 0
    for trial in range(6):
        x = _block(rng, kind)
        fin = np.isfinite(x)
        amax = np.float32(np.abs(x[fin]).max()) if kind == "plain" else np.float32(2.0**9)
        for sc in (np.float32(np.float32(fmt.max) / amax), np.float32(2.0**-3), np.float32(1.7)):
            si = np.float32(1) / sc
            thr = np.zeros(3, np.int64)
            _cast_thresholds(sc, shift, half_m1, keep, max_bits, mn_bits, csub, thr)
            # magnitudes right at and just past each threshold, in every quarter of the block
            xb = x.copy()
            edges = np.array([thr[0], thr[0] + 1, thr[1], thr[1] + 1, thr[2]], np.uint32)
            for q in range(4):
                at = q * (_BLOCK // 4) + rng.choice(_BLOCK // 4, edges.size, replace=False)
                xb[at] = edges.view(np.float32) * rng.choice([-1, 1], edges.size).astype(np.float32)
            nxt = x[::-1].copy() if trial % 2 else x[:0]  # what it prefetches changes nothing
            top, under, sub, err = _cast_full_block_f32(xb, nxt, sc, si, shift, csub, thr, buf)
            ok = top <= thr[2]
            assert top == np.abs(xb).view(np.uint32).max()
            over, u2, s2, qh = _cast_block(xb, sc, si, shift, half_m1, keep, max_bits, mn_bits,
                                           csub, buf2)  # fmt: skip
            # handed back exactly when the general kernel sees an overflow, a NaN or an inf
            assert ok == (over == 0 and np.isfinite(xb).all())
            assert kind == "plain" or not ok  # 1e30 overflows under every scale here
            if ok:
                assert qh == 0.0
                assert (under, sub) == (u2, s2)
                assert err == _pairwise_sum(buf2, _BLOCK)  # the same float64 sum, bit for bit
                seen_under += under - int((xb == 0).sum())  # the counts include the zeros
                seen_sub += sub - under
    if kind == "plain":
        assert seen_under > 0 and seen_sub > 0


def test_full_block_squares_equal_the_pairwise_sum():
    rng = np.random.default_rng(3)
    buf = np.zeros(_BLOCK)
    for _ in range(20):
        x = (rng.standard_normal(_BLOCK) * np.exp2(rng.integers(-60, 60, _BLOCK))).astype(np.float32)
        mxb, sq = _squares_full_block_f32(x, buf)
        x64 = x.astype(np.float64)
        assert mxb == np.abs(x).max().view(np.uint32)
        assert sq == _pairwise_sum(x64 * x64, _BLOCK)  # bit for bit
        assert sq == pytest.approx(math.fsum((x64 * x64).tolist()), rel=1e-14)


@pytest.mark.parametrize("pair", [("e4m3", "e5m2"), ("e2m1", "e4m3fnuz"), ("e3m4", "e3m4")])
def test_paired_cast_equals_two_single_casts(pair):
    # two variants in one read: each one's figures are the single kernel's, bit for bit
    rng = np.random.default_rng(4)
    fmts = [fp8sim.get_format(n) for n in pair]
    bufs = [np.zeros(_BLOCK) for _ in range(4)]
    for trial in range(8):
        x = _block(rng, "overflow" if trial == 7 else "plain")
        amax = np.float32(np.abs(x).max())
        args = []
        for f, extra in zip(fmts, (1.0, 0.37)):
            shift, half_m1, keep, max_bits, mn_bits, csub = _params(f)
            sc = np.float32(np.float32(f.max) / amax * np.float32(extra))
            thr = np.zeros(3, np.int64)
            _cast_thresholds(sc, shift, half_m1, keep, max_bits, mn_bits, csub, thr)
            args.append((sc, np.float32(1) / sc, shift, csub, thr))
        top, ua, sa, ea, ub, sb, eb = _cast_full_pair_f32(x, x[:0], *args[0], *args[1], bufs[0], bufs[1])
        one_a = _cast_full_block_f32(x, x[:0], *args[0], bufs[2])
        one_b = _cast_full_block_f32(x, x[:0], *args[1], bufs[3])
        assert (top, ua, sa, ea) == one_a and (top, ub, sb, eb) == one_b
