"""FloatFormat: derived properties against the OCP specs and ml_dtypes.finfo."""

import math

import ml_dtypes
import numpy as np
import pytest

import fp8sim
from fp8sim.emulator import decode_table
from fp8sim.formats import FORMATS, get_format

# format -> the ml_dtypes type with the same semantics
ML_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e3m4": ml_dtypes.float8_e3m4,
    "e4m3b11fnuz": ml_dtypes.float8_e4m3b11fnuz,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
    "fp16": np.float16,
    "bf16": ml_dtypes.bfloat16,
}


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_derived_properties_match_ml_dtypes_finfo(name):
    fmt = get_format(name)
    fi = ml_dtypes.finfo(ML_DTYPES[name])
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert fmt.bits == fi.bits
    assert fmt.mantissa_bits == fi.nmant
    assert fmt.emax == fi.maxexp - 1


def test_ocp_reference_facts():
    e4m3, e5m2 = get_format("e4m3"), get_format("e5m2")
    # OCP 8-bit FP spec v1.0, table 1
    assert (e4m3.bias, e4m3.max, e4m3.min_normal, e4m3.min_subnormal) == (7, 448.0, 2**-6, 2**-9)
    assert (e5m2.bias, e5m2.max, e5m2.min_normal, e5m2.min_subnormal) == (
        15, 57344.0, 2**-14, 2**-16)
    assert e4m3.nan_code == 0x7F and e4m3.inf_code is None and e4m3.max_code == 0x7E
    assert e5m2.inf_code == 0x7C and e5m2.nan_code == 0x7E and e5m2.max_code == 0x7B
    # OCP MX spec v1.0: FP6/FP4 element maxima, E8M0 range and NaN
    assert get_format("e2m3").max == 7.5 and get_format("e3m2").max == 28.0
    assert get_format("e2m1").max == 6.0 and get_format("e2m1").min_subnormal == 0.5
    e8m0 = get_format("e8m0")
    assert e8m0.max == 2.0**127 and e8m0.min_normal == 2.0**-127 and e8m0.nan_code == 0xFF
    assert not e8m0.signed and not e8m0.has_zero
    # FNUZ: the negative-zero code is the only NaN
    assert get_format("e4m3fnuz").nan_code == 0x80 and get_format("e4m3fnuz").max == 240.0


def test_aliases_and_generic_formats():
    assert get_format("e4m3fn") is get_format("e4m3")
    assert get_format("float8_e5m2") is get_format("e5m2")
    e5m10 = get_format("e5m10")  # generic IEEE-like, same as fp16
    assert (e5m10.max, e5m10.min_subnormal, e5m10.has_inf) == (65504.0, 2**-24, True)
    e8m7 = get_format("e8m7")
    assert e8m7.max == get_format("bf16").max
    e3m3 = get_format("e3m3")  # IEEE-like: top exponent reserved
    assert e3m3.max == 2.0**3 * (1 + 7 / 8) and e3m3.bits == 7


@pytest.mark.parametrize("bad", ["fp7", "", "e4m3x", "float8"])
def test_unknown_format_names_raise_with_valid_list(bad):
    with pytest.raises(ValueError, match="valid: e4m3, e5m2"):
        get_format(bad)


@pytest.mark.parametrize("bad", ["e9m9", "e1m3", "e4m0"])
def test_generic_formats_out_of_range_raise(bad):
    with pytest.raises(ValueError, match="at most 16 bits"):
        get_format(bad)


def test_bad_format_type():
    with pytest.raises(TypeError):
        get_format(8)


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_decode_every_code_matches_ml_dtypes(name):
    """Exhaustive decode: every code, against ml_dtypes' own conversion to float64."""
    fmt = get_format(name)
    codes = np.arange(fmt.num_codes, dtype=np.uint16 if fmt.bits > 8 else np.uint8)
    ours = fp8sim.decode(codes, fmt, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # ml_dtypes warns on its NaN codes
        theirs = codes.view(ML_DTYPES[name]).astype(np.float64)
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.array_equal(np.signbit(ours[~nan]), np.signbit(theirs[~nan]))
    # float32 decode is exact too
    assert np.array_equal(fp8sim.decode(codes, fmt).astype(np.float64)[~nan], theirs[~nan])


def test_decode_table_by_hand_e4m3():
    t = decode_table("e4m3")
    assert t[0x00] == 0.0 and t[0x01] == 2**-9 and t[0x07] == 7 * 2**-9  # subnormals
    assert t[0x08] == 2**-6 and t[0x38] == 1.0 and t[0x3C] == 1.5 and t[0x7E] == 448.0
    assert math.isnan(t[0x7F]) and math.isnan(t[0xFF]) and t[0xFE] == -448.0
    assert math.copysign(1, t[0x80]) == -1.0


def test_every_named_format_has_monotonic_codes():
    """Within one sign, finite values increase with the code (the rounding core relies on it)."""
    for fmt in FORMATS.values():
        mags = decode_table(fmt)[: fmt.max_code + 1]
        assert np.all(np.diff(mags) > 0), fmt.name
