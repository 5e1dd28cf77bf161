"""fp8sim.gemm: the emulated scaled FP8 GEMM.

* bit-exact against a slow scalar twin written here with Python Fractions (reduced-precision
  accumulators) and numpy float32 scalars (the float32 accumulator);
* float32 accumulation within the classic bound ``gamma_n * (|A| @ |B|)`` of the float64
  matmul of the dequantized operands (n = K plus the roundings of promotions and scales);
* error grows as the accumulator loses mantissa bits; promotion every 128 elements helps.
"""

from fractions import Fraction

import numpy as np
import pytest

import fp8sim
from fp8sim.gemm import HOPPER_FP8, gemm, scaled_gemm
from fp8sim.scaling import dequantize, parse_granularity, quantize_scaled

U32 = 2.0**-24  # unit roundoff of float32


def round_frac(x: Fraction, p: int, rtz: bool) -> Fraction:
    """x rounded to p significant bits (ties to even, or toward zero); exact rationals."""
    if x == 0:
        return x
    sign, mag = (1, x) if x > 0 else (-1, -x)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    while Fraction(2) ** e > mag:
        e -= 1
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    scaled = mag / Fraction(2) ** (e + 1 - p)  # in [2**(p-1), 2**p)
    f = scaled.numerator // scaled.denominator
    rem = scaled - f
    if not rtz and (rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2 == 1)):
        f += 1
    return sign * Fraction(f) * Fraction(2) ** (e + 1 - p)


def twin(av, bv, sa, sb, ga, gb, acc_bits, rtz, k_chunk):
    """Scalar reference of the documented algorithm, independent of the kernel's tricks."""
    m, k = av.shape
    n = bv.shape[1]
    ra, ca = parse_granularity(ga).tile(m, k)
    rb, cb = parse_granularity(gb).tile(k, n)
    sa2 = np.asarray(sa, np.float32).reshape(parse_granularity(ga).grid2d(m, k))
    sb2 = np.asarray(sb, np.float32).reshape(parse_granularity(gb).grid2d(k, n))
    vary = ca < k or rb < k
    native = acc_bits == 23 and not rtz
    out = np.zeros((m, n), np.float32)
    for i in range(m):
        for j in range(n):
            acc = np.float32(0)
            kk = 0
            while kk < k:
                k0 = kk
                part32, part = np.float32(0), Fraction(0)
                while True:
                    prod = Fraction(float(av[i, kk])) * Fraction(float(bv[kk, j]))
                    if native:
                        part32 = np.float32(part32 + np.float32(float(prod)))
                    else:
                        part = round_frac(part + prod, acc_bits + 1, rtz)
                    kk += 1
                    boundary = (
                        (ca < k and kk % ca == 0)
                        or (rb < k and kk % rb == 0)
                        or (k_chunk and kk % k_chunk == 0)
                    )
                    if kk == k or boundary:
                        break
                part = Fraction(float(part32)) if native else part
                if vary:
                    f = np.float32(
                        np.float32(sa2[i // ra, k0 // ca]) * np.float32(sb2[k0 // rb, j // cb])
                    )
                    acc = np.float32(
                        float(
                            round_frac(Fraction(float(acc)) + Fraction(float(f)) * part, 24, False)
                        )
                    )
                else:
                    acc = np.float32(acc + np.float32(float(part)))
            if not vary:
                acc = np.float32(
                    acc * np.float32(np.float32(sa2[i // ra, 0]) * np.float32(sb2[0, j // cb]))
                )
            out[i, j] = acc
    return out


def operands(m, k, n, ga, gb, fa="e4m3", fb="e5m2", seed=0, spread=3.0):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-spread, spread, (m, k)))).astype(
        np.float32
    )
    b = (rng.standard_normal((k, n)) * np.exp(rng.uniform(-spread, spread, (k, n)))).astype(
        np.float32
    )
    return quantize_scaled(a, fa, ga), quantize_scaled(b, fb, gb)


@pytest.mark.parametrize(
    "ga, gb", [("tensor", "tensor"), ("row", "col"), ("block:1x8", "block:8x2"), ("mx", "tensor")]
)
@pytest.mark.parametrize(
    "acc_bits, rounding, k_chunk",
    [(23, "rne", None), (23, "rtz", 16), (10, "rne", None), (10, "rtz", 16), (3, "rtz", None)],
)
def test_bit_exact_against_scalar_twin(ga, gb, acc_bits, rounding, k_chunk):
    a, b = operands(3, 70, 4, ga, gb, seed=acc_bits)
    got = gemm(a, b, acc_bits=acc_bits, acc_rounding=rounding, k_chunk=k_chunk)
    av = fp8sim.decode(a.codes, a.fmt, dtype=np.float64)
    bv = fp8sim.decode(b.codes, b.fmt, dtype=np.float64)
    want = twin(
        av,
        bv,
        a.scale_inv,
        b.scale_inv,
        a.granularity,
        b.granularity,
        acc_bits,
        rounding == "rtz",
        k_chunk,
    )
    np.testing.assert_array_equal(got, want)


def test_truncation_sees_bits_below_float64():
    # 57344**2 + (-(2**-16) * 2**-16): the exact sum is just below 49 * 2**26, which float64
    # cannot tell apart; truncation must still step down one ulp of the accumulator
    a = fp8sim.encode(np.array([[57344.0, -(2.0**-16)]]), "e5m2")
    b = fp8sim.encode(np.array([[57344.0], [2.0**-16]]), "e5m2")
    one = np.float32(1)
    for bits in (23, 10):
        got = scaled_gemm(a, "e5m2", one, b, "e5m2", one, acc_bits=bits, acc_rounding="rtz")
        assert got[0, 0] == float(
            round_frac(Fraction(57344) ** 2 - Fraction(2) ** -32, bits + 1, True)
        )
        assert got[0, 0] < 49 * 2.0**26
    assert scaled_gemm(a, "e5m2", one, b, "e5m2", one)[0, 0] == 49 * 2.0**26  # float32 RNE


@pytest.mark.parametrize(
    "ga, gb, k_chunk",
    [
        ("tensor", "tensor", None),
        ("row", "col", None),
        ("block:1x128", "block:128x128", None),
        ("tensor", "tensor", 128),
        ("block:1x128", "block:128x128", 64),
    ],
)
def test_float32_accumulation_within_bound(ga, gb, k_chunk):
    m, k, n = 9, 700, 11  # K not a multiple of 128: ragged last block
    a, b = operands(m, k, n, ga, gb, seed=3)
    got = gemm(a, b, k_chunk=k_chunk).astype(np.float64)
    da, db = dequantize(a, np.float64), dequantize(b, np.float64)
    ref = da @ db
    nseg = -(-k // min(c for c in (128, k_chunk or k, k)))
    nrounds = k + 2 * nseg + 3  # additions, promotions (scale product + FMA), epilogue
    gamma = nrounds * U32 / (1 - nrounds * U32)
    bound = gamma * (np.abs(da) @ np.abs(db))
    assert np.all(np.abs(got - ref) <= bound)
    assert np.abs(got - ref).max() > 0  # rounding happened: the bound is not vacuous here


def test_error_grows_as_accumulator_mantissa_shrinks():
    m, k, n = 6, 2048, 5
    rng = np.random.default_rng(8)
    a = quantize_scaled(np.abs(rng.standard_normal((m, k))).astype(np.float32), "e4m3")
    b = quantize_scaled(rng.uniform(0.5, 1.0, (k, n)).astype(np.float32), "e4m3")
    ref = dequantize(a, np.float64) @ dequantize(b, np.float64)

    def rel_err(**kw):
        return float(np.max(np.abs(gemm(a, b, **kw) - ref) / np.abs(ref)))

    errs = [rel_err(acc_bits=bits, acc_rounding="rtz") for bits in (23, 16, 12, 8, 5)]
    assert all(e1 < e2 for e1, e2 in zip(errs[:-1], errs[1:], strict=True)), errs
    # DeepSeek-V3: promoting the partial sums to float32 every 128 elements recovers accuracy
    assert rel_err(acc_bits=8, acc_rounding="rtz", k_chunk=128) < errs[3] / 4
    assert rel_err(**HOPPER_FP8) < errs[2]


def test_nan_scale_block_poisons_its_outputs():
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    x[1, 5] = np.nan
    a = quantize_scaled(x, "e4m3", "mx")
    b = quantize_scaled(np.ones((64, 2), np.float32), "e4m3")
    out = gemm(a, b)
    assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2]]).any()


def test_scaled_gemm_infers_tensor_and_row_col_and_takes_torch():
    import torch

    a, b = operands(4, 40, 3, "row", "col", seed=5)
    ref = gemm(a, b)
    np.testing.assert_array_equal(
        scaled_gemm(a.codes, "e4m3", a.scale_inv, b.codes, "e5m2", b.scale_inv), ref
    )
    np.testing.assert_array_equal(
        scaled_gemm(
            torch.from_numpy(a.codes),
            "e4m3",
            torch.from_numpy(a.scale_inv),
            torch.from_numpy(b.codes),
            "e5m2",
            torch.from_numpy(b.scale_inv),
        ),
        ref,
    )
    assert (
        scaled_gemm(
            a.codes, "e4m3", a.scale_inv, b.codes, "e5m2", b.scale_inv, out_dtype=np.float64
        ).dtype
        == np.float64
    )


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"acc_bits": 0}, ValueError, "acc_bits"),
        ({"acc_bits": 24}, ValueError, "acc_bits"),
        ({"acc_rounding": "rna"}, ValueError, "acc_rounding"),
        ({"k_chunk": 0}, ValueError, "k_chunk"),
    ],
)
def test_bad_options(kwargs, exc, match):
    a, b = operands(2, 16, 2, "tensor", "tensor")
    with pytest.raises(exc, match=match):
        gemm(a, b, **kwargs)


def test_bad_operands():
    a, b = operands(2, 16, 2, "block:1x8", "tensor")
    one = np.float32(1)
    with pytest.raises(ValueError, match="inner dimensions"):
        scaled_gemm(a.codes, "e4m3", one, a.codes, "e4m3", one)
    with pytest.raises(ValueError, match="cannot infer"):
        scaled_gemm(a.codes, "e4m3", a.scale_inv, b.codes, "e5m2", b.scale_inv)
    with pytest.raises(ValueError, match="needs"):
        scaled_gemm(
            a.codes, "e4m3", a.scale_inv, b.codes, "e5m2", b.scale_inv, a_granularity="block:1x4"
        )
    with pytest.raises(ValueError, match="> 0"):
        scaled_gemm(a.codes, "e4m3", -one, b.codes, "e5m2", one)
    with pytest.raises(TypeError, match="code array"):
        scaled_gemm(a.codes.astype(np.float32), "e4m3", one, b.codes, "e5m2", one)
    with pytest.raises(ValueError, match="2-D"):
        gemm(quantize_scaled(np.ones(4, np.float32), "e4m3"), b)
