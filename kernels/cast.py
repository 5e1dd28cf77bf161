"""The software cast: float32 -> any narrow format, and back, with integer bit operations.

Why: Triton 3.9's interpreter converts float32 -> fp8e4nv wrongly (it loses the rounding carry)
and decodes fp8 NaN/inf codes as finite numbers; the hardware casts exist for two formats and one
rounding mode. Integer operations on the float32 bit pattern are exact everywhere, so
:func:`encode_f32` is a line-by-line port of ``fp8sim._numba.encode_core.encode_fields`` for float32
inputs (same fields: ``e`` the unbiased exponent, ``sig`` with the implicit bit, ``p = 23``) and
gives the emulator's codes bit for bit in the interpreter and on the GPU. Like the emulator, a
float32 subnormal input is first normalized (``sig`` shifted up, ``e`` its true exponent).

Format and rounding reach the kernels as ``tl.constexpr`` ints (each kernel's ``**cast_args``):

=============  =============================================================================
``M``          mantissa bits
``EMIN``       unbiased exponent of the smallest normal binade
``MAX_CODE``   magnitude code of the largest finite value
``SIGN_MASK``  the sign bit of a code (0 when unsigned)
``SIGNED``     1 when the format has a sign bit
``HAS_SUB``    1 when biased exponent 0 holds subnormals (0 only for E8M0)
``NAN_KIND``   0 ieee, 1 fn, 2 fnuz, 3 none
``NAN_CODE``   canonical positive NaN code (-1 when none)
``INF_CODE``   +inf code (-1 when none)
``MODE``       rounding id (``fp8sim.emulator.ROUNDING_IDS``: rne rna rtz up down odd stochastic)
``SATURATE``   1: overflow and inf -> +-max
``K``          random bits used by stochastic rounding (1..32)
=============  =============================================================================

Formats with no NaN (e2m1, e2m3, e3m2; all narrower than 8 bits) get the sentinel codes
``ERR_NAN_CODE`` (255) / ``ERR_OVERFLOW_CODE`` (254) where the emulator raises; launchers check
for them and raise the same ValueError.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from fp8sim.emulator import ROUNDING_IDS, format_params
from fp8sim.formats import FloatFormat, get_format

__all__ = [
    "ERR_NAN_CODE",
    "ERR_OVERFLOW_CODE",
    "cast_args",
    "decode_args",
    "encode_f32",
    "decode_f32",
    "code_dtype",
    "check_sentinels",
    "is_interpreter",
    "bf16_bits",
    "widen_f32",
    "scale_f32",
    "narrow_keep_nan_sign",
]

ERR_NAN_CODE = 255
ERR_OVERFLOW_CODE = 254
_ERR_NAN = tl.constexpr(ERR_NAN_CODE)  # the same numbers, visible inside @triton.jit
_ERR_OVERFLOW = tl.constexpr(ERR_OVERFLOW_CODE)


def is_interpreter() -> bool:
    """True when Triton runs through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cast_args(fmt: FloatFormat | str, rounding: str = "rne", saturate: bool = True,
              srbits: int | None = None) -> dict:
    """The constexpr keyword arguments of :func:`encode_f32` for one format and rounding."""
    fmt = get_format(fmt)
    if rounding not in ROUNDING_IDS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDING_IDS)}")
    k = 32 if srbits is None else srbits
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= 32:
        raise ValueError(f"srbits must be an int in 1..32, got {srbits!r}")
    if fmt.nan == "none" and fmt.bits > 7:
        raise NotImplementedError(f"triton: {fmt.name} (no NaN and 8+ bits leaves no sentinel code)")
    m, emin, max_code, sign_mask, signed, has_sub, nan_kind, nan_code, inf_code = format_params(fmt)
    return dict(
        M=m, EMIN=emin, MAX_CODE=max_code, SIGN_MASK=sign_mask, SIGNED=signed, HAS_SUB=has_sub,
        NAN_KIND=nan_kind, NAN_CODE=nan_code, INF_CODE=inf_code, MODE=ROUNDING_IDS[rounding],
        SATURATE=int(bool(saturate)), K=int(k),
    )


def decode_args(fmt: FloatFormat | str, prefix: str = "") -> dict:
    """The constexpr keyword arguments of :func:`decode_f32` (names prefixed by ``prefix``)."""
    fmt = get_format(fmt)
    f32 = np.finfo(np.float32)
    if fmt.max > float(f32.max) or fmt.min_subnormal < float(f32.smallest_subnormal):
        raise NotImplementedError(f"triton: decoding {fmt.name} (its values do not fit float32)")
    m, emin, _, _, signed, has_sub, nan_kind, nan_code, inf_code = format_params(fmt)
    args = dict(
        M=m, BIAS=fmt.bias, MAG_BITS=fmt.magnitude_bits, SIGNED=signed, HAS_SUB=has_sub,
        NAN_KIND=nan_kind, NAN_CODE=nan_code, INF_CODE=inf_code,
        SUB_SCALE=float(2.0 ** (emin - m)),
    )
    return {prefix + k: v for k, v in args.items()}


def code_dtype(fmt: FloatFormat) -> torch.dtype:
    """torch dtype of a code tensor: uint8 up to 8 bits, else uint16 (as the emulator)."""
    return torch.uint8 if fmt.bits <= 8 else torch.uint16


def check_sentinels(codes: torch.Tensor, fmt: FloatFormat, shape: tuple) -> None:
    """Raise the emulator's ValueError where a no-NaN format got a sentinel code."""
    if fmt.nan != "none":
        return
    flat = codes.reshape(-1)
    nan_idx = torch.nonzero(flat == ERR_NAN_CODE).reshape(-1)
    if nan_idx.numel():
        first = np.unravel_index(int(nan_idx[0]), shape) if shape else ()
        raise ValueError(
            f"{nan_idx.numel()} NaN input(s) but {fmt.name} has no NaN encoding "
            f"(first at index {tuple(int(i) for i in first)})"
        )
    bad = torch.nonzero(flat == ERR_OVERFLOW_CODE).reshape(-1)
    if bad.numel():
        first = np.unravel_index(int(bad[0]), shape) if shape else ()
        raise ValueError(
            f"{bad.numel()} value(s) overflow {fmt.name} (max {fmt.max}), which has no inf/NaN; "
            f"use saturate=True (first at index {tuple(int(i) for i in first)})"
        )


@triton.jit
def _nan_code(neg, SIGN_MASK: tl.constexpr, SIGNED: tl.constexpr, NAN_KIND: tl.constexpr,
              NAN_CODE: tl.constexpr):
    """The format's NaN, keeping the input's sign where the format can (int32 block)."""
    zero = neg.to(tl.int32) * 0
    if NAN_KIND == 3:
        return zero + _ERR_NAN
    elif NAN_KIND == 2:
        return zero + NAN_CODE
    elif SIGNED:
        return tl.where(neg, NAN_CODE | SIGN_MASK, zero + NAN_CODE)
    else:
        return zero + NAN_CODE


@triton.jit
def _overflow_code(neg, MAX_CODE: tl.constexpr, SIGN_MASK: tl.constexpr, SIGNED: tl.constexpr,
                   NAN_KIND: tl.constexpr, NAN_CODE: tl.constexpr, INF_CODE: tl.constexpr,
                   SATURATE: tl.constexpr):
    """Result of an overflow rounding away from zero, or of an infinite input."""
    if SIGNED:
        sign = tl.where(neg, SIGN_MASK, 0)
    else:
        sign = neg.to(tl.int32) * 0
    if SATURATE:
        return sign | MAX_CODE
    elif INF_CODE >= 0:
        return sign | INF_CODE
    elif NAN_KIND == 3:
        return sign * 0 + _ERR_OVERFLOW
    else:
        return _nan_code(neg, SIGN_MASK, SIGNED, NAN_KIND, NAN_CODE)


@triton.jit
def encode_f32(y, r, M: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr,
               SIGN_MASK: tl.constexpr, SIGNED: tl.constexpr, HAS_SUB: tl.constexpr,
               NAN_KIND: tl.constexpr, NAN_CODE: tl.constexpr, INF_CODE: tl.constexpr,
               MODE: tl.constexpr, SATURATE: tl.constexpr, K: tl.constexpr):
    """Codes (int32 block) of the float32 block ``y``; ``r`` a uint32 block (stochastic only).

    Mirrors ``fp8sim._numba.encode_core.encode_fields`` (see that docstring for the rules).
    """
    u = y.to(tl.uint32, bitcast=True)
    neg = (u >> 31) != 0
    pos = (u >> 31) == 0
    a = u & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    is_inf = a == 0x7F800000
    is_zero = a == 0
    ebits = (a >> 23).to(tl.int32)
    man = (a & 0x7FFFFF).to(tl.int32)
    # float32 subnormals are normalized (leading bit moved to 23, e their true exponent): E8M0
    # has normals below float32's. floor(log2(man)) from the exact int -> float32 conversion.
    lead = (man.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    up = tl.where(man > 0, 23 - lead, 0)
    e = tl.where(ebits > 0, ebits - 127, -126 - up)  # value = sig * 2**(e - 23)
    sig = tl.where(ebits > 0, man | 0x800000, man << up)

    # -- split sig at the target quantum 2**(max(e, EMIN) - M) ---------------------------------
    q_e = tl.maximum(e, EMIN)
    shift = (23 - M) + (q_e - e)  # >= 23 - M >= 8 for formats up to 16 bits
    s = tl.minimum(shift, 30)  # sig < 2**24: any shift >= 25 leaves kept = 0, rem = sig
    kept = sig >> s
    rem = sig & ((1 << s) - 1)
    half = 1 << (s - 1)
    above = rem > half
    tie = rem == half
    inexact = rem != 0

    base = (q_e - EMIN) << M
    if HAS_SUB == 0:
        base = base - (1 << M)  # the implicit bit of binade 0 is not code 2**M
    code = base + kept

    # -- round ----------------------------------------------------------------------------------
    if MODE == 0:  # rne
        code = code + (above | (tie & ((kept & 1) == 1))).to(tl.int32)
    elif MODE == 1:  # rna
        code = code + (above | tie).to(tl.int32)
    elif MODE == 3:  # up
        code = code + (inexact & pos).to(tl.int32)
    elif MODE == 4:  # down
        code = code + (inexact & neg).to(tl.int32)
    elif MODE == 5:  # odd
        code = code | inexact.to(tl.int32)
    elif MODE == 6:  # stochastic: away iff floor(frac * 2**K) + r_top >= 2**K
        top = (rem.to(tl.int64) << K) >> tl.minimum(shift, 63).to(tl.int64)
        rr = (r >> (32 - K)).to(tl.int64)
        code = code + (inexact & (top + rr >= (1 << K))).to(tl.int32)
    # MODE == 2 (rtz): keep the truncated code
    if HAS_SUB == 0:
        code = tl.where(e < EMIN, 0, code)  # no zero, no subnormals: below min -> min

    # -- overflow, sign ---------------------------------------------------------------------------
    ovf = _overflow_code(neg, MAX_CODE, SIGN_MASK, SIGNED, NAN_KIND, NAN_CODE, INF_CODE, SATURATE)
    if MODE == 2 or MODE == 5:  # rtz, odd: never overflow
        toward_zero = a >= 0
    elif MODE == 3:  # up: negatives round toward zero
        toward_zero = neg
    elif MODE == 4:  # down: positives round toward zero
        toward_zero = pos
    else:
        toward_zero = a < 0
    over = code > MAX_CODE
    code = tl.where(over & toward_zero, MAX_CODE, code)
    if SIGNED:
        if NAN_KIND == 2:
            code = tl.where(neg & (code != 0), code | SIGN_MASK, code)  # FNUZ: -0 -> +0
        else:
            code = tl.where(neg, code | SIGN_MASK, code)
    code = tl.where(over & (toward_zero == 0), ovf, code)

    # -- special inputs ---------------------------------------------------------------------------
    if SIGNED and HAS_SUB and NAN_KIND != 2:
        zero_code = tl.where(neg, SIGN_MASK, 0)
    else:
        zero_code = code * 0
    code = tl.where(is_zero, zero_code, code)
    code = tl.where(is_inf, ovf, code)
    nan = _nan_code(neg, SIGN_MASK, SIGNED, NAN_KIND, NAN_CODE)
    if SIGNED == 0:
        code = tl.where(neg & (a != 0), nan, code)  # unsigned: negatives have no code
    code = tl.where(is_nan, nan, code)
    return code


@triton.jit
def decode_f32(code, M: tl.constexpr, BIAS: tl.constexpr, MAG_BITS: tl.constexpr,
               SIGNED: tl.constexpr, HAS_SUB: tl.constexpr, NAN_KIND: tl.constexpr,
               NAN_CODE: tl.constexpr, INF_CODE: tl.constexpr, SUB_SCALE: tl.constexpr):
    """Exact float32 values of an int32 block of codes: NaN codes -> quiet NaN with the code's
    sign (FNUZ's one NaN -> +NaN), inf codes -> inf, as ``fp8sim.decode``."""
    mag = code & ((1 << MAG_BITS) - 1)
    big = mag >> M  # biased exponent field
    mant = mag & ((1 << M) - 1)
    f32e = big - BIAS + 127
    # normal: build the float32 bits; below float32's normal range (E8M0 code 0) shift right
    normal = (f32e << 23) | (mant << (23 - M))
    tiny = (((1 << M) | mant) << (23 - M)) >> tl.minimum(tl.maximum(1 - f32e, 0), 31)
    bits = tl.where(f32e >= 1, normal, tiny)
    val = bits.to(tl.float32, bitcast=True)
    if HAS_SUB:
        val = tl.where(big == 0, mant.to(tl.float32) * SUB_SCALE, val)  # exact: power-of-two
    inf = (mag * 0 + 0x7F800000).to(tl.float32, bitcast=True)
    nan = (mag * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    if NAN_KIND == 0:
        top = big == ((1 << (MAG_BITS - M)) - 1)
        val = tl.where(top & (mant == 0), inf, val)
        val = tl.where(top & (mant != 0), nan, val)
    elif NAN_KIND == 1:
        val = tl.where(mag == ((1 << MAG_BITS) - 1), nan, val)
    elif NAN_KIND == 2:
        val = tl.where(code == NAN_CODE, nan, val)
    if SIGNED:  # the sign bit set with integers: -val is 0 - val on the GPU (-0 -> +0, NaN unsigned)
        sign = ((code >> MAG_BITS) & 1).to(tl.uint32) << 31
        if NAN_KIND == 2:
            sign = tl.where(code == NAN_CODE, 0, sign)  # FNUZ's one NaN (the -0 pattern) is +NaN
        val = (val.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return val


@triton.jit
def bf16_bits(v):
    """bfloat16 bits (int16 block) of a float32 block, rounded to nearest even.

    Stored through an int16 view: Triton's interpreter truncates float32 -> bfloat16, the GPU
    rounds to nearest even; this integer rounding is the GPU's answer in both places.
    """
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(v != v, (b >> 16) | 0x40, r)  # NaN: keep the sign, force a quiet NaN
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def widen_f32(v):
    """float32 of a float16 / bfloat16 / float32 / float64 block, a NaN keeping its sign bit.

    Exact for float16 and bfloat16, round to nearest even for float64. The sign of a NaN is set
    from the input's bits, so it does not depend on how the GPU's conversion treats NaN.
    bfloat16 widens by a shift of its bits (float32's top half): Triton 3.9's interpreter
    converts bfloat16 subnormals wrongly (0x0001 -> 0, 0x0018 -> 2**-127).
    """
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    x = v.to(tl.float32)
    if v.dtype.primitive_bitwidth != 32:  # compile-time branches
        if v.dtype.primitive_bitwidth == 16:
            neg = v.to(tl.int16, bitcast=True) < 0
        else:
            neg = v.to(tl.int64, bitcast=True) < 0
        nan = ((neg.to(tl.uint32) << 31) | 0x7FC00000).to(tl.float32, bitcast=True)
        x = tl.where(x != x, nan, x)
    return x


@triton.jit
def scale_f32(x, s):
    """The float32 product ``x * s`` (rounded once), with the NaN the emulator's numpy gives.

    IEEE 754 leaves the sign of a NaN result open. x86 (numpy, hence the emulator) returns the
    first NaN operand: a NaN ``x`` itself, else a NaN ``s``. The GPU's multiply returns the
    canonical NaN 0x7FFFFFFF, which would turn -NaN into +NaN; this keeps x86's answer.
    """
    y = x * s
    y = tl.where(s != s, s, y)
    return tl.where(x != x, x, y)


@triton.jit
def narrow_keep_nan_sign(v, dtype: tl.constexpr):
    """A float32 block converted to ``dtype`` (float32 or float16, round to nearest even), a NaN
    keeping its sign (the GPU's conversion returns a canonical positive NaN)."""
    out = v.to(dtype)
    if dtype == tl.float16:
        neg = (v.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
        nan = ((neg << 15) | 0x7E00).to(tl.int16).to(tl.float16, bitcast=True)
        out = tl.where(v != v, nan, out)
    return out
