"""Narrow floating-point formats as data.

A :class:`FloatFormat` is a small frozen record (exponent bits, mantissa bits, bias, which special
values exist); everything else -- ``max``, ``min_normal``, ``eps``, the code of max/NaN/inf -- is a
derived property, named like ``numpy.finfo``.

Code layout (all formats): ``[sign] exponent mantissa``, most significant bit first, sign present
only when ``signed``. Within one sign, magnitudes increase with the code, so the magnitude code
(code without the sign bit) orders values; the rounding code relies on that.

NaN conventions (``nan``):

* ``"ieee"`` -- exponent all ones is inf (mantissa 0) or NaN (mantissa != 0), as IEEE 754.
* ``"fn"``   -- no inf; only the all-ones magnitude code (S.1111.111) is NaN (OCP E4M3, E8M0).
* ``"fnuz"`` -- no inf, no negative zero; the negative-zero code (0x80) is the single NaN.
* ``"none"`` -- no NaN and no inf at all (MX FP6/FP4): every code is a finite number.

Reference facts (OCP 8-bit FP spec v1.0, OCP MX spec v1.0): E4M3 bias 7, max 448, min normal
2^-6, min subnormal 2^-9; E5M2 bias 15, max 57344, min normal 2^-14, min subnormal 2^-16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import numpy as np

__all__ = ["FloatFormat", "get_format", "list_formats", "generic_format_note", "FORMATS", "NAN_KINDS",
           "ROUNDING_MODES", "Rounding"]

NAN_KINDS = ("ieee", "fn", "fnuz", "none")


class Rounding(str, Enum):
    """The rounding modes the emulator implements (exact rules: ``fp8sim._numba.encode_core``).

    A ``str`` enum: ``Rounding.RNE == "rne"``, so every function that takes a rounding name takes
    a member too. Strings are parsed into members once, at the edges (``Rounding(name)``)."""

    RNE = "rne"  #: round to nearest, ties to even (IEEE default; every GPU cast)
    RNA = "rna"  #: round to nearest, ties away from zero
    RTZ = "rtz"  #: round toward zero (truncate)
    UP = "up"  #: round toward +inf
    DOWN = "down"  #: round toward -inf
    ODD = "odd"  #: round to odd (sticky: a later rounding is free of double-rounding errors)
    STOCHASTIC = "stochastic"  #: away from zero with probability = the discarded fraction (Philox)

    def __str__(self) -> str:
        return self.value


#: the rounding modes' names, in :class:`Rounding` order
ROUNDING_MODES = tuple(r.value for r in Rounding)


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format of at most 16 bits.

    Attributes:
        name: canonical name, e.g. ``"e4m3"``.
        exponent_bits: width of the exponent field.
        mantissa_bits: width of the stored (fraction) field, without the implicit bit.
        bias: exponent bias; a normal code with biased exponent ``E`` has value
            ``2**(E - bias) * (1 + M / 2**mantissa_bits)``.
        has_inf: whether the format encodes +-inf (only with ``nan="ieee"``).
        nan: one of :data:`NAN_KINDS`.
        has_subnormals: whether biased exponent 0 encodes subnormals (``0.M * 2**(1 - bias)``).
            Without subnormals (E8M0) biased exponent 0 is an ordinary normal binade.
        signed: whether a sign bit exists (E8M0 is unsigned).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: bool
    nan: str
    has_subnormals: bool = True
    signed: bool = True

    def __post_init__(self) -> None:
        if self.nan not in NAN_KINDS:
            raise ValueError(f"nan must be one of {NAN_KINDS}, got {self.nan!r}")
        if self.exponent_bits < 1 or self.mantissa_bits < 0:
            raise ValueError(f"{self.name}: exponent_bits must be >= 1 and mantissa_bits >= 0")
        if self.bits > 16:
            raise ValueError(f"{self.name}: at most 16 bits are supported, got {self.bits}")
        if self.has_inf and self.nan != "ieee":
            raise ValueError(f"{self.name}: inf exists only with nan='ieee'")
        if self.nan == "ieee" and self.mantissa_bits == 0:
            raise ValueError(f"{self.name}: IEEE NaN needs at least one mantissa bit")
        if self.nan == "fnuz" and not self.signed:
            raise ValueError(f"{self.name}: fnuz NaN lives in the sign bit; format must be signed")
        if self.max_code < 1:
            raise ValueError(f"{self.name}: no finite nonzero values")

    # -- sizes -----------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total storage bits."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    @property
    def magnitude_bits(self) -> int:
        """Bits of exponent + mantissa (the code without its sign)."""
        return self.exponent_bits + self.mantissa_bits

    @property
    def sign_mask(self) -> int:
        return (1 << self.magnitude_bits) if self.signed else 0

    @property
    def code_dtype(self) -> type:
        """numpy dtype of a code array: uint8 up to 8 bits, else uint16."""
        return np.uint8 if self.bits <= 8 else np.uint16

    # -- special values and their codes ---------------------------------------------------
    @property
    def has_nan(self) -> bool:
        return self.nan != "none"

    @property
    def has_zero(self) -> bool:
        """False only for formats without subnormals (E8M0): biased exponent 0 is 2**-bias."""
        return self.has_subnormals

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.has_zero and self.nan != "fnuz"

    @property
    def max_code(self) -> int:
        """Magnitude code (no sign) of the largest finite value."""
        all_ones = (1 << self.magnitude_bits) - 1
        if self.nan == "ieee":
            return all_ones - (1 << self.mantissa_bits)  # top exponent is inf/NaN
        if self.nan == "fn":
            return all_ones - 1  # only all-ones is NaN
        return all_ones  # fnuz / none: every magnitude code is finite

    @property
    def nan_code(self) -> int | None:
        """The canonical (quiet, positive) NaN code; ``None`` if the format has no NaN.

        IEEE: exponent all ones, top mantissa bit set. FN: all ones. FNUZ: the sign bit alone.
        """
        if self.nan == "ieee":
            return (((1 << self.exponent_bits) - 1) << self.mantissa_bits) | (
                1 << (self.mantissa_bits - 1)
            )
        if self.nan == "fn":
            return (1 << self.magnitude_bits) - 1
        if self.nan == "fnuz":
            return 1 << self.magnitude_bits
        return None

    @property
    def inf_code(self) -> int | None:
        """Code of +inf, ``None`` if the format has no inf."""
        if not self.has_inf:
            return None
        return ((1 << self.exponent_bits) - 1) << self.mantissa_bits

    def is_nan_code(self, code: int) -> bool:
        code = int(code)
        if self.nan == "ieee":
            mag = code & ((1 << self.magnitude_bits) - 1)
            return (mag >> self.mantissa_bits) == (1 << self.exponent_bits) - 1 and (
                mag & ((1 << self.mantissa_bits) - 1)
            ) != 0
        if self.nan == "fn":
            return (code & ((1 << self.magnitude_bits) - 1)) == (1 << self.magnitude_bits) - 1
        if self.nan == "fnuz":
            return code == 1 << self.magnitude_bits
        return False

    # -- exponents and values -------------------------------------------------------------
    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        return 1 - self.bias if self.has_subnormals else -self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        return (self.max_code >> self.mantissa_bits) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        mant = self.max_code & ((1 << self.mantissa_bits) - 1)
        return float(2.0**self.emax * (1 + mant / 2**self.mantissa_bits))

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value (``finfo.smallest_normal``)."""
        return float(2.0**self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (``finfo.smallest_subnormal``); min_normal without subnormals."""
        if not self.has_subnormals:
            return self.min_normal
        return float(2.0 ** (self.emin - self.mantissa_bits))

    smallest_subnormal = min_subnormal
    smallest_normal = min_normal

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value (``2**-mantissa_bits``)."""
        return float(2.0**-self.mantissa_bits)

    @property
    def dynamic_range_binades(self) -> float:
        """log2(max / min_subnormal)."""
        return float(np.log2(self.max / self.min_subnormal))

    def __str__(self) -> str:
        return self.name


def _ieee(name: str, e: int, m: int) -> FloatFormat:
    return FloatFormat(name, e, m, (1 << (e - 1)) - 1, has_inf=True, nan="ieee")


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in [
        FloatFormat("e4m3", 4, 3, 7, has_inf=False, nan="fn"),
        _ieee("e5m2", 5, 2),
        FloatFormat("e4m3fnuz", 4, 3, 8, has_inf=False, nan="fnuz"),
        FloatFormat("e5m2fnuz", 5, 2, 16, has_inf=False, nan="fnuz"),
        _ieee("e3m4", 3, 4),
        FloatFormat("e4m3b11fnuz", 4, 3, 11, has_inf=False, nan="fnuz"),
        FloatFormat("e2m3", 2, 3, 1, has_inf=False, nan="none"),
        FloatFormat("e3m2", 3, 2, 3, has_inf=False, nan="none"),
        FloatFormat("e2m1", 2, 1, 1, has_inf=False, nan="none"),
        FloatFormat("e8m0", 8, 0, 127, has_inf=False, nan="fn", has_subnormals=False, signed=False),
        _ieee("fp16", 5, 10),
        _ieee("bf16", 8, 7),
    ]
}

_ALIASES = {
    "e4m3fn": "e4m3",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2fnuz": "e5m2fnuz",
    "float8_e3m4": "e3m4",
    "float8_e4m3b11fnuz": "e4m3b11fnuz",
    "mxfp6_e2m3": "e2m3",
    "float6_e2m3fn": "e2m3",
    "mxfp6_e3m2": "e3m2",
    "float6_e3m2fn": "e3m2",
    "mxfp4": "e2m1",
    "mxfp4_e2m1": "e2m1",
    "float4_e2m1fn": "e2m1",
    "float8_e8m0fnu": "e8m0",
    "e8m0fnu": "e8m0",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
}

_GENERIC = re.compile(r"^e(\d+)m(\d+)$")


def get_format(name: str | FloatFormat) -> FloatFormat:
    """Return the named format, or a generic IEEE-like ``eXmY`` (inf, NaN, subnormals).

    Named formats take precedence over the generic parse (``e4m3`` is OCP E4M3FN, not the
    IEEE-like E4M3 with inf). Raises ValueError listing the valid names.
    """
    if isinstance(name, FloatFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"format must be a name or FloatFormat, got {type(name).__name__}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    match = _GENERIC.match(key)
    if match:
        e, m = int(match.group(1)), int(match.group(2))
        if e < 2 or e > 8 or m < 1 or 1 + e + m > 16:
            raise ValueError(
                f"generic format {name!r}: need 2..8 exponent bits (so every value is exact in "
                f"float32), mantissa bits >= 1 and at most 16 bits in all "
                f"(1 + {e} + {m} = {1 + e + m})"
            )
        return _ieee(key, e, m)
    valid = ", ".join(list(FORMATS) + sorted(_ALIASES))
    raise ValueError(f"unknown format {name!r}; valid: {valid}, or any eXmY of up to 16 bits")


def generic_format_note(name: str) -> str | None:
    """One line about ``name`` when it is an ``eXmY`` that no named format or alias has (so a
    generic IEEE-like format: a slip for ``e4m3`` such as ``e4m4`` shows); None otherwise, and
    for a name that does not parse (``get_format`` says why)."""
    key = name.strip().lower() if isinstance(name, str) else ""
    key = _ALIASES.get(key, key)
    if key in FORMATS or not _GENERIC.match(key):
        return None
    try:
        f = get_format(key)
    except ValueError:
        return None
    return (f"{name} is not a named format: it is a generic IEEE-like {f.bits}-bit format (bias {f.bias}, "
            f"max {f.max:g}, inf and NaN as IEEE, subnormals); the named ones: {', '.join(FORMATS)}")


def list_formats() -> list[FloatFormat]:
    """The named formats, in a stable order."""
    return list(FORMATS.values())
