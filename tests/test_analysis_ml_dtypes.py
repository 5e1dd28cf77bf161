"""fp8sim.analysis.stats against an independent reference: the casts of ml_dtypes (RNE from float32, an
independent library) with the scale rules written out from their definitions (docs/numerics.md; OCP MX
v1.0 for the shared scale), numpy for the sums. Nothing of fp8sim is used to make the expected
figures, so these tests do not inherit a bug of the emulator the way the emulator-based ones
(tests/test_analysis_stats.py) could.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from fp8sim.analysis.stats import parse_variants, tensor_stats

#: format -> (ml_dtypes type, max, min_normal, emax, mantissa bits, overflow rule of ml_dtypes:
#: "nonfinite" = it returns inf/NaN, "saturate" = it clamps to +-max)
FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 2.0**-6, 8, 3, "nonfinite"),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 2.0**-14, 15, 2, "nonfinite"),
    "e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, 240.0, 2.0**-7, 7, 3, "nonfinite"),
    "e5m2fnuz": (ml_dtypes.float8_e5m2fnuz, 57344.0, 2.0**-15, 15, 2, "nonfinite"),
    "e3m4": (ml_dtypes.float8_e3m4, 15.5, 2.0**-2, 3, 4, "nonfinite"),
    "e4m3b11fnuz": (ml_dtypes.float8_e4m3b11fnuz, 30.0, 2.0**-10, 4, 3, "nonfinite"),
    "e3m2": (ml_dtypes.float6_e3m2fn, 28.0, 2.0**-2, 4, 2, "saturate"),
    "e2m3": (ml_dtypes.float6_e2m3fn, 7.5, 1.0, 2, 3, "saturate"),
    "e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 1.0, 2, 1, "saturate"),
}
F32_MAX = np.float32(np.finfo(np.float32).max)


def group_ids(shape, scaling):
    """Each element's group index (C order) and the groups' count, from the scaling's tiling."""
    m, n = shape
    if scaling == "tensor":
        r, c = m, n
    elif scaling == "row":
        r, c = 1, n
    elif scaling == "mx":
        r, c = 1, 32
    else:  # block:RxC
        r, c = (int(v) for v in scaling.split(":")[1].split("x"))
    gc = -(-n // c)
    rows, cols = np.meshgrid(np.arange(m), np.arange(n), indexing="ij")
    return (rows // r) * gc + cols // c, gc * -(-m // r)


def multipliers(amax, fmt, scaling):
    """float32 multiplier per group: fl(fl(max) / amax) (amax 0 -> 1, inf -> float32 max); MX:
    1 / X with X = 2**(floor(log2 amax) - emax), clamped to 2**[-127, 127], amax 0 -> 2**-127."""
    _, fmax, _, emax, _, _ = FORMATS[fmt]
    amax = amax.astype(np.float32)
    if scaling == "mx":
        e = np.zeros(amax.shape, np.int64)
        pos = amax > 0
        e[pos] = np.floor(np.log2(amax[pos].astype(np.float64))).astype(np.int64) - emax
        e[~pos] = -127
        e = np.clip(e, -127, 127)
        return (1.0 / np.exp2(e.astype(np.float64))).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        s = (np.float32(fmax) / np.where(amax > 0, amax, np.float32(1))).astype(np.float32)
    s = np.where(np.isinf(s), F32_MAX, s)
    return np.where(amax > 0, s, np.float32(1)).astype(np.float32)


def expected(x, fmt, scaling):
    """(overflow, underflow, subnormal, err2, smallest multiplier) of one variant."""
    dt, fmax, min_normal, emax, mbits, rule = FORMATS[fmt]
    gid, ng = group_ids(x.shape, scaling)
    amax = np.zeros(ng, np.float32)
    np.maximum.at(amax, gid.ravel(), np.abs(x).ravel())
    mult = multipliers(amax, fmt, scaling)
    y = (x * mult[gid]).astype(np.float32)  # one float32 rounding
    q = y.astype(dt).astype(np.float64)  # ml_dtypes: RNE from float32
    if rule == "nonfinite":
        over = ~np.isfinite(q)
    else:  # the largest finite magnitude has an odd significand: its half-ulp tie rounds up
        over = np.abs(y.astype(np.float64)) >= fmax + 2.0 ** (emax - mbits) / 2
    q = np.where(over, np.copysign(fmax, y), q)  # saturating cast
    sinv = (np.float32(1) / mult).astype(np.float32)  # MX: X itself (a power of two)
    deq = (q * sinv[gid].astype(np.float64)).astype(np.float32).astype(np.float64)
    x64 = x.astype(np.float64)
    under = int(((x != 0) & (q == 0)).sum())
    sub = int(((q != 0) & (np.abs(q) < min_normal)).sum())
    err2 = math.fsum(((deq - x64) ** 2).ravel().tolist())
    return int(over.sum()), under, sub, err2, float(mult.min())


def data(rng, shape):
    """Values over ~50 binades with zeros and a few exact ties of the narrow formats."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 20, shape))
    x = x.astype(np.float32)
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, 7)] = 0
    return x


SCALINGS = ["tensor", "row", "block:1x32", "block:8x8"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_scaled_figures_equal_ml_dtypes(fmt):
    rng = np.random.default_rng(2026)
    x = data(rng, (37, 70))  # groups that do not divide the shape
    scalings = SCALINGS + (["mx"] if fmt in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1") else [])
    st = tensor_stats(x, parse_variants([fmt], scalings), chunk=999)
    x64 = x.astype(np.float64)
    sig2 = math.fsum((x64**2).ravel().tolist())
    assert st.sig2 == pytest.approx(sig2, rel=1e-12, abs=0)
    assert st.amax == float(np.abs(x).max())
    for sc, r in zip(scalings, st.variants):
        over, under, sub, err2, smin = expected(x, fmt, sc)
        assert (r.overflow, r.underflow, r.subnormal) == (over, under, sub), (fmt, sc)
        assert r.err2 == pytest.approx(err2, rel=1e-12, abs=0), (fmt, sc)
        assert r.sqnr_db == pytest.approx(10 * math.log10(sig2 / err2), rel=1e-12), (fmt, sc)
        assert r.scale == smin, (fmt, sc)


def test_the_reference_sees_every_figure():
    """The data above exercise every count (so the equalities above are not 0 == 0)."""
    rng = np.random.default_rng(2026)
    x = data(rng, (37, 70))
    seen = np.zeros(3, bool)
    for fmt in FORMATS:
        for sc in SCALINGS + ["mx"]:
            if sc == "mx" and fmt not in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1"):
                continue
            over, under, sub, _, _ = expected(x, fmt, sc)
            seen |= np.array([over, under, sub]) > 0
    assert seen.all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_large_tensor_scaled_against_ml_dtypes(fmt):
    """The fast full-block kernels (float32, one whole-tensor scale, 2**18 elements: several
    parts, both threads) against the same reference."""
    rng = np.random.default_rng(11)
    x = data(rng, (512, 512))
    st = tensor_stats(x, parse_variants([fmt], ["tensor"]))
    over, under, sub, err2, smin = expected(x, fmt, "tensor")
    r = st.variants[0]
    assert (r.overflow, r.underflow, r.subnormal) == (over, under, sub)
    assert under > 0 and sub > 0
    assert r.err2 == pytest.approx(err2, rel=1e-12, abs=0)
    assert r.scale == smin
