"""Emulator semantics: hand-computed values, double rounding, inputs, errors, properties,
stochastic rounding."""

import math
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import fp8sim
from fp8sim.emulator import ROUNDING_MODES
from fp8sim.philox import randint

E4M3 = fp8sim.get_format("e4m3")
E5M2 = fp8sim.get_format("e5m2")


def enc(x, fmt="e4m3", **kw):
    return int(fp8sim.encode(np.array([x], np.float64), fmt, **kw)[0])


# -- hand-computed boundaries (OCP spec: round first, then compare with max) ----------------


def test_e4m3_overflow_boundary_by_hand():
    assert enc(464.0) == 0x7E  # tie between 448 (even) and virtual 480 -> 448
    assert enc(464.0, saturate=False) == 0x7E
    assert enc(np.nextafter(464.0, 1e9), saturate=False) == 0x7F  # NaN: no inf in E4M3
    assert enc(np.nextafter(464.0, 1e9), saturate=True) == 0x7E
    assert enc(-1e30, saturate=True) == 0xFE
    assert enc(np.inf, saturate=True) == 0x7E and enc(-np.inf, saturate=False) == 0xFF


def test_e5m2_overflow_boundary_by_hand():
    assert enc(np.nextafter(61440.0, 0), "e5m2", saturate=False) == 0x7B  # < 61440 -> 57344
    assert enc(61440.0, "e5m2", saturate=False) == 0x7C  # tie -> even = inf
    assert enc(61440.0, "e5m2", saturate=True) == 0x7B
    assert enc(-1e9, "e5m2", saturate=False) == 0xFC


def test_subnormal_and_underflow_by_hand():
    assert enc(2.0**-10) == 0x00  # half the smallest subnormal: tie to even (0)
    assert enc(np.nextafter(2.0**-10, 1)) == 0x01
    assert enc(3 * 2.0**-10) == 0x02  # tie between 1 and 2 subnormal ulps -> even
    assert enc(-(2.0**-12)) == 0x80  # negative underflow keeps the sign
    assert enc(-(2.0**-12), "e4m3fnuz") == 0x00  # FNUZ has no -0
    assert enc(-0.0, "e4m3fnuz") == 0x00 and enc(-0.0) == 0x80


def test_directed_modes_by_hand():
    x = 1.0 + 1 / 32  # between 1.0 (0x38) and 1.125 (0x39)
    assert enc(x, rounding="rtz") == 0x38 and enc(-x, rounding="rtz") == 0xB8
    assert enc(x, rounding="up") == 0x39 and enc(-x, rounding="up") == 0xB8
    assert enc(x, rounding="down") == 0x38 and enc(-x, rounding="down") == 0xB9
    assert enc(1.0625, rounding="rna") == 0x39 and enc(1.0625, rounding="rne") == 0x38
    assert enc(1.0625 + 0.125, rounding="rne") == 0x3A  # tie 1.1875 -> even 1.25
    assert enc(x, rounding="odd") == 0x39 and enc(1.25, rounding="odd") == 0x3A  # exact stays
    # IEEE directed overflow: rtz never overflows, up overflows only upward
    assert enc(1e6, "e5m2", rounding="rtz", saturate=False) == 0x7B
    assert enc(1e6, "e5m2", rounding="up", saturate=False) == 0x7C
    assert enc(-1e6, "e5m2", rounding="up", saturate=False) == 0xFB
    assert enc(-1e6, "e5m2", rounding="down", saturate=False) == 0xFC
    assert enc(np.inf, "e5m2", rounding="rtz", saturate=False) == 0x7C  # inf is exact


def test_nan_encodings():
    assert enc(np.nan) == 0x7F and enc(-np.nan) == 0xFF
    assert enc(np.nan, "e5m2") == 0x7E
    assert enc(np.nan, "e4m3fnuz") == 0x80 and enc(-np.nan, "e5m2fnuz") == 0x80
    assert enc(np.nan, "e8m0") == 0xFF
    assert enc(-2.0, "e8m0") == 0xFF  # unsigned: no negative numbers


@pytest.mark.parametrize("name, ref", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2),
                                       ("e3m4", ml_dtypes.float8_e3m4), ("e4m3fnuz", torch.float8_e4m3fnuz),
                                       ("e5m2fnuz", torch.float8_e5m2fnuz)])
def test_nan_codes_decode_with_the_codes_sign(name, ref):
    # ml_dtypes and torch give a NaN code's sign bit to the NaN (0xFF in E4M3 is -NaN); FNUZ's one
    # NaN 0x80 is +NaN in torch (ml_dtypes: -NaN) -- we follow torch there
    codes = np.arange(256, dtype=np.uint8)
    if isinstance(ref, torch.dtype):
        want = torch.from_numpy(codes).view(ref).float().numpy()
    else:
        want = codes.view(ref).astype(np.float32)
    got = fp8sim.decode(codes, name)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))
    assert np.array_equal(np.signbit(fp8sim.decode(codes, name, dtype=np.float64)[nan]), np.signbit(want[nan]))


def test_e8m0_rounding_and_range():
    assert enc(1.0, "e8m0") == 127 and enc(2.0**-127, "e8m0") == 0
    assert enc(1.5, "e8m0") == 128  # ties up (all E8M0 significands are 1), as ml_dtypes
    assert enc(1.4, "e8m0") == 127 and enc(1e-45, "e8m0") == 0
    assert enc(2.0**128, "e8m0", saturate=False) == 0xFF and enc(2.0**128, "e8m0") == 0xFE


def test_float64_is_rounded_once_not_through_float32():
    """x = tie + tiny: float32(x) is the exact tie (-> even), but x itself is above it."""
    for fmt, lo, hi in [("e4m3", 1.0, 1.125), ("e5m2", 1.0, 1.25), ("bf16", 1.0, 1 + 2**-7)]:
        tie = (lo + hi) / 2
        x = tie + 2.0**-40
        assert np.float32(x) == tie  # the double-rounding trap is real
        codes = fp8sim.encode(np.array([x]), fmt)
        assert fp8sim.decode(codes, fmt, dtype=np.float64)[0] == hi
        assert fp8sim.decode(fp8sim.encode(np.float32([x]), fmt), fmt)[0] == lo
        x = tie - 2.0**-40
        assert fp8sim.decode(fp8sim.encode(np.array([x]), fmt), fmt, dtype=np.float64)[0] == lo
    # also past max and near the subnormal threshold
    assert enc(464.0 + 2.0**-30, saturate=False) == 0x7F
    assert enc(2.0**-10 + 2.0**-60) == 0x01


# -- input types, shapes, torch ----------------------------------------------------------------


def test_input_dtypes_agree():
    rng = np.random.default_rng(0)
    x16 = (rng.standard_normal(1000) * 30).astype(np.float16)
    want = fp8sim.encode(x16.astype(np.float64), "e4m3")
    assert np.array_equal(fp8sim.encode(x16, "e4m3"), want)
    assert np.array_equal(fp8sim.encode(x16.astype(np.float32), "e4m3"), want)
    xb = x16.astype(ml_dtypes.bfloat16)
    assert np.array_equal(fp8sim.encode(xb, "e4m3"), fp8sim.encode(xb.astype(np.float64), "e4m3"))
    t = torch.from_numpy(x16.astype(np.float32)).to(torch.bfloat16)
    got = fp8sim.encode(t, "e4m3")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8
    assert torch.equal(got, torch.from_numpy(fp8sim.encode(xb, "e4m3")))


def test_any_shape_and_non_contiguous():
    x = np.arange(2 * 3 * 5 * 7, dtype=np.float32).reshape(2, 3, 5, 7) / 7
    view = x.transpose(3, 1, 0, 2)[::2, :, :, 1:]
    codes = fp8sim.encode(view, "e5m2")
    assert codes.shape == view.shape
    assert np.array_equal(codes, fp8sim.encode(np.ascontiguousarray(view), "e5m2"))
    tv = torch.from_numpy(x).permute(3, 1, 0, 2)[::2]
    assert torch.equal(fp8sim.encode(tv, "e5m2"), torch.from_numpy(fp8sim.encode(x.transpose(3, 1, 0, 2)[::2], "e5m2")))
    assert fp8sim.encode(np.float32(3.0), "e4m3").shape == ()
    assert fp8sim.encode(np.zeros((0, 4), np.float32), "e4m3").shape == (0, 4)


def test_quantize_returns_input_dtype():
    x = np.array([0.3, 1000.0], np.float64)
    q = fp8sim.quantize(x, "e4m3")
    assert q.dtype == np.float64 and q[0] == 0.3125 and q[1] == 448.0
    q16 = fp8sim.quantize(x.astype(np.float16), "e5m2")
    assert q16.dtype == np.float16 and q16[0] == np.float16(0.3125)
    tq = fp8sim.quantize(torch.tensor([0.3], dtype=torch.bfloat16), "e4m3")
    assert tq.dtype == torch.bfloat16 and tq.item() == 0.3125


def test_wide_targets_use_uint16_codes():
    x = np.array([1.0, 65504.0, 70000.0, 1e-8], np.float32)
    codes = fp8sim.encode(x, "fp16", saturate=False)
    assert codes.dtype == np.uint16
    with np.errstate(over="ignore"):
        assert np.array_equal(codes, x.astype(np.float16).view(np.uint16))


# -- bad input -----------------------------------------------------------------------------


def test_bad_input_errors():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="unknown rounding 'nearest'; valid: rne, rna"):
        fp8sim.encode(x, "e4m3", rounding="nearest")
    with pytest.raises(ValueError, match="unknown format"):
        fp8sim.encode(x, "e4m4fn")
    with pytest.raises(TypeError, match="dtype int64"):
        fp8sim.encode(np.arange(4), "e4m3")
    with pytest.raises(TypeError, match="complex"):
        fp8sim.encode(np.ones(3, np.complex64), "e4m3")
    with pytest.raises(ValueError, match=r"2 NaN input\(s\) but e2m1 has no NaN.*index \(1, 0\)"):
        fp8sim.encode(np.array([[1, 2], [np.nan, 3], [np.nan, 0]], np.float32), "e2m1")
    with pytest.raises(ValueError, match="overflow e3m2"):
        fp8sim.encode(np.array([1e3], np.float32), "e3m2", saturate=False)
    assert fp8sim.encode(np.array([1e3], np.float32), "e3m2")[0] == 0x1F
    with pytest.raises(ValueError, match="exactly one of rbits= or seed="):
        fp8sim.encode(x, "e4m3", rounding="stochastic")
    with pytest.raises(ValueError, match="srbits"):
        fp8sim.encode(x, "e4m3", rounding="stochastic", seed=1, srbits=0)
    with pytest.raises(ValueError, match="out of range"):
        fp8sim.decode(np.array([300], np.uint16), "e4m3")


# -- properties (hypothesis) --------------------------------------------------------------------

FINITE = st.floats(allow_nan=False, allow_infinity=False, width=64)
FORMATS = st.sampled_from(["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e3m4", "e2m3", "e2m1", "bf16"])
NEAREST = st.sampled_from(["rne", "rna"])


def _vals(codes, fmt):
    return fp8sim.decode(codes, fmt, dtype=np.float64)


@settings(max_examples=60, deadline=None)
@given(st.lists(FINITE, min_size=2, max_size=50), FORMATS, st.sampled_from(ROUNDING_MODES[:6]))
def test_monotonic_and_sign_symmetric(xs, name, mode):
    x = np.sort(np.array(xs))
    v = _vals(fp8sim.encode(x, name, rounding=mode), name)
    assert np.all(np.diff(v) >= 0)
    mirrored = {"up": "down", "down": "up"}.get(mode, mode)
    vn = _vals(fp8sim.encode(-x, name, rounding=mirrored), name)
    assert np.array_equal(np.abs(vn), np.abs(v))


@settings(max_examples=60, deadline=None)
@given(st.lists(FINITE, min_size=1, max_size=50), FORMATS, st.sampled_from(ROUNDING_MODES[:6]))
def test_idempotent_and_saturation_bounded(xs, name, mode):
    x = np.array(xs)
    fmt = fp8sim.get_format(name)
    q = fp8sim.quantize(x, fmt, rounding=mode)
    assert np.array_equal(fp8sim.quantize(q, fmt, rounding=mode), q)
    assert np.all(np.abs(q) <= fmt.max)


@settings(max_examples=80, deadline=None)
@given(st.lists(FINITE, min_size=1, max_size=50), FORMATS, NEAREST)
def test_nearest_within_half_ulp(xs, name, mode):
    fmt = fp8sim.get_format(name)
    x = np.clip(np.array(xs), -fmt.max, fmt.max)
    q = fp8sim.quantize(x, fmt, rounding=mode)
    a = np.abs(x)
    e = np.floor(np.log2(np.maximum(a, fmt.min_normal)))
    ulp = 2.0 ** (np.maximum(e, fmt.emin) - fmt.mantissa_bits)
    assert np.all(np.abs(q - x) <= ulp / 2)


@settings(max_examples=80, deadline=None)
@given(st.lists(FINITE, min_size=1, max_size=50), FORMATS)
def test_directed_modes_bracket(xs, name):
    fmt = fp8sim.get_format(name)
    x = np.clip(np.array(xs), -fmt.max, fmt.max)
    down = fp8sim.quantize(x, fmt, rounding="down")
    up = fp8sim.quantize(x, fmt, rounding="up")
    tz = fp8sim.quantize(x, fmt, rounding="rtz")
    assert np.all(down <= x) and np.all(x <= up)
    assert np.all(np.abs(tz) <= np.abs(x))
    for mode in ("rne", "rna", "odd"):
        q = fp8sim.quantize(x, fmt, rounding=mode)
        assert np.all((q == down) | (q == up))


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e4m3fnuz", "e3m4", "e2m1", "e8m0", "bf16"])
def test_decode_encode_round_trip_every_code(name):
    fmt = fp8sim.get_format(name)
    codes = np.arange(fmt.num_codes).astype(fmt.code_dtype)
    for mode in ROUNDING_MODES[:6]:
        for sat in (True, False):
            back = fp8sim.encode(fp8sim.decode(codes, fmt, dtype=np.float64), fmt,
                                 rounding=mode, saturate=sat)
            vals = fp8sim.decode(codes, fmt)
            nan, inf = np.isnan(vals), np.isinf(vals)
            keep = ~nan & ~(inf & sat)  # saturating sends +-inf to +-max, by contract
            assert np.array_equal(back[keep], codes[keep]), (mode, sat)
            if sat and inf.any():
                assert np.array_equal(np.abs(fp8sim.decode(back[inf], fmt)), [fmt.max] * 2)
            assert np.isnan(fp8sim.decode(back[nan], fmt)).all()


# -- stochastic rounding ------------------------------------------------------------------------


def test_stochastic_is_unbiased_and_follows_the_rule():
    n = 200_000
    x = np.full(n, 1.03, np.float64)  # between 1.0 and 1.125 in E4M3
    frac = (1.03 - 1.0) / 0.125
    q = fp8sim.quantize(x, "e4m3", rounding="stochastic", seed=1234)
    assert set(np.unique(q)) <= {1.0, 1.125}
    ups = int((q == 1.125).sum())
    assert stats.binomtest(ups, n, frac).pvalue > 1e-4
    ci = stats.norm.ppf(0.99995) * q.std() / math.sqrt(n)
    assert abs(q.mean() - 1.03) < ci
    # with k random bits the up-probability is floor(frac * 2**k) / 2**k, exactly
    for k in (1, 3, 8):
        qk = fp8sim.quantize(x, "e4m3", rounding="stochastic", seed=99, srbits=k)
        p = math.floor(frac * 2**k) / 2**k
        upk = int((qk == 1.125).sum())
        if p == 0:
            assert upk == 0
        else:
            assert stats.binomtest(upk, n, p).pvalue > 1e-4, k


def test_stochastic_reproducible_and_equal_to_explicit_philox_bits():
    x = np.random.default_rng(0).standard_normal((37, 41)).astype(np.float32) * 50
    a = fp8sim.encode(x, "e5m2", rounding="stochastic", seed=7)
    assert np.array_equal(a, fp8sim.encode(x, "e5m2", rounding="stochastic", seed=7))
    assert not np.array_equal(a, fp8sim.encode(x, "e5m2", rounding="stochastic", seed=8))
    rb = randint(7, np.arange(x.size)).reshape(x.shape)  # counter = flat C-order index
    assert np.array_equal(a, fp8sim.encode(x, "e5m2", rounding="stochastic", rbits=rb))
    # a Fortran-ordered copy of the same values draws the same bits per logical element
    assert np.array_equal(a, fp8sim.encode(np.asfortranarray(x), "e5m2", rounding="stochastic", seed=7))


def test_philox_matches_triton_randint_in_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    import triton
    import triton.language as tl

    @triton.jit
    def _randint_kernel(out_ptr, seed, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.randint(seed, offs), mask=offs < n)

    n = 1000
    for seed in (0, 1, 2**31 + 5, 2**40 + 3):
        out = torch.empty(n, dtype=torch.int32)
        _randint_kernel[(triton.cdiv(n, 256),)](out, seed, n, BLOCK=256)
        assert np.array_equal(out.numpy().view(np.uint32), randint(seed, np.arange(n)))


def test_big_endian_and_read_only_inputs():
    x = np.array([1.1, -464.0, 3e-3], dtype=">f4")
    want = fp8sim.encode(x.astype("<f4"), "e4m3")
    assert np.array_equal(fp8sim.encode(x, "e4m3"), want)
    assert np.array_equal(fp8sim.decode(want.astype(">u2"), "e4m3"), fp8sim.decode(want, "e4m3"))
    ro = x.astype(np.float64)
    ro.setflags(write=False)
    assert np.array_equal(fp8sim.encode(ro, "e4m3"), want)


def test_arguments_that_would_be_ignored_are_refused():
    x = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="for rounding='stochastic'"):
        fp8sim.encode(x, "e4m3", srbits=8)
    with pytest.raises(TypeError, match="saturate must be True or False"):
        fp8sim.encode(x, "e4m3", saturate="no")
    with pytest.raises(ValueError, match="negative"):
        fp8sim.decode(np.array([-1], np.int64), "e4m3")


def test_generic_formats_wider_than_float32_are_refused():
    with pytest.raises(ValueError, match="2..8 exponent bits"):
        fp8sim.get_format("e9m6")
    # the widest accepted generic formats decode exactly in float32
    for name in ("e8m7", "e8m5", "e5m10", "e2m13"):
        fmt = fp8sim.get_format(name)
        t32 = fp8sim.decode(np.arange(fmt.num_codes).astype(fmt.code_dtype), fmt)
        t64 = fp8sim.decode(np.arange(fmt.num_codes).astype(fmt.code_dtype), fmt, dtype=np.float64)
        fin = np.isfinite(t64)
        assert np.array_equal(t32[fin].astype(np.float64), t64[fin])


@pytest.mark.parametrize("mode", ["rne", "rtz", "stochastic"])
def test_encode_into_out_equals_allocating_encode(mode):
    """``out=`` writes the same codes in place (numpy, torch uint8 and torch float8 views), for
    the parallel kernels too, and returns the very object it was given."""
    kw = {"seed": 3} if mode == "stochastic" else {}
    for shape in [(3, 7), (1 << 18,)]:  # serial twin and parallel kernel
        x = (np.random.default_rng(1).standard_normal(shape) * 300).astype(np.float32)
        want = fp8sim.encode(x, "e4m3", rounding=mode, **kw)
        out = np.full(shape, 0xAB, np.uint8)
        assert fp8sim.encode(x, "e4m3", rounding=mode, out=out, **kw) is out
        np.testing.assert_array_equal(out, want)
        t = torch.from_numpy(x)
        f8 = torch.empty(shape, dtype=torch.float8_e4m3fn)
        assert fp8sim.encode(t, "e4m3", rounding=mode, out=f8, **kw) is f8
        assert np.array_equal(f8.view(torch.uint8).numpy(), want)
    x16 = np.linspace(-1e5, 1e5, 33, dtype=np.float64)
    o16 = np.empty(33, np.uint16)
    np.testing.assert_array_equal(fp8sim.encode(x16, "bf16", out=o16), fp8sim.encode(x16, "bf16"))
    tb = torch.empty(33, dtype=torch.bfloat16)  # bf16 codes are bfloat16 bit patterns
    fp8sim.encode(x16, "bf16", out=tb)
    assert torch.equal(tb, torch.from_numpy(x16).to(torch.bfloat16))


def test_encode_out_is_checked():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(TypeError, match="dtype uint8"):
        fp8sim.encode(x, "e4m3", out=np.empty((4, 5), np.uint16))
    with pytest.raises(ValueError, match="shape"):
        fp8sim.encode(x, "e4m3", out=np.empty((5, 4), np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        fp8sim.encode(x, "e4m3", out=np.empty((4, 10), np.uint8)[:, ::2])
    ro = np.empty((4, 5), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        fp8sim.encode(x, "e4m3", out=ro)
    raw = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="shares memory"):
        fp8sim.encode(raw[:5], "e4m3", out=raw.view(np.uint8)[:5])
    with pytest.raises(TypeError, match="numpy array or CPU torch tensor"):
        fp8sim.encode(x, "e4m3", out=[0] * 20)
    # a torch float8 tensor must be of the same format (its bits are the codes)
    with pytest.raises(TypeError, match="cannot hold e4m3 codes"):
        fp8sim.encode(x, "e4m3", out=torch.empty((4, 5), dtype=torch.float8_e5m2))
    with pytest.raises(TypeError, match="cannot hold e2m1 codes"):
        fp8sim.encode(x, "e2m1", out=torch.empty((4, 5), dtype=torch.float4_e2m1fn_x2))
    with pytest.raises(TypeError, match="cannot hold e4m3 codes"):
        fp8sim.encode(x, "e4m3", out=torch.empty((4, 5), dtype=torch.float16))
