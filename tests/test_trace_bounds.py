"""Over/underflow brackets of the trace histogram under scales that are not powers of two, at the
hardest places: scales chosen so that float32(x * scale) lands exactly on a threshold (the tie),
or one float32 step either side of it. The truth is the float32 product and ml_dtypes' cast (an
independent library); a bracket must always hold it, and must be a single value (exact) when
every value sits on a bin edge, where the histogram knows it exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp8sim.trace import abs_histogram, cast_thresholds

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
      "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}  # fmt: skip


def truth(a32, s32, fmt):
    """(overflow, underflow) of the nonzero float32 magnitudes a32 scaled by float32 s32, by
    ml_dtypes: a non-finite cast overflowed (none of these formats saturates in ml_dtypes)."""
    with np.errstate(over="ignore"):
        p = a32 * s32  # float32 product, one rounding
    q = p.astype(ML[fmt]).astype(np.float64)
    return int((~np.isfinite(q)).sum()), int((q == 0).sum())


def tie_scales(values, fmt):
    """Scales putting each value on a threshold, and one and two float32 steps around it."""
    t = cast_thresholds(fmt)
    out = []
    for v in values:
        for thr in (t.overflow_at, t.underflow_at):
            s = np.float32(thr / float(v))
            for k in range(-2, 3):
                w = s
                for _ in range(abs(k)):
                    w = np.nextafter(w, np.float32(np.inf if k > 0 else 0))
                out.append(w)
    return np.array(out, np.float32)


@pytest.mark.parametrize("fmt", sorted(ML))
def test_edge_values_give_exact_counts_at_ties(fmt):
    # values with at most 5 mantissa bits: each sits alone on a bin edge (k = 5)
    rng = np.random.default_rng(3)
    m = rng.integers(0, 32, 400)
    a32 = ((1 + m / 32) * np.exp2(rng.integers(-20, 20, 400))).astype(np.float32)
    a32 = np.concatenate([a32, np.full(1000, 1.09375, np.float32)])  # the reported case
    h = abs_histogram(a32)
    exact = 0
    for s in tie_scales(a32[::7][:60].tolist() + [1.09375], fmt):
        ov, un = truth(a32, s, fmt)
        assert h.overflow_bounds(fmt, s) == (ov, ov), (fmt, float(s))
        assert h.underflow_bounds(fmt, s) == (un, un), (fmt, float(s))
        exact += 1
    assert exact > 500


@pytest.mark.parametrize("fmt", sorted(ML))
def test_brackets_hold_the_truth_for_values_inside_bins(fmt):
    rng = np.random.default_rng(4)
    a32 = np.abs(rng.standard_normal(5000) * np.exp2(rng.integers(-24, 16, 5000))).astype(np.float32)
    a32 = a32[a32 > 0]
    h = abs_histogram(a32)
    widths = []
    for s in np.concatenate([tie_scales(a32[:40], fmt), np.exp2(rng.uniform(-12, 12, 50))]):
        s = np.float32(s)
        ov, un = truth(a32, s, fmt)
        lo, hi = h.overflow_bounds(fmt, s)
        assert lo <= ov <= hi, (fmt, float(s))
        widths.append(hi - lo)
        lo, hi = h.underflow_bounds(fmt, s)
        assert lo <= un <= hi, (fmt, float(s))
    # a bracket (some values do sit inside straddling bins), no wider than two bins' values
    assert 0 < max(widths) <= 2 * int(h.counts.max())


def test_reported_case_no_longer_claims_a_wrong_exact_count():
    """1000 x 1.09375 scaled by float32 424.22858: the product is 464.0 exactly, e4m3's tie,
    which rounds to even (448): no overflow. It was reported as exactly 1000."""
    a32 = np.full(1000, 1.09375, np.float32)
    s = np.float32(424.22857666015625)
    assert float(a32[0] * s) == 464.0
    assert abs_histogram(a32).overflow_bounds("e4m3", s) == (0, 0)
    # the underflow twin: 1.0625 * 0.00091911765 lands on e4m3's underflow tie 2**-10
    b32 = np.full(10, 1.0625, np.float32)
    s = np.float32(0.0009191176504828036)
    assert float(b32[0] * s) == 2.0**-10
    assert abs_histogram(b32).underflow_bounds("e4m3", s) == (10, 10)


def test_bf16_underflow_tie_below_float32_normals_is_bracketed():
    """bf16's underflow threshold 2**-134 lies where float32 products are subnormal and round:
    2**-112 * (1 + 2**-23) scaled by 2**-22 lands on the tie, which torch rounds to 0. A
    power-of-two scale is not exact by bins there; the bracket must hold the truth."""
    import torch

    x = np.array([2.0**-112 * (1 + 2.0**-23)], np.float32)
    s = np.float32(2.0**-22)
    truth = int((torch.from_numpy(x * s).to(torch.bfloat16).float().numpy() == 0).sum())
    lo, hi = abs_histogram(x, 8).underflow_bounds("bf16", s)
    assert truth == 1 and lo <= truth <= hi


def test_products_that_overflow_float32_and_zero_scales():
    h = abs_histogram(np.array([5e35], np.float32))
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(5e35) * np.float32(1000))
    assert h.count_scaled_above(1e39, 1000.0) == (1, 1)  # inf is above any finite threshold
    one = abs_histogram(np.ones(3, np.float32))
    assert one.overflow_bounds("e4m3", 1e-50) == (0, 0)  # float32(1e-50) is 0: every product 0
    assert one.underflow_bounds("e4m3", 1e-50) == (3, 3)
