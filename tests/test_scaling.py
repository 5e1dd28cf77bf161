"""fp8sim.scaling: granularities, amax, scale rules (TE current scaling, OCP MX floor, rceil),
quantize_scaled / dequantize on ragged shapes, NaN handling.

References are independent: per-block loops over numpy slices, float64 / Fraction arithmetic,
hand-computed values, and the emulator's own encode for the final cast.
"""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.formats import get_format
from fp8sim.scaling import (
    Granularity,
    compute_amax,
    dequantize,
    e8m0_codes,
    mx_shared_scale,
    parse_granularity,
    quantize_scaled,
    scale_from_amax,
)

E4M3 = fp8sim.get_format("e4m3")
F32_MAX = float(np.finfo(np.float32).max)


def blocks(shape2d, r, c):
    """(row slice, col slice, block index) for every tile, by plain loops."""
    m, n = shape2d
    for bi, r0 in enumerate(range(0, m, r)):
        for bj, c0 in enumerate(range(0, n, c)):
            yield slice(r0, min(r0 + r, m)), slice(c0, min(c0 + c, n)), (bi, bj)


def ref_amax(x2d, r, c, ignore_nan=False):
    m, n = x2d.shape
    out = np.zeros((-(-m // r), -(-n // c)), np.float32)
    for rs, cs, idx in blocks(x2d.shape, r, c):
        blk = np.abs(x2d[rs, cs].astype(np.float64))
        if ignore_nan:
            blk = blk[~np.isnan(blk)]
            out[idx] = blk.max() if blk.size else 0.0
        else:
            out[idx] = blk.max()  # NaN-propagating
    return out


# -- granularity parsing ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, kind, block",
    [
        ("tensor", "tensor", None),
        ("row", "row", None),
        ("col", "col", None),
        ("block:1x128", "block", (1, 128)),
        ("BLOCK:128x128", "block", (128, 128)),
        ("mx", "mx", (1, 32)),
        ("mx:rceil", "mx", (1, 32)),
    ],
)
def test_parse_granularity(spec, kind, block):
    g = parse_granularity(spec)
    assert g.kind == kind and g.block == block
    assert parse_granularity(g.spec) == g


@pytest.mark.parametrize(
    "bad", ["block:0x128", "block:4x0", "block:-1x4", "blocks", "mx:ceil", "", "block:1"]
)
def test_parse_granularity_rejects(bad):
    with pytest.raises(ValueError, match="granularit|block sizes"):
        parse_granularity(bad)


def test_parse_granularity_type():
    with pytest.raises(TypeError):
        parse_granularity(128)


def test_grid_shapes():
    assert parse_granularity("tensor").grid((3, 130)) == ()
    assert parse_granularity("row").grid((2, 3, 5)) == (6, 1)
    assert parse_granularity("col").grid((2, 3, 5)) == (1, 5)
    assert parse_granularity("block:128x128").grid((257, 31)) == (3, 1)
    assert parse_granularity("mx").grid((3, 130)) == (3, 5)
    assert parse_granularity("block:1x128").grid((130,)) == (1, 2)


# -- amax --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 130), (257, 31)])
@pytest.mark.parametrize(
    "gran", ["tensor", "row", "col", "block:1x128", "block:128x128", "block:5x7", "mx"]
)
def test_compute_amax_ragged_matches_loops(shape, gran):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, shape))).astype(np.float32)
    g = parse_granularity(gran)
    r, c = g.tile(*shape)
    expect = ref_amax(x, r, c)
    got = compute_amax(x, gran)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.reshape(expect.shape), expect)


def test_amax_never_reads_outside_the_view():
    # a ragged view inside a larger buffer whose outside holds huge values: they must not leak
    big = np.full((300, 300), 1e30, np.float32)
    rng = np.random.default_rng(0)
    big[:3, :130] = rng.standard_normal((3, 130))
    x = big[:3, :130]
    for gran in ("block:1x128", "block:128x128", "mx", "row", "col"):
        assert np.all(compute_amax(x, gran) < 10), gran
    st = quantize_scaled(x, "e4m3", "block:128x128")
    # the last (2-column) block's amax is the max over its 6 real elements only
    assert st.amax[0, 1] == np.abs(x[:, 128:]).max()


def test_amax_nan_propagates_unless_ignored():
    x = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    x[1, 2] = np.nan
    rows = compute_amax(x, "row")
    assert np.isnan(rows[1, 0]) and rows[0, 0] == 4 and rows[2, 0] == 12
    assert np.isnan(compute_amax(x, "tensor"))
    np.testing.assert_array_equal(compute_amax(x, "row", ignore_nan=True)[:, 0], [4, 8, 12])
    assert compute_amax(np.full((2, 2), np.nan, np.float32), "tensor", ignore_nan=True) == 0


def test_amax_ignoring_signalling_nans_matches_integer_max():
    # random bit patterns, signalling NaNs among them (numpy's fmax/nanmax can drop the values
    # next to one); the reference orders magnitudes by their bit patterns, no float compare
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, (64, 8), dtype=np.uint64).astype(np.uint32)
    bits[:, 3] = 0x7F800001 + rng.integers(0, 0x3FFFFF, 64).astype(np.uint32)  # sNaN payloads
    x = bits.view(np.float32)
    mag = bits & np.uint32(0x7FFFFFFF)
    want = np.where(mag > 0x7F800000, np.uint32(0), mag).max(axis=1).view(np.float32)
    got = compute_amax(x, "row", ignore_nan=True)[:, 0]
    np.testing.assert_array_equal(got, want)


def test_amax_inf_is_an_amax():
    x = np.array([[1.0, -np.inf], [2.0, 3.0]], np.float32)
    np.testing.assert_array_equal(compute_amax(x, "row")[:, 0], [np.inf, 3.0])


def test_amax_of_float64_and_torch_inputs():
    x64 = np.array([[1.0, -3.0000001], [2.0, 0.5]])
    assert compute_amax(x64, "tensor") == np.float32(3.0000001)
    t = torch.tensor([[1.0, -7.5], [2.0, 3.0]], dtype=torch.bfloat16)
    np.testing.assert_array_equal(compute_amax(t, "row")[:, 0], [7.5, 3.0])


# -- scale from amax (TE current scaling rule) ---------------------------------------------------


def test_scale_from_amax_hand_values():
    s = scale_from_amax([448.0, 1.0, 0.0, np.inf, np.nan, 3.0], "e4m3")
    np.testing.assert_array_equal(s, np.float32([1.0, 448.0, 1.0, 1.0, 1.0, 448.0 / 3.0]))
    assert scale_from_amax(1.0, "e4m3", margin=1) == 224.0
    assert scale_from_amax(57344.0 / 8, "e5m2", margin=2) == 2.0
    assert scale_from_amax(3.0, "e4m3", pow2=True) == 128.0  # 149.33 -> 128
    assert scale_from_amax(448.0 / 3, "e4m3", pow2=True) == 2.0  # 3.0000002 -> 2
    assert scale_from_amax(0.0, "e4m3", epsilon=0.5) == 896.0
    assert scale_from_amax(1.0, "e4m3", epsilon=0.5) == 448.0


def test_scale_from_amax_tiny_amax_gives_float32_max():
    tiny = np.float32(448.0 / F32_MAX / 2)  # 448 / tiny overflows float32
    assert scale_from_amax(tiny, "e4m3") == np.float32(F32_MAX)
    assert scale_from_amax(tiny, "e4m3", pow2=True) == np.float32(2.0**127)


def test_scale_from_amax_is_float32_division():
    rng = np.random.default_rng(3)
    amax = (rng.uniform(0.5, 1.0, 2000) * np.exp2(rng.integers(-40, 40, 2000))).astype(np.float32)
    s = scale_from_amax(amax, "e5m2", margin=3)
    # float64 division then one rounding equals the correctly rounded float32 division
    expect = np.float32(57344.0 / amax.astype(np.float64)) / np.float32(8)
    np.testing.assert_array_equal(s, expect)


def test_scale_from_amax_equals_a_float64_formula_over_float32():
    """The numba scale rule against an independent numpy one (float64 division rounded once to
    float32, frexp/ldexp for pow2) over a million float32 amaxes: a stride through every bit
    pattern, each power of two and its neighbours, and the specials."""
    pats = np.arange(0, 0x7F800000, 4099, dtype=np.uint64)
    pows = (np.arange(0, 255, dtype=np.uint64) << np.uint64(23)) | np.uint64(0)
    pats = np.concatenate([pats, pows, pows + 1, np.maximum(pows, 1) - 1, [0x7F800000, 0x7FC00000]])
    amax = pats.astype(np.uint32).view(np.float32)
    for fmt, margin, pow2, eps in [("e4m3", 0, False, 0.0), ("e5m2", 3, True, 0.0),
                                   ("e4m3", -2.5, False, 1e-12), ("e2m1", 0, True, 2.0**-140),
                                   ("e4m3", 120, True, 0.0)]:  # subnormal scales
        got = scale_from_amax(amax, fmt, margin=margin, pow2=pow2, epsilon=eps)
        scaled_max = np.float32(np.float32(get_format(fmt).max) * np.float32(2.0**-margin))
        a = np.where(amax < np.float32(eps), np.float32(eps), amax).astype(np.float64)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            want = (np.float64(scaled_max) / a).astype(np.float32)
        want = np.where(np.isinf(want), F32_MAX, want).astype(np.float32)
        if pow2:
            # a quotient that underflows to 0 stays 0 (no power of two is <= 0)
            want = np.where(want > 0, np.ldexp(np.float32(1), np.frexp(want)[1] - 1), 0)
            want = want.astype(np.float32)
        want = np.where(np.isfinite(a) & (a > 0), want, np.float32(1))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=fmt)
    # the scalar rule takes Python floats to float32 first, as scale_from_amax does
    from fp8sim.scaling import scale_multiplier, scaled_format_max

    with np.errstate(over="ignore"):  # 1e39 becomes float32 inf
        for a in (1e-46, 3.0000001, 1e39):
            assert scale_multiplier(a, scaled_format_max("e4m3"), 0.0, False) == scale_from_amax(a, "e4m3")


def test_scale_from_amax_rejects():
    with pytest.raises(ValueError, match=">= 0"):
        scale_from_amax(-1.0, "e4m3")
    with pytest.raises(ValueError, match="unknown format"):  # the format is checked first
        scale_from_amax(-1.0, "e9m9x", margin=200)
    with pytest.raises(ValueError, match="margin"):
        scale_from_amax(1.0, "e4m3", margin=float("nan"))
    with pytest.raises(ValueError, match="epsilon"):
        scale_from_amax(1.0, "e4m3", epsilon=-1)


# -- MX shared scales ----------------------------------------------------------------------------


def floor_log2(q: Fraction) -> int:
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    return e


def ceil_log2(q: Fraction) -> int:
    e = floor_log2(q)
    return e if Fraction(2) ** e == q else e + 1


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e2m3", "e3m2"])
def test_mx_scales_at_powers_of_two_and_at_max(fmt):
    f = fp8sim.get_format(fmt)
    emax = floor_log2(Fraction(f.max))  # OCP: exponent of the largest normal
    ks = np.arange(-100, 100)
    for amax in (np.ldexp(1.0, ks), np.ldexp(f.max, ks), np.ldexp(f.max * 1.0001, ks)):
        a = amax.astype(np.float32)
        ok = np.isfinite(a) & (a > 0)
        floor = mx_shared_scale(a, fmt, "floor")
        rceil = mx_shared_scale(a, fmt, "rceil")
        for v, s_floor, s_rceil in zip(a[ok], floor[ok], rceil[ok], strict=True):
            q = Fraction(float(v))
            ef = min(max(floor_log2(q) - emax, -127), 127)
            er = min(max(ceil_log2(q / Fraction(f.max)), -127), 127)
            assert s_floor == 2.0**ef, (fmt, v)
            assert s_rceil == 2.0**er, (fmt, v)


def test_mx_rceil_matches_exact_rule_away_from_powers_of_two():
    rng = np.random.default_rng(7)
    a = (rng.uniform(1, 2, 3000) * np.exp2(rng.integers(-60, 60, 3000))).astype(np.float32)
    got = mx_shared_scale(a, "e4m3", "rceil")
    for v, s in zip(a, got, strict=True):
        q = Fraction(float(v)) / 448
        e = ceil_log2(q)
        if abs(q / Fraction(2) ** (e - 1) - 1) < Fraction(1, 2**21):
            continue  # within float32 rounding of the power of two below: the float32 rule decides
        assert s == 2.0 ** max(e, -127)


def test_mx_scale_special_amax():
    for rule in ("floor", "rceil"):
        s = mx_shared_scale([0.0, 1e-45, np.nan, np.inf], "e4m3", rule)
        assert s[0] == s[1] == np.float32(2.0**-127)
        assert np.isnan(s[2]) and np.isnan(s[3])
    # the largest float32 amax stays inside E8M0 (floor: 2**(127 - 8))
    assert mx_shared_scale(np.float32(F32_MAX), "e4m3", "floor") == np.float32(2.0**119)
    with pytest.raises(ValueError, match="rule"):
        mx_shared_scale(1.0, "e4m3", "ceil")


def test_e8m0_codes():
    np.testing.assert_array_equal(
        e8m0_codes([2.0**-127, 1.0, 2.0, 2.0**127, np.nan]), [0, 127, 128, 254, 255]
    )
    # against the e8m0 format of the emulator
    codes = e8m0_codes(np.exp2(np.arange(-127, 128)).astype(np.float32))
    np.testing.assert_array_equal(
        fp8sim.decode(codes, "e8m0", dtype=np.float64), np.exp2(np.arange(-127, 128))
    )
    with pytest.raises(ValueError, match="powers of two"):
        e8m0_codes([3.0])


# -- quantize_scaled -----------------------------------------------------------------------------


def test_product_is_rounded_to_float32_before_encoding():
    # exact x * s lies just above the e4m3 midpoint 1.0625 between 1.0 and 1.125, but
    # float32(x * s) == 1.0625 exactly, which ties to even: 1.0 (as a GPU computes it)
    x = np.float32(1.0625 + 2.0**-23)
    s = np.float32(1 - 2.0**-24)
    exact = Fraction(float(x)) * Fraction(float(s))
    assert Fraction(1.0625) < exact < Fraction(1.0625) + Fraction(2) ** -24
    st = quantize_scaled(np.array([x]), "e4m3", scale=s)
    assert fp8sim.decode(st.codes, "e4m3")[0] == 1.0
    assert fp8sim.quantize(np.float64(exact), "e4m3") == 1.125  # single rounding would differ


def test_float64_input_goes_through_float32():
    x = np.array([1.0625 + 2.0**-30])  # float32(x) is the midpoint 1.0625 -> ties to even 1.0
    st = quantize_scaled(x, "e4m3", scale=1.0)
    assert fp8sim.decode(st.codes, "e4m3")[0] == 1.0
    assert fp8sim.quantize(x, "e4m3")[0] == 1.125


@pytest.mark.parametrize("shape", [(3, 130), (257, 31)])
@pytest.mark.parametrize(
    "gran", ["tensor", "row", "col", "block:1x128", "block:128x128", "block:4x3", "mx", "mx:rceil"]
)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_scaled_ragged_matches_blockwise_reference(shape, gran, fmt):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))).astype(np.float32)
    g = parse_granularity(gran)
    f = fp8sim.get_format(fmt)
    st = quantize_scaled(x, fmt, gran)
    assert st.codes.shape == shape and st.shape == shape and st.codes.dtype == np.uint8
    assert st.granularity == g.spec
    r, c = g.tile(*shape)
    amax = ref_amax(x, r, c)
    mult_el = np.empty(shape, np.float32)
    sinv = np.asarray(st.scale_inv).reshape(amax.shape)
    for rs, cs, idx in blocks(shape, r, c):
        a = amax[idx]
        if g.kind == "mx":
            q = Fraction(float(a))
            e = floor_log2(q) - f.emax if g.mx_rule == "floor" else ceil_log2(q / Fraction(f.max))
            X = 2.0 ** min(max(e, -127), 127)
            assert sinv[idx] == X
            mult = np.float32(1 / X)
        else:
            mult = np.float32(np.float32(f.max) / a)  # margin 0
            assert sinv[idx] == np.float32(1) / mult
        mult_el[rs, cs] = mult
    np.testing.assert_array_equal(st.codes, fp8sim.encode((x * mult_el).astype(np.float32), fmt))
    # dequantize: decode * scale_inv, within half an ulp of x (or min_subnormal/2 * scale_inv)
    if g.kind != "mx" or g.mx_rule == "rceil":  # MX floor may saturate the top of a block
        d = dequantize(st, np.float64)
        full = np.broadcast_to(sinv if g.kind != "tensor" else sinv.reshape(1, 1), amax.shape)
        sinv_el = np.repeat(np.repeat(full, r, 0)[: shape[0]], c, 1)[:, : shape[1]].astype(
            np.float64
        )
        bound = np.maximum(np.abs(x) * 2.0 ** -(f.mantissa_bits + 1), f.min_subnormal / 2 * sinv_el)
        assert np.all(np.abs(d - x) <= bound * (1 + 2.0**-20))


def test_quantize_scaled_margin_pow2_epsilon():
    x = np.array([[3.0, -1.0], [0.25, 0.5]], np.float32)
    st = quantize_scaled(x, "e4m3", "row", margin=1, pow2=True)
    # row 0: 448 / 3 / 2 = 74.67 -> 64 ; row 1: 448 / 0.5 / 2 = 448 -> 256
    np.testing.assert_array_equal(st.scale_inv[:, 0], np.float32([1 / 64, 1 / 256]))
    st = quantize_scaled(np.zeros((2, 2), np.float32), "e4m3", epsilon=2.0)
    assert st.scale_inv == np.float32(1) / np.float32(224)


def test_quantize_scaled_given_scales():
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    st = quantize_scaled(x, "e4m3", "row", scale=np.float32([[2.0], [0.5]]))
    np.testing.assert_array_equal(dequantize(st), [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(st.scale_inv, [[0.5], [2.0]])
    assert st.amax is None
    st = quantize_scaled(x, "e4m3", scale=3.0)
    assert st.scale_inv == np.float32(1) / np.float32(3)
    with pytest.raises(ValueError, match="broadcast"):
        quantize_scaled(x, "e4m3", "row", scale=np.ones(3))
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize_scaled(x, "e4m3", scale=-1.0)
    with pytest.raises(ValueError, match="E8M0|powers of two"):
        quantize_scaled(np.ones((1, 32), np.float32), "e4m3", "mx", scale=3.0)
    with pytest.raises(ValueError, match="mx"):
        quantize_scaled(x, "e4m3", "mx", margin=1)


def test_nan_in_mx_block_makes_that_block_nan():
    x = np.random.default_rng(5).standard_normal((2, 70)).astype(np.float32)
    x[1, 40] = np.nan  # row 1, block 1 (elements 32..63)
    for fmt in ("e4m3", "e2m1"):  # e2m1 has no NaN: the NaN lives in the scale alone
        st = quantize_scaled(x, fmt, "mx")
        nan_blocks = np.isnan(st.scale_inv)
        assert nan_blocks.tolist() == [[False, False, False], [False, True, False]]
        assert st.scale_inv_codes[1, 1] == 255 and st.nan_count == 1
        d = dequantize(st)
        assert np.isnan(d[1, 32:64]).all()
        assert (
            not np.isnan(np.delete(d, np.s_[32:64], axis=1)[1]).any() and not np.isnan(d[0]).any()
        )
    x[0, 0] = np.inf  # an inf makes its block NaN too (cvt.rp.ue8m0 semantics)
    assert np.isnan(quantize_scaled(x, "e4m3", "mx:rceil").scale_inv[0, 0])


def test_nan_in_other_granularities_is_counted_and_skipped():
    x = np.array([[1.0, np.nan, 4.0], [2.0, 3.0, 0.5]], np.float32)
    st = quantize_scaled(x, "e4m3", "tensor")
    assert st.nan_count == 1 and st.amax == 4.0
    assert st.scale_inv == np.float32(1) / np.float32(112)
    d = dequantize(st)
    assert np.isnan(d[0, 1]) and np.allclose(
        np.delete(d.ravel(), 1), np.delete(x.ravel(), 1), rtol=2**-4
    )
    with pytest.raises(ValueError, match="NaN"):
        quantize_scaled(x, "e2m1", "row")  # no NaN code in e2m1: the emulator says so


def test_inf_amax_uses_scale_one():
    x = np.array([[1.0, np.inf]], np.float32)
    st = quantize_scaled(x, "e4m3")
    assert st.scale_inv == 1.0
    np.testing.assert_array_equal(dequantize(st), [[1.0, 448.0]])  # inf saturates


def test_stochastic_rounding_uses_flat_index_counter():
    x = np.random.default_rng(9).standard_normal((5, 40)).astype(np.float32)
    st = quantize_scaled(x, "e4m3", "block:2x16", rounding="stochastic", seed=1234)
    mult = 1 / st.scale_inv.astype(np.float32)
    y = (x * np.repeat(np.repeat(mult, 2, 0)[:5], 16, 1)[:, :40]).astype(np.float32)
    np.testing.assert_array_equal(
        st.codes, fp8sim.encode(y, "e4m3", rounding="stochastic", seed=1234)
    )
    again = quantize_scaled(x, "e4m3", "block:2x16", rounding="stochastic", seed=1234)
    np.testing.assert_array_equal(st.codes, again.codes)


def test_input_dtypes_agree():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    ref = quantize_scaled(x.astype(np.float32), "e5m2", "row")
    for variant in (
        x,
        torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16),
        x.astype(np.float16).astype(np.float32),
    ):
        st = quantize_scaled(variant, "e5m2", "row")
        np.testing.assert_array_equal(st.codes, ref.codes)
    with pytest.raises(TypeError):
        quantize_scaled(np.ones((2, 2), np.int32), "e4m3")


def test_nd_empty_and_scalar_inputs():
    x = np.random.default_rng(4).standard_normal((2, 3, 40)).astype(np.float32)
    st = quantize_scaled(x, "e4m3", "mx")
    assert st.scale_inv.shape == (6, 2) and st.codes.shape == (2, 3, 40)
    np.testing.assert_allclose(dequantize(st), x, rtol=2**-3, atol=1e-6)
    e = quantize_scaled(np.zeros((0, 5), np.float32), "e4m3")
    assert e.codes.shape == (0, 5) and e.scale_inv == 1.0
    s = quantize_scaled(np.float32(3.0), "e4m3")
    assert s.codes.shape == () and dequantize(s) == 3.0


def test_dequantize_rounding_per_dtype():
    st = quantize_scaled(np.float32([[1.0, 3.0, 7.0]]), "e4m3", scale=np.float32(3.0))
    v = fp8sim.decode(st.codes, "e4m3", dtype=np.float64)
    sinv = float(np.float32(1) / np.float32(3))
    np.testing.assert_array_equal(dequantize(st, np.float64), v * sinv)  # exact
    np.testing.assert_array_equal(dequantize(st), (v * sinv).astype(np.float32))
    np.testing.assert_array_equal(
        dequantize(st, ml_dtypes.bfloat16), (v * sinv).astype(np.float32).astype(ml_dtypes.bfloat16)
    )
    assert st.dequantize().dtype == np.float32
    with pytest.raises(ValueError, match="MX"):
        _ = st.scale_inv_codes


def test_granularity_object_is_accepted():
    x = np.ones((2, 64), np.float32)
    st = quantize_scaled(x, "e4m3", Granularity("mx", (1, 32), "rceil"))
    assert st.granularity == "mx:rceil"
