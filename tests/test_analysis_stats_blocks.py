"""The block kernels of fp8sim.analysis.stats against independent references.

The cast counts split |x|'s bits where a numpy RNE rounding (frexp/rint/ldexp) does, on both
sides of every rounding edge; float32 blocks (the 32-bit kernels) give the float64 blocks' figures
(the general kernel) bit for bit, sums included, edges, overflows, NaNs and infs among them;
variants cast from one read give each variant's figures alone; the scan's full-block sum of
squares equals the plain pairwise sum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fp8sim
from fp8sim.analysis.stats import Variant, tensor_stats
from fp8sim.analysis.stats.blocks import BLOCK as _BLOCK, pairwise_sum as _pairwise_sum, _squares_full_block_f32
from fp8sim.scaling import scale_from_amax

FORMATS = ["e4m3", "e5m2", "e3m4", "e4m3fnuz", "e5m2fnuz", "e2m1", "e3m2", "e2m3"]


def _numpy_rounded(ux, sc, fmt):
    """|x| * sc (a float32 product) rounded to nearest even on the format's grid, unbounded
    above (so values past max show as such): numpy's frexp/rint/ldexp in float64."""
    a = (np.asarray(ux, np.uint32).view(np.float32) * np.float32(sc)).astype(np.float64)
    _, e = np.frexp(a)
    e = np.maximum(e - 1, fmt.emin)  # the quantum's exponent, subnormals included
    m = fmt.mantissa_bits
    return np.ldexp(np.rint(np.ldexp(a, m - e)), e - m)


def _edges(sc, fmt, top):
    """The float32 magnitude bits, at most ``top``, where numpy's rounding of ``|x| * sc`` stops
    rounding to 0, stops rounding below min_normal and starts overflowing (bisection over the
    bits: the rounding is non-decreasing in them)."""
    tests = [lambda q: q == 0, lambda q: q < fmt.min_normal, lambda q: q <= fmt.max]
    out = []
    for holds in tests:
        lo, hi = 0, int(top)
        with np.errstate(over="ignore"):
            if holds(_numpy_rounded([hi], sc, fmt))[0]:
                out.append(hi)
                continue
            while hi - lo > 1:  # invariant: lo holds, hi does not
                mid = (lo + hi) // 2
                if holds(_numpy_rounded([mid], sc, fmt))[0]:
                    lo = mid
                else:
                    hi = mid
        out.append(lo)
    return out


def _numpy_counts(x, sc, fmt):
    """(overflow, underflow, subnormal) of the saturating cast of float32 ``x`` times ``sc``, by
    numpy's rounding."""
    fin = np.isfinite(x)
    ux = np.abs(x[fin]).view(np.uint32)
    with np.errstate(over="ignore"):
        q = _numpy_rounded(ux, sc, fmt)
    return (int((q > fmt.max).sum()), int(((ux != 0) & (q == 0)).sum()),
            int(((q > 0) & (q < fmt.min_normal)).sum()))  # fmt: skip


@pytest.mark.parametrize("name", FORMATS)
def test_counts_split_the_magnitudes_where_numpy_rounding_does(name):
    # tensor scaling with several amaxes and margins (a negative margin makes values overflow):
    # magnitudes in a window around each rounding edge and a spread below and above it
    fmt = fp8sim.get_format(name)
    rng = np.random.default_rng(1)
    checked = 0
    for amax_exp, margin in ((0, 0.0), (-20, -3.0), (15, 2.0), (-5, -1.0), (8, 0.0)):
        amax = np.float32(np.abs(rng.standard_normal()) * 2.0**amax_exp + 2.0**amax_exp)
        sc = np.float32(scale_from_amax(amax, fmt, margin=margin))
        top = int(amax.view(np.uint32))
        parts = [np.array([0, top], np.int64)]
        for t in _edges(sc, fmt, top):
            parts.append(np.arange(max(0, t - 300), min(top, t + 300) + 1))
            parts.append(rng.integers(0, t + 1, 200))
            parts.append(rng.integers(t, top + 1, 200))
        ux = np.concatenate(parts).astype(np.uint32)
        x = ux.view(np.float32) * rng.choice([-1, 1], ux.size).astype(np.float32)
        st = tensor_stats(x, [Variant(fmt, "tensor", margin)])
        v = st.variants[0]
        assert v.scale == float(sc)
        assert (v.overflow, v.underflow, v.subnormal) == _numpy_counts(x, sc, fmt), (name, amax, margin)
        checked += ux.size
    assert checked > 10_000


def _block(rng, kind, n=4 * _BLOCK):
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 10, n))).astype(np.float32)
    x[rng.integers(0, n, 20)] = 0.0
    x[rng.integers(0, n, 10)] = np.float32(2.0**-140) * rng.integers(1, 100, 10)  # subnormal
    if kind == "overflow":
        x[rng.integers(0, n)] = 1e30
    elif kind == "nan":
        x[rng.integers(0, n)] = np.nan
    elif kind == "inf":
        x[rng.integers(0, n)] = -np.inf
    return x


def _figures(st):
    return ((st.nan, st.inf, st.zero, st.amax, st.sig2, st.log2_counts.tolist()),
            [(v.overflow, v.underflow, v.subnormal, v.lost, v.err2, v.scale) for v in st.variants])  # fmt: skip


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["plain", "overflow", "nan", "inf"])
def test_float32_blocks_equal_the_general_kernel_at_the_rounding_edges(name, kind):
    # float32 input takes the 32-bit kernels (a block with an overflow, a NaN or an inf redone by
    # the general one); the same values as float64 take the general kernel: the same figures, the
    # sums to the last bit, with magnitudes right at and just past each edge in every block
    fmt = fp8sim.get_format(name)
    rng = np.random.default_rng(2)
    seen_under = seen_sub = seen_over = 0
    for trial in range(3):
        x = _block(rng, kind)
        amax = np.float32(np.abs(x[np.isfinite(x)]).max())
        for margin in (0.0, 3.0, -2.5):
            sc = np.float32(scale_from_amax(amax, fmt, margin=margin))
            edges = np.array([t + d for t in _edges(sc, fmt, 0x7F7FFFFF) for d in (0, 1)], np.uint32)
            xb = x.copy()
            for q in range(xb.size // (_BLOCK // 4)):
                at = q * (_BLOCK // 4) + rng.choice(_BLOCK // 4, edges.size, replace=False)
                xb[at] = edges.view(np.float32) * rng.choice([-1, 1], edges.size).astype(np.float32)
            vs = [Variant(fmt, "tensor", margin), Variant(fmt, "none")]
            a = tensor_stats(xb, vs)
            b = tensor_stats(xb.astype(np.float64), vs)
            assert _figures(a) == _figures(b)
            v = a.variants[0]
            seen_under += v.underflow
            seen_sub += v.subnormal
            seen_over += v.overflow
    if kind == "plain":
        assert seen_under > 0 and seen_sub > 0 and seen_over > 0


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
def test_variants_cast_from_one_read_equal_each_alone(pair):
    # every variant casts each block from one read: each one's figures are its figures alone,
    # bit for bit
    rng = np.random.default_rng(4)
    fmts = [fp8sim.get_format(n) for n in pair]
    for trial in range(4):
        x = _block(rng, "overflow" if trial == 3 else "plain")
        vs = [Variant(fmts[0], "tensor"), Variant(fmts[1], "tensor", 1.4)]
        both = _figures(tensor_stats(x, vs))
        for k, v in enumerate(vs):
            alone = _figures(tensor_stats(x, [v]))
            assert both[0] == alone[0] and both[1][k] == alone[1][0]
