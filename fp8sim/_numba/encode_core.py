"""The numba core of the emulator: round one value to a narrow-format code, from its bits.

A finite input is taken apart exactly as ``value = sig * 2**(e - p)`` (``sig`` an integer with its
leading bit at position ``p`` for normal inputs; ``e`` the unbiased exponent): from the float32
or float64 bit pattern directly, so float64 inputs are never rounded through float32.

Rounding works on the code itself: the target's quantum at exponent ``e`` is
``2**(max(e, emin) - m)``; the kept significand ``sig >> shift`` added to the code of the
binade's start gives the truncated code, and an increment moves to the next code. Codes of one
sign increase with magnitude, so the carry out of the mantissa into the exponent -- and out of
the largest binade into "overflow" -- falls out of plain integer addition.

Rounding modes (ids in ``ROUNDING_IDS``):

* ``rne`` nearest, ties to the even significand (the even code when m >= 1; E8M0, whose
  significands are all 1, rounds ties up); ``rna`` nearest, ties away from zero;
* ``rtz`` toward zero; ``up`` toward +inf; ``down`` toward -inf;
* ``odd`` round to odd: truncate, then set the code's lowest bit if anything was discarded
  (never overflows, like ``rtz``);
* ``stochastic``: with ``k`` random bits ``r``, away from zero iff
  ``floor(discarded_fraction * 2**k) + r >= 2**k``.

Overflow ("round first, then compare with max"): a rounded code above the largest finite code is
clamped to max when saturating, and always for the modes that round toward zero at that sign
(``rtz``, ``odd``, ``up`` for negatives, ``down`` for positives); otherwise it becomes inf where the
format has inf, else NaN, else the ``ERR_OVERFLOW`` sentinel (formats with no NaN).
"""

from __future__ import annotations


from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from fp8sim._numba.bitcast import add32, and32, bits_f32, f32_bits, or32, shl32, shr32, sub32
from fp8sim._numba.jit import jit_kernel, jit_scalar, serial_twin
from fp8sim.philox import randint_scalar

__all__ = [
    "ERR_NAN",
    "ERR_OVERFLOW",
    "FormatParams",
    "NAN_IEEE",
    "NAN_FN",
    "NAN_FNUZ",
    "NAN_NONE",
    "encode_fields",
    "encode_f32_kernel",
    "encode_f64_kernel",
    "encode_fast",
    "encode_f32_rne_kernel",
    "decode_kernel",
]

ERR_NAN = -1  # NaN input, format has no NaN
ERR_OVERFLOW = -2  # overflow or inf, format has neither inf nor NaN, not saturating

# mode ids -- keep in sync with emulator.ROUNDING_IDS
RNE, RNA, RTZ, UP, DOWN, ODD, STOCHASTIC = 0, 1, 2, 3, 4, 5, 6

# nan_kind of a format: IEEE-style (all-ones exponent), "fn" (only the all-ones code),
# "fnuz" (the negative-zero code), none
NAN_IEEE, NAN_FN, NAN_FNUZ, NAN_NONE = 0, 1, 2, 3


class FormatParams(NamedTuple):
    """What the general kernels need of a format, as ints (numba takes a named tuple of ints,
    not the dataclass): built by ``fp8sim.emulator.format_params``."""

    mantissa_bits: int
    emin: int
    max_code: int
    sign_mask: int
    signed: int  # 0 / 1
    has_subnormals: int  # 0 / 1
    nan_kind: int  # NAN_IEEE / NAN_FN / NAN_FNUZ / NAN_NONE
    nan_code: int  # the positive NaN code, -1 when there is none
    inf_code: int  # the positive inf code, -1 when there is none


@jit_scalar
def _nan_code(neg, params):
    """The format's NaN with the input's sign where the format can carry it."""
    if params.nan_kind == NAN_NONE:
        return ERR_NAN
    if params.nan_kind == NAN_FNUZ:  # the single NaN is the negative-zero code
        return params.nan_code
    if neg and params.signed:
        return params.nan_code | params.sign_mask
    return params.nan_code


@jit_scalar
def _overflow_code(neg, params, saturate):
    """Result of an overflow that rounds away from zero (or of an infinite input)."""
    sign = params.sign_mask if (neg and params.signed) else 0
    if saturate:
        return params.max_code | sign
    if params.inf_code >= 0:
        return params.inf_code | sign
    if params.nan_kind == NAN_NONE:
        return ERR_OVERFLOW
    return _nan_code(neg, params)


@jit_scalar
def encode_fields(neg, is_nan, is_inf, e, sig, p, params, mode, saturate, r, k):
    """Code of ``(-1)**neg * sig * 2**(e - p)`` (or of NaN/inf) -- see the module docstring.

    ``sig`` (< 2**(p+1)) is the input significand, ``e`` its unbiased exponent; ``sig == 0`` is a
    zero. ``r`` is a uint32 random word (top ``k`` bits used) for stochastic rounding.
    Returns the code (>= 0) or ``ERR_NAN`` / ``ERR_OVERFLOW``.
    """
    mbits = params.mantissa_bits
    emin = params.emin
    max_code = params.max_code
    sign_mask = params.sign_mask
    signed = params.signed
    has_sub = params.has_subnormals
    nan_kind = params.nan_kind

    if is_nan:
        return _nan_code(neg, params)
    if neg and not signed and (is_inf or sig != 0):
        return _nan_code(neg, params)  # unsigned format: a negative number has no code
    if is_inf:
        return _overflow_code(neg, params, saturate)
    if sig == 0:
        if neg and signed and has_sub and nan_kind != NAN_FNUZ:
            return sign_mask  # negative zero
        return 0  # +0, FNUZ's only zero, or E8M0's smallest value (it has no zero)

    if not has_sub and e < emin:
        # no zero and no subnormals (E8M0): anything below the smallest value becomes it
        return 0

    # -- split sig at the target quantum ------------------------------------------------
    q_e = e if e > emin else emin
    shift = (p - mbits) + (q_e - e)  # > 0 for every supported input/format pair
    if shift >= 64:
        kept = np.int64(0)
        above = False
        tie = False
        inexact = True
        top = np.int64(0)
        if shift - k < 64:
            top = np.int64(sig >> np.uint64(shift - k))
    else:
        ushift = np.uint64(shift)
        kept = np.int64(sig >> ushift)
        rem = sig & ((np.uint64(1) << ushift) - np.uint64(1))
        half = np.uint64(1) << np.uint64(shift - 1)
        above = rem > half
        tie = rem == half
        inexact = rem != 0
        if shift >= k:
            top = np.int64(rem >> np.uint64(shift - k))
        else:
            top = np.int64(rem << np.uint64(k - shift))

    base = np.int64(q_e - emin) << mbits
    if not has_sub:
        base -= np.int64(1) << mbits  # the implicit bit of binade 0 is not code 2**m
    code = base + kept

    # -- round (as arithmetic, not branches: the data-dependent choices are unpredictable) -----
    exact = np.int64(0) if inexact else np.int64(1)
    up = np.int64(0)
    if mode == RNE:
        # ties go to the even significand; for m >= 1 that is the even code, for m = 0
        # (E8M0) every significand is 1, so ties round up (as ml_dtypes and torch do)
        up = (np.int64(above) | (np.int64(tie) & kept)) & 1
    elif mode == RNA:
        up = np.int64(above) | np.int64(tie)
    elif mode == UP:
        up = (1 - exact) & (1 - np.int64(neg))
    elif mode == DOWN:
        up = (1 - exact) & np.int64(neg)
    elif mode == ODD:
        code |= 1 - exact
    elif mode == STOCHASTIC:
        rr = np.int64(r >> np.uint32(32 - k))
        up = np.int64(top + rr >= (np.int64(1) << k))
    # RTZ: keep the truncated code
    code += up

    # -- overflow -------------------------------------------------------------------------
    if code > max_code:
        toward_zero = (
            mode == RTZ or mode == ODD or (mode == UP and neg) or (mode == DOWN and not neg)
        )
        if toward_zero:
            code = max_code
        else:
            return _overflow_code(neg, params, saturate)

    # sign bit, except on FNUZ's zero (-0 has no code there)
    keep_sign = np.int64(neg) & np.int64(signed) & (1 - (np.int64(code == 0) & np.int64(nan_kind == NAN_FNUZ)))
    return code | (keep_sign * sign_mask)


@jit_scalar
def _normalized(neg, e, sig, p):
    """Fields of a subnormal input with its leading bit moved up to position ``p``, so that
    ``e`` is its true exponent (a target may have normals below the input's subnormals)."""
    if sig == 0:
        return neg, False, False, e, sig
    top = np.uint64(1) << np.uint64(p)
    while sig < top:
        sig = sig << np.uint64(1)
        e -= 1
    return neg, False, False, e, sig


@jit_scalar
def _fields_f32(u):
    """(neg, is_nan, is_inf, e, sig) of a float32 bit pattern (uint32)."""
    neg = (u >> np.uint32(31)) != 0
    ebits = np.int64((u >> np.uint32(23)) & np.uint32(0xFF))
    man = np.uint64(u & np.uint32(0x7FFFFF))
    if ebits == 0xFF:
        return neg, man != 0, man == 0, np.int64(0), np.uint64(0)
    if ebits == 0:
        return _normalized(neg, np.int64(-126), man, 23)
    return neg, False, False, ebits - 127, man | np.uint64(1 << 23)


@jit_scalar
def _fields_f64(u):
    """(neg, is_nan, is_inf, e, sig) of a float64 bit pattern (uint64)."""
    neg = (u >> np.uint64(63)) != 0
    ebits = np.int64((u >> np.uint64(52)) & np.uint64(0x7FF))
    man = u & np.uint64((1 << 52) - 1)
    if ebits == 0x7FF:
        return neg, man != 0, man == 0, np.int64(0), np.uint64(0)
    if ebits == 0:
        return _normalized(neg, np.int64(-1022), man, 52)
    return neg, False, False, ebits - 1023, man | np.uint64(1 << 52)


@jit_scalar
def _random_word(i, rbits, use_rbits, k0, k1):
    if use_rbits:
        return np.uint32(rbits[i])
    return np.uint32(randint_scalar(k0, k1, i))


@jit_kernel
def encode_f32_kernel(xbits, out, status, params, mode, saturate, rbits, use_rbits, k0, k1, k):
    """Encode a flat float32 bit array (uint32) into ``out``; ``status[i]`` gets 1 (NaN) or 2
    (overflow) for sentinel results when ``status`` is non-empty, else sentinels become 0."""
    n = xbits.size
    track = status.size > 0
    for i in numba.prange(n):
        neg, is_nan, is_inf, e, sig = _fields_f32(xbits[i])
        r = np.uint32(0)
        if mode == STOCHASTIC:
            r = _random_word(i, rbits, use_rbits, k0, k1)
        c = encode_fields(neg, is_nan, is_inf, e, sig, 23, params, mode, saturate, r, k)
        if c < 0:
            if track:
                status[i] = -c
            c = 0
        out[i] = c


@jit_kernel
def encode_f64_kernel(xbits, out, status, params, mode, saturate, rbits, use_rbits, k0, k1, k):
    """As :func:`encode_f32_kernel` for float64 bit patterns (uint64)."""
    n = xbits.size
    track = status.size > 0
    for i in numba.prange(n):
        neg, is_nan, is_inf, e, sig = _fields_f64(xbits[i])
        r = np.uint32(0)
        if mode == STOCHASTIC:
            r = _random_word(i, rbits, use_rbits, k0, k1)
        c = encode_fields(neg, is_nan, is_inf, e, sig, 52, params, mode, saturate, r, k)
        if c < 0:
            if track:
                status[i] = -c
            c = 0
        out[i] = c


@jit_kernel
def decode_kernel(codes, table, out):
    """``out[i] = table[codes[i]]`` over a flat array, in parallel."""
    for i in numba.prange(codes.size):
        out[i] = table[codes[i]]


@jit_scalar
def _fast_code(s, a, p, emax_in, bias_in, mbits, emin, max_code, mag_bits, over_pos, over_neg,
               inf_res, nan_code, fnuz, mode, r, k):
    """Code of the input with sign ``s`` (0/1) and magnitude bits ``a`` (int64), written as
    selects so that loops over it vectorize; see :func:`encode_fast`.

    ``p``, ``emax_in``, ``bias_in`` describe the input: 23, 0xFF, 127 for float32; 52, 0x7FF,
    1023 for float64.
    """
    E = a >> p
    man = a & ((np.int64(1) << p) - 1)
    sig = man | (np.int64(E != 0) << p)
    e_eff = max(E, 1)
    emin_b = emin + bias_in  # the target's smallest normal exponent, biased like the input
    shift_true = (p - mbits) + max(emin_b - e_eff, 0)
    shift = min(shift_true, 62)  # sig < 2**(p+1) <= 2**53: past 62 nothing changes
    kept = sig >> shift
    rem = sig & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    code = (max(e_eff - emin_b, 0) << mbits) + kept
    inexact = np.int64(rem != 0)
    if mode == RNE:
        code += (np.int64(rem > half) | (np.int64(rem == half) & kept)) & 1
    elif mode == RNA:
        code += np.int64(rem >= half)
    elif mode == UP:
        code += inexact & (1 - s)
    elif mode == DOWN:
        code += inexact & s
    elif mode == ODD:
        code |= inexact
    elif mode == STOCHASTIC:
        # floor(discarded fraction * 2**k): the top k bits of rem (rem < 2**shift)
        right = min(max(shift_true - k, 0), 62)
        left = min(max(k - shift_true, 0), 62)
        top = (rem >> right) << left
        rr = np.int64(r) >> (32 - k)
        code += np.int64(top + rr >= (np.int64(1) << k))
    over = over_neg if s == 1 else over_pos
    code = over if code > max_code else code
    inf_bits = emax_in << p
    code = inf_res if a == inf_bits else code
    is_nan = np.int64(a > inf_bits)
    code = nan_code if is_nan == 1 else code
    drop_sign = fnuz & (np.int64(code == 0) | is_nan)
    return code | ((s & (1 - drop_sign)) << mag_bits)


def _fast_loop(mode: int, parallel: bool):
    """The branch-free encode loop compiled for one rounding mode: ``mode`` is a constant of the
    closure, so LLVM folds the mode's branches in :func:`_fast_code` and vectorizes (a mode
    passed as an argument would reach the loop as a variable). ``parallel`` picks ``prange``
    threads or the serial twin (see ``PARALLEL_MIN_ELEMENTS``)."""

    @jit_kernel
    def encode_fast_loop(xbits, out, p, emax_in, bias_in, mbits, emin, max_code, mag_bits,
                         over_pos, over_neg, inf_res, nan_code, fz, rbits, use_rbits, k0, k1, k):
        sbit = xbits.itemsize * 8 - 1  # the sign bit of the input word
        amask = (np.int64(1) << sbit) - 1 if sbit < 63 else np.int64(0x7FFFFFFFFFFFFFFF)
        for i in numba.prange(xbits.size):
            u = xbits[i]
            r = np.uint32(0)
            if mode == STOCHASTIC:  # rbits given, else Philox inline, one word per flat index
                r = np.uint32(rbits[i]) if use_rbits else np.uint32(randint_scalar(k0, k1, i))
            out[i] = _fast_code(np.int64(u >> sbit) & 1, np.int64(u) & amask, p, emax_in,
                                bias_in, mbits, emin, max_code, mag_bits, over_pos, over_neg,
                                inf_res, nan_code, fz, mode, r, k)

    return encode_fast_loop if parallel else serial_twin(encode_fast_loop)


_FAST_LOOPS = {(mode, parallel): _fast_loop(mode, parallel)
               for mode in (RNE, RNA, RTZ, UP, DOWN, ODD, STOCHASTIC) for parallel in (True, False)}


def encode_fast(xbits, out, p, emax_in, bias_in, mbits, emin, max_code, mag_bits, over_code,
                nan_code, fnuz, mode, saturate, rbits, use_rbits, k0, k1, k, parallel):
    """Branch-free twin of :func:`encode_f32_kernel` / :func:`encode_f64_kernel`, same results.

    Valid for a signed format with subnormals and a NaN (every FP8 format, e3m4, fp16, bf16,
    eXmY) whose ``emin`` lies inside the input's normal range (float32: ``emin >= -126``), so
    input subnormals need no normalizing. ``xbits``: uint32 (float32) or uint64 (float64) bit
    patterns; ``p``, ``emax_in``, ``bias_in`` describe them (23, 0xFF, 127 or 52, 0x7FF, 1023).
    ``over_code`` is what a non-saturating overflow becomes (inf code, else NaN code),
    ``nan_code`` the positive NaN code, ``fnuz`` whether -0 has no code (zeros and the NaN then
    carry no sign). Runs the loop compiled for ``mode`` (:func:`_fast_loop`), on threads when
    ``parallel``; the exhaustive tests hold it to the reference.
    """
    # what an overflowing code becomes, per sign: max where saturating or rounding toward zero
    clamp_pos = saturate or mode in (RTZ, ODD, DOWN)
    clamp_neg = saturate or mode in (RTZ, ODD, UP)
    over_pos = max_code if clamp_pos else over_code
    over_neg = max_code if clamp_neg else over_code
    inf_res = max_code if saturate else over_code  # an infinite input
    _FAST_LOOPS[mode, parallel](xbits, out, p, emax_in, bias_in, mbits, emin, max_code, mag_bits,
                                over_pos, over_neg, inf_res, nan_code, np.int64(bool(fnuz)), rbits,
                                use_rbits, k0, k1, k)


@intrinsic
def _rne_code_u32(typingctx, u, sh, half_m1, adj, mn, sub_base, mx, ov, nc, knan, sb):
    """The code of float32 bits ``u`` under RNE, in 32-bit integer operations only (numba would
    widen uint32 arithmetic to 64 bits and halve the vector lanes); see
    :func:`encode_f32_rne_kernel` for the method and the arguments."""
    sig = types.uint32(*([types.uint32] * 11))

    def codegen(context, builder, signature, args):
        u_, sh_, half_, adj_, mn_, base_, mx_, ov_, nc_, knan_, sb_ = args
        i32 = ir.IntType(32)

        def k(v):
            return ir.Constant(i32, v)

        s = builder.lshr(u_, k(31))
        a = builder.and_(u_, k(0x7FFFFFFF))
        # target normal range: RNE on the bit pattern
        lsb = builder.and_(builder.lshr(a, sh_), k(1))
        r = builder.add(builder.add(a, half_), lsb)
        normal = builder.sub(builder.lshr(r, sh_), adj_)
        # target subnormal range: the significand shifted right by st = sh + emin_b - max(E, 1)
        e = builder.lshr(a, k(23))
        e_is0 = builder.icmp_unsigned("==", e, k(0))
        e_eff = builder.select(e_is0, k(1), e)
        sig_ = builder.or_(builder.and_(a, k(0x7FFFFF)), builder.select(e_is0, k(0), k(0x800000)))
        st = builder.sub(base_, e_eff)  # >= sh + 1 wherever this branch is taken
        st = builder.select(builder.icmp_signed("<", st, k(1)), k(1), st)
        st = builder.select(builder.icmp_signed(">", st, k(31)), k(31), st)  # sig < 2**24: 0 either way
        kept = builder.lshr(sig_, st)
        rem = builder.and_(sig_, builder.sub(builder.shl(k(1), st), k(1)))
        half = builder.shl(k(1), builder.sub(st, k(1)))
        up = builder.or_(builder.icmp_unsigned(">", rem, half),
                         builder.and_(builder.icmp_unsigned("==", rem, half),
                                      builder.icmp_unsigned("!=", builder.and_(kept, k(1)), k(0))))
        sub = builder.add(kept, builder.zext(up, i32))
        code = builder.select(builder.icmp_unsigned(">=", a, mn_), normal, sub)
        code = builder.select(builder.icmp_unsigned(">", code, mx_), ov_, code)
        is_nan = builder.icmp_unsigned(">", a, k(0x7F800000))
        code = builder.select(is_nan, nc_, code)
        signless = builder.or_(is_nan, builder.icmp_unsigned("==", code, k(0)))
        keep = builder.select(signless, knan_, k(1))
        return builder.or_(code, builder.shl(builder.and_(s, keep), sb_))

    return sig, codegen


@jit_kernel
def encode_f32_rne_kernel(xbits, out, shift, adj, minnorm_bits, emin_b, max_code, over_code, nan_code, fnuz,
                          mag_bits):
    """Round to nearest even from float32 bit patterns in 32-bit lanes; the same codes as
    :func:`encode_fast` in ``RNE`` mode for the formats it takes (all with mantissa
    bits ``m <= 22`` and ``emin >= -126``).

    With ``a`` the magnitude bits of the input and ``shift = 23 - m``:

    * target normal range (``a >= minnorm_bits``, the bits of ``2**emin``): RNE on the bit
      pattern, ``r = a + 2**(shift-1) - 1 + ((a >> shift) & 1)``; the code is
      ``(r >> shift) - adj`` with ``adj = (emin + 127 - 1) << m`` (the float32 and target
      exponent biases differ). A carry out of the mantissa moves into the exponent, as it should;
    * target subnormal range: the quantum is fixed, ``2**(emin - m)``; the significand (implicit
      bit included) shifted right by ``shift + emin_b - max(E, 1)`` (``emin_b = emin + 127``,
      ``E`` the input's biased exponent), rounded to nearest even on the discarded bits, is the
      code (``2**m``, the smallest normal's code, when it rounds up). Integer arithmetic only: no
      float operation, so the result does not depend on the CPU's denormals-are-zero /
      flush-to-zero mode (``torch.set_flush_denormal``);
    * a code above ``max_code`` (an inf input too) becomes ``over_code`` (``max_code`` when
      saturating, else inf or NaN); NaN inputs ``nan_code``; the sign goes to bit ``mag_bits``,
      except where ``fnuz`` (no -0: zeros and NaN carry no sign).

    Every operation is a 32-bit integer one (:func:`_rne_code_u32`), so AVX-512 runs 16 lanes.
    """
    sh = np.uint32(shift)
    half_m1 = np.uint32((1 << (shift - 1)) - 1)
    adj32 = np.uint32(adj)
    mn = np.uint32(minnorm_bits)
    base = np.uint32(shift + emin_b)
    mx = np.uint32(max_code)
    ov = np.uint32(over_code)
    nc = np.uint32(nan_code)
    knan = np.uint32(0) if fnuz else np.uint32(1)
    sb = np.uint32(mag_bits)
    for i in numba.prange(xbits.size):
        out[i] = _rne_code_u32(xbits[i], sh, half_m1, adj32, mn, base, mx, ov, nc, knan, sb)


_MAG32 = np.uint32(0x7FFFFFFF)
_INF32 = np.uint32(0x7F800000)


def fpu_rne_ok(emin: int, emax: int, mantissa_bits: int) -> bool:
    """Whether :func:`encode_f32_rne_fpu_kernel` serves a format: every float32 subnormal input
    rounds to 0 (``min_subnormal / 2 >= 2**-126``, so the CPU's denormals-are-zero mode cannot
    change a code) and the rounding constant stays a float32 up to max (``emax + 23 - m <=
    127``). All 8-bit formats and fp16; not bf16 or the e8mY formats."""
    return emin - mantissa_bits - 1 >= -126 and emax + 23 - mantissa_bits <= 127


@jit_kernel
def encode_f32_rne_fpu_kernel(x, out, shift, adj, minnorm_bits, csub, max_code, over_code, nan_code,
                              fnuz, mag_bits):
    """Round to nearest even from float32 with one FPU add: the codes of
    :func:`encode_f32_rne_kernel` for the formats :func:`fpu_rne_ok` admits, in about half the
    operations.

    With ``a = |x|`` in binade ``e`` and ``m = 23 - shift`` mantissa bits, ``C`` is the power of
    two whose float32 ulp is the format's quantum at ``a``: ``2**(e + 23 - m)``, at least
    ``csub = 2**(emin - m + 23)`` (the fixed quantum of the subnormal range). ``r = (a + C) - C``
    is ``a`` rounded to nearest even at that quantum by the FPU (the default rounding mode; a
    carry into the next binade included), exact in float32. The code of a normal ``r`` is
    ``(bits(r) >> shift) - adj`` as in the integer kernel; of a subnormal ``r = k * 2**(emin -
    m)`` it is ``k = bits(r + csub) - bits(csub)`` (``csub``'s ulp is that quantum). No float32
    subnormal is read or made for these formats, so denormals-are-zero / flush-to-zero modes do
    not matter. Huge ``a`` (``C``'s exponent beyond float32: the 32-bit add carries into the sign
    bit, so ``C`` is negative) gives ``r`` = inf, NaN or about ``a``, a code
    above max either way; then overflow, NaN and sign as in :func:`encode_f32_rne_kernel`. 32-bit
    lanes throughout (:mod:`fp8sim._numba.bitcast`).

    Assumes the FPU's default round-to-nearest-even mode (as numpy, torch and every Python
    process run): under ``fesetround`` toward zero or upward the two adds round differently and
    the codes change. :func:`encode_f32_rne_kernel` (integer only) does not depend on it.
    """
    sh = np.uint32(shift)
    adj32 = np.uint32(adj)
    mn = np.uint32(minnorm_bits)
    c_min = f32_bits(csub)
    c_add = shl32(sh, np.uint32(23))
    mx = np.uint32(max_code)
    ov = np.uint32(over_code)
    nc = np.uint32(nan_code)
    knan = np.uint32(0) if fnuz else np.uint32(1)
    sb = np.uint32(mag_bits)
    for i in numba.prange(x.size):
        u = f32_bits(x[i])
        ab = and32(u, _MAG32)
        a = bits_f32(ab)
        c = bits_f32(max(add32(and32(ab, _INF32), c_add), c_min))
        r = (a + c) - c
        rb = f32_bits(r)
        code = sub32(shr32(rb, sh), adj32) if rb >= mn else sub32(f32_bits(r + csub), c_min)
        code = ov if code > mx else code
        is_nan = ab > _INF32
        code = nc if is_nan else code
        keep = knan if (is_nan | (code == np.uint32(0))) else np.uint32(1)
        out[i] = or32(code, shl32(and32(shr32(u, np.uint32(31)), keep), sb))


# serial twins for small arrays (see fp8sim._numba.jit.PARALLEL_MIN_ELEMENTS)
encode_f32_rne_kernel_serial = serial_twin(encode_f32_rne_kernel)
encode_f32_rne_fpu_kernel_serial = serial_twin(encode_f32_rne_fpu_kernel)
encode_f32_kernel_serial = serial_twin(encode_f32_kernel)
encode_f64_kernel_serial = serial_twin(encode_f64_kernel)
decode_kernel_serial = serial_twin(decode_kernel)
