"""A slow, obviously-correct scalar reference for the emulator (the gfloat pattern).

It shares no rounding code with ``fp8sim._numba.encode_core``: instead of splitting bits, it lists every
representable magnitude of the format in increasing order (plus the "virtual" next value just past
``max``), finds the two neighbours of ``|x|`` with a binary search, and applies each rounding
rule to real numbers. All arithmetic is exact in float64: the neighbours are <= 16-bit values in
the same binade as ``|x|``, so ``|x| - lo`` is exact (Sterbenz) and ``hi - lo`` is a power of two.

``round_to_code`` is plain Python. It is written in the subset numba compiles, so the exhaustive
sweeps run the very same source jitted (``round_to_code_jit``); the tests check the jitted and
interpreted versions agree on samples.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from fp8sim._numba.jit import jit_serial
from fp8sim.emulator import ROUNDING_IDS, decode_table
from fp8sim.formats import FloatFormat, get_format

__all__ = ["reference_tables", "round_to_code", "round_to_code_jit", "encode_reference"]

NAN_ERROR = -1
OVERFLOW_ERROR = -2


@functools.lru_cache(maxsize=None)
def reference_tables(fmt: FloatFormat | str) -> tuple:
    """(values, sig_even, max_code, sign_mask, signed, neg_zero, no_zero, has_inf, inf_code,
    nan_kind, nan_code): the plain data :func:`round_to_code` needs.

    ``values`` is the magnitude table by magnitude code, extended by one virtual value past max.

    ``sig_even[c]`` says whether the integral significand of magnitude ``c`` is even (the
    tie-breaking digit of round-to-nearest-even).
    """
    fmt = get_format(fmt)
    table = decode_table(fmt, np.float64)
    values = np.empty(fmt.max_code + 2, dtype=np.float64)
    values[: fmt.max_code + 1] = table[: fmt.max_code + 1]
    # the next value past max in the same format with an unbounded exponent range
    top_mant = fmt.max_code & ((1 << fmt.mantissa_bits) - 1)
    values[-1] = 2.0**fmt.emax * (1 + (top_mant + 1) / 2**fmt.mantissa_bits)
    sig_even = np.empty(values.size, dtype=np.bool_)
    for c in range(values.size):
        v = values[c]
        if v == 0.0:
            sig_even[c] = True
            continue
        quantum = 2.0 ** (max(math.frexp(v)[1] - 1, fmt.emin) - fmt.mantissa_bits)
        sig_even[c] = int(v / quantum) % 2 == 0
    nan_kind = {"ieee": 0, "fn": 1, "fnuz": 2, "none": 3}[fmt.nan]
    return (
        values,
        sig_even,
        fmt.max_code,
        fmt.sign_mask,
        fmt.signed,
        fmt.has_negative_zero,
        not fmt.has_zero,
        fmt.has_inf,
        -1 if fmt.inf_code is None else fmt.inf_code,
        nan_kind,
        -1 if fmt.nan_code is None else fmt.nan_code,
    )


def round_to_code(x, values, sig_even, max_code, sign_mask, signed, neg_zero, no_zero,
                  has_inf, inf_code, nan_kind, nan_code, mode, saturate, r, k):
    """Code of float64 ``x`` (see ``fp8sim.emulator`` for the semantics); -1/-2 on error."""
    neg = math.copysign(1.0, x) < 0.0
    if math.isnan(x):
        if nan_kind == 3:
            return NAN_ERROR
        if nan_kind == 2 or not (neg and signed):
            return nan_code
        return nan_code | sign_mask
    a = abs(x)
    if neg and not signed and a != 0.0:
        return nan_code  # unsigned: negative numbers have no code
    over = False
    idx = 0
    if math.isinf(a):
        over = True
    elif a == 0.0 or (no_zero and a < values[0]):
        if a == 0.0 and neg and neg_zero:
            return sign_mask
        return 0
    else:
        nvals = values.size
        if a >= values[nvals - 1]:
            lo = nvals - 2
            hi = nvals - 1
            beyond = True
        else:
            lo = np.searchsorted(values, a, side="right") - 1
            hi = lo + 1
            beyond = False
        if not beyond and values[lo] == a:
            idx = lo
        else:
            if mode == 0 or mode == 1:  # nearest
                if beyond:
                    idx = hi
                else:
                    d_lo = a - values[lo]
                    d_hi = values[hi] - a
                    if d_lo < d_hi:
                        idx = lo
                    elif d_hi < d_lo:
                        idx = hi
                    elif mode == 1:
                        idx = hi  # ties away from zero
                    elif sig_even[lo] and not sig_even[hi]:
                        idx = lo
                    else:
                        idx = hi  # hi even, or both odd (E8M0): up
            elif mode == 2:
                idx = lo
            elif mode == 3:
                idx = lo if neg else hi
            elif mode == 4:
                idx = hi if neg else lo
            elif mode == 5:
                idx = lo if lo % 2 == 1 else hi
            else:  # stochastic
                if beyond:
                    idx = hi
                else:
                    frac = (a - values[lo]) / (values[hi] - values[lo])
                    t = math.floor(frac * 2.0**k)
                    rr = r >> (32 - k)
                    idx = hi if t + rr >= 2**k else lo
        if idx > max_code:
            toward_zero = mode == 2 or mode == 5 or (mode == 3 and neg) or (mode == 4 and not neg)
            if toward_zero:
                idx = max_code
            else:
                over = True
    if over:
        if saturate:
            idx = max_code
        elif has_inf:
            idx = inf_code
        elif nan_kind == 3:
            return OVERFLOW_ERROR
        elif nan_kind == 2:
            return nan_code
        else:
            idx = nan_code
    if neg and signed:
        if idx == 0 and not neg_zero:
            return 0
        return idx | sign_mask
    return idx


round_to_code_jit = jit_serial(round_to_code)


@jit_serial
def _sweep(xs, rs, values, sig_even, max_code, sign_mask, signed, neg_zero, no_zero,
           has_inf, inf_code, nan_kind, nan_code, mode, saturate, k, out):
    for i in range(xs.size):
        out[i] = round_to_code_jit(xs[i], values, sig_even, max_code, sign_mask, signed,
                                   neg_zero, no_zero, has_inf, inf_code, nan_kind, nan_code,
                                   mode, saturate, rs[i], k)


def encode_reference(x, fmt, *, rounding="rne", saturate=True, rbits=None, srbits=32,
                     jit=True) -> np.ndarray:
    """Reference codes (int64; -1 NaN error, -2 overflow error) for float64-convertible ``x``.

    ``rbits``: uint32 per element for stochastic rounding. ``jit=False`` runs the plain Python.
    """
    fmt = get_format(fmt)
    with np.errstate(invalid="ignore"):  # widening a signalling NaN raises the flag only
        xs = np.ascontiguousarray(np.asarray(x, dtype=np.float64)).reshape(-1)
    rs = np.zeros(xs.size, np.uint32) if rbits is None else np.asarray(rbits, np.uint32).reshape(-1)
    mode = ROUNDING_IDS[rounding]
    tables = reference_tables(fmt)
    out = np.empty(xs.size, dtype=np.int64)
    if jit:
        _sweep(xs, rs, *tables, mode, bool(saturate), int(srbits), out)
    else:
        for i in range(xs.size):
            out[i] = round_to_code(float(xs[i]), *tables, mode, bool(saturate), int(rs[i]),
                                   int(srbits))
    return out.reshape(np.shape(x))
