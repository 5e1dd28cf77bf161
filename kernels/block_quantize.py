"""block_quantize: per-group scales computed in the kernel, then the cast -- one pass.

The same codes, scales and amaxes as ``fp8sim.scaling.quantize_scaled(x, fmt, granularity)``
with just-in-time scales (see that module for the rules, mirrored here in float32):

* ``row``, ``col``, ``block:RxC`` (e.g. 1x128, 128x128): amax per tile over the non-NaN
  elements; ``scale = (fmt.max / max(amax, epsilon)) / 2**margin``, inf -> float32 max,
  ``pow2`` rounds down to a power of two, amax 0/inf gives 1; ``scale_inv = 1 / scale``.
* ``mx`` / ``mx:rceil`` (1x32 along the last axis): E8M0 shared scale ``X = 2**e`` from the
  block amax (``floor``: ``floor(log2 amax) - emax``; ``rceil``: ``ceil(log2(amax * (1/max)))``),
  ``e`` clamped to [-127, 127]; a block with a NaN or inf has a NaN scale (E8M0 0xFF) and its
  elements encode as NaN (0 in formats without NaN). The elements are ``x * 2**-e``.

Then ``codes = encode(float32(x * scale))`` with the software cast (every rounding mode; the
stochastic counter is the flat index in ``x``). Each program handles a (BLOCK_R, BLOCK_C) region:
several one-row tiles at once when tiles are one row high, else exactly one tile. ``col`` runs
as ``row`` on the transposed view (strides swapped, counters still those of ``x``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from fp8sim.formats import FloatFormat, get_format
from fp8sim.scaling import parse_granularity, view2d
from fp8sim.kernels.cast import (cast_args, check_sentinels, code_dtype, encode_f32, is_interpreter, scale_f32,
                           widen_f32)

__all__ = ["block_quantize", "aot_variants"]

_F32_MAX = float(np.finfo(np.float32).max)


@triton.jit
def _floor_log2(v):
    """floor(log2(v)) of a positive finite float32 block (subnormals included), int32."""
    b = v.to(tl.int32, bitcast=True)
    eb = b >> 23
    man = b & 0x7FFFFF
    lead = (man.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    return tl.where(eb > 0, eb - 127, lead - 149)


@triton.jit
def _is_pow2(v):
    """Whether a positive finite float32 block holds powers of two."""
    b = v.to(tl.int32, bitcast=True)
    man = b & 0x7FFFFF
    return tl.where((b >> 23) > 0, man == 0, (man & (man - 1)) == 0)


@triton.jit
def _pow2(e):
    """2**e as float32 for an int32 block with -149 <= e <= 127 (exact, subnormals too)."""
    normal = (tl.maximum(e, -126) + 127) << 23
    tiny = 1 << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, normal, tiny).to(tl.float32, bitcast=True)


@triton.jit
def _block_quantize_kernel(
    x_ptr,  # input, any float dtype, logical 2-D (n_rows, n_cols), any strides
    codes_ptr,  # output codes, addressed with (sc_r, sc_c)
    scale_inv_ptr,  # output float32 scale_inv per tile, addressed with (ss_r, ss_c)
    amax_ptr,  # output float32 amax per tile (same addressing)
    e8m0_ptr,  # output uint8 E8M0 scale codes per tile (MX only; same addressing)
    seed,  # Philox key of stochastic rounding (unused otherwise)
    n_rows, n_cols,  # logical 2-D sizes (of the transposed view for ``col``)
    sx_r, sx_c,  # element strides of x
    sc_r, sc_c,  # element strides of codes
    cnt_r, cnt_c,  # stochastic counter = row * cnt_r + col * cnt_c (flat index in x)
    ss_r, ss_c,  # strides of the per-tile outputs over (tile row, tile column)
    eps,  # float32 epsilon: amax below it counts as eps
    margin_div,  # float32(2**margin)
    TILE_R: tl.constexpr,  # rows per tile (1: BLOCK_R one-row tiles per program)
    TILE_C: tl.constexpr,  # columns per tile
    BLOCK_R: tl.constexpr,  # rows per program (power of two)
    BLOCK_C: tl.constexpr,  # power of two >= min(TILE_C, n_cols)
    MX: tl.constexpr,  # 1: E8M0 scales (MX rule), 0: fmt.max / amax rule
    RCEIL: tl.constexpr,  # MX rule: 1 rceil, 0 floor
    POW2: tl.constexpr,  # non-MX: round the scale down to a power of two
    FMAX: tl.constexpr,  # the element format's max
    EMAX: tl.constexpr,  # the element format's emax (MX floor rule)
    RCP_MAX: tl.constexpr,  # float32(1 / fmt.max) (MX rceil rule)
    F32_MAX: tl.constexpr,  # largest float32
    M: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr, SIGN_MASK: tl.constexpr,
    SIGNED: tl.constexpr, HAS_SUB: tl.constexpr, NAN_KIND: tl.constexpr, NAN_CODE: tl.constexpr,
    INF_CODE: tl.constexpr, MODE: tl.constexpr, SATURATE: tl.constexpr, K: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    if TILE_R == 1:
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        row_end = n_rows
    else:
        rows = pid_r * TILE_R + tl.arange(0, BLOCK_R)
        row_end = tl.minimum(n_rows, (pid_r + 1) * TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, BLOCK_C)
    col_end = tl.minimum(n_cols, (pid_c + 1) * TILE_C)
    mask = (rows[:, None] < row_end) & (cols[None, :] < col_end)
    x = tl.load(x_ptr + rows[:, None] * sx_r + cols[None, :] * sx_c, mask=mask, other=0.0)
    x = widen_f32(x)

    # -- amax per tile (a vector over the block's rows; one value repeated for tall tiles) ----
    is_nan = (x != x) & mask
    mag = tl.where(is_nan | (mask == 0), 0.0, tl.abs(x))
    amax = tl.max(mag, axis=1)
    nans = tl.sum(is_nan.to(tl.int32), axis=1)
    if TILE_R != 1:
        amax = tl.zeros_like(amax) + tl.max(amax, axis=0)
        nans = tl.zeros_like(nans) + tl.sum(nans, axis=0)
    nan = (nans * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    inf = (nans * 0 + 0x7F800000).to(tl.float32, bitcast=True)

    if MX:
        amax = tl.where(nans > 0, nan, amax)
        finite = (amax == amax) & (amax != inf)
        pos = finite & (amax > 0)
        safe = tl.where(pos, amax, 1.0)
        if RCEIL:
            d = safe * RCP_MAX
            pos = pos & (d > 0)
            d = tl.where(d > 0, d, 1.0)
            e = _floor_log2(d) + tl.where(_is_pow2(d), 0, 1)
        else:
            e = _floor_log2(safe) - EMAX
        e = tl.where(pos, e, -127)
        e = tl.minimum(tl.maximum(e, -127), 127)
        mult = _pow2(-e)
        scale_inv = tl.where(finite, _pow2(e), nan)
        y = x * mult[:, None]
        if NAN_KIND == 3:
            y = tl.where(finite[:, None], y, 0.0)
        else:
            y = tl.where(finite[:, None], y, nan[:, None])
    else:
        a = tl.where(amax < eps, eps, amax)
        keep = (a == inf) | (a == 0)
        s = tl.div_rn(tl.zeros_like(a) + FMAX, tl.where(keep, 1.0, a))
        s = tl.div_rn(s, margin_div)
        s = tl.where(s == inf, F32_MAX, s)
        if POW2:
            s = _pow2(_floor_log2(s))
        s = tl.where(keep, 1.0, s)
        scale_inv = tl.div_rn(tl.zeros_like(s) + 1.0, s)
        y = scale_f32(x, s[:, None])
        e = nans * 0

    cnt = rows[:, None] * cnt_r + cols[None, :] * cnt_c
    if MODE == 6:
        r = tl.randint(seed, cnt)
    else:
        r = cnt.to(tl.uint32)  # unused
    code = encode_f32(y, r, M, EMIN, MAX_CODE, SIGN_MASK, SIGNED, HAS_SUB, NAN_KIND, NAN_CODE,
                      INF_CODE, MODE, SATURATE, K)
    tl.store(codes_ptr + rows[:, None] * sc_r + cols[None, :] * sc_c,
             code.to(codes_ptr.dtype.element_ty), mask=mask)

    # -- per-tile outputs: one per row for one-row tiles, else the block's first row --------
    if TILE_R == 1:
        t_off = rows * ss_r + pid_c * ss_c
        t_mask = rows < n_rows
    else:
        t_off = pid_r * ss_r + pid_c * ss_c + rows * 0
        t_mask = tl.arange(0, BLOCK_R) == 0
    tl.store(scale_inv_ptr + t_off, scale_inv, mask=t_mask)
    tl.store(amax_ptr + t_off, amax, mask=t_mask)
    if MX:
        e8 = tl.where(finite, e + 127, 255)
        tl.store(e8m0_ptr + t_off, e8.to(tl.uint8), mask=t_mask)


def _pow2_at_least(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def block_quantize(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    granularity: str = "block:1x128",
    *,
    margin: float = 0,
    pow2: bool = False,
    epsilon: float = 0.0,
    rounding: str = "rne",
    saturate: bool = True,
    seed: int | None = None,
    srbits: int | None = None,
    budget: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scale_inv, amax, e8m0_codes) of ``x`` with just-in-time per-group scales.

    Shapes as ``fp8sim.scaling``: codes like x; scale_inv and amax ``(M, 1)`` for row,
    ``(1, N)`` for col, ``(ceil(M/R), ceil(N/C))`` for blocks, ``(M, ceil(N/32))`` for MX, on
    the 2-D view ``(M, N)`` (last axis, product of the others). ``e8m0_codes``: the MX scales as
    E8M0 codes (uint8, 0xFF for NaN), None for other granularities. ``budget``: elements per
    program when one-row tiles are stacked (a power of two).
    """
    fmt = get_format(fmt)
    args = cast_args(fmt, rounding, saturate, srbits)
    gran = parse_granularity(granularity)
    if gran.kind == "tensor":
        raise ValueError("block_quantize: granularity 'tensor' is fp8sim.kernels.quantize's job")
    is_mx = gran.kind == "mx"
    if is_mx and (margin != 0 or pow2 or epsilon != 0):
        raise ValueError("block_quantize: margin/pow2/epsilon do not apply to mx (E8M0 scale rule)")
    margin = float(margin)
    if not math.isfinite(margin) or abs(margin) > 126:
        raise ValueError(f"block_quantize: margin must be finite with |margin| <= 126, got {margin}")
    epsilon = float(epsilon)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"block_quantize: epsilon must be finite and >= 0, got {epsilon}")
    if rounding == "stochastic" and seed is None:
        raise ValueError("rounding='stochastic' needs seed=")
    shape = tuple(x.shape)
    m, n = view2d(shape)
    if m * n >= 2**31:
        raise ValueError(f"block_quantize: at most 2**31 - 1 elements per call, got {m * n}")
    x2 = x.reshape(m, n) if x.dim() != 2 else x
    grid2d = gran.grid2d(m, n)
    dev = x.device
    codes = torch.empty((m, n), dtype=code_dtype(fmt), device=dev)
    scale_inv = torch.empty(grid2d, dtype=torch.float32, device=dev)
    amax = torch.empty(grid2d, dtype=torch.float32, device=dev)
    e8m0 = torch.empty(grid2d, dtype=torch.uint8, device=dev)
    if m * n == 0:
        return codes.reshape(shape), scale_inv, amax, (e8m0 if is_mx else None)

    # geometry on the processed view: col granularity is row granularity of x.T
    if gran.kind == "col":
        rows_, cols_ = n, m
        sx = (x2.stride(1), x2.stride(0))
        sc = (1, n)
        cnt = (1, n)
        ss = (1, 0)
        tile_r, tile_c = 1, m
    else:
        rows_, cols_ = m, n
        sx = (x2.stride(0), x2.stride(1))
        sc = (n, 1)
        cnt = (n, 1)
        ss = (grid2d[1], 1)
        tile_r, tile_c = gran.tile(m, n)
    block_c = _pow2_at_least(min(tile_c, cols_))
    if tile_r == 1:
        block_r = max(1, min(16, budget // block_c))
        block_r = 1 << (block_r.bit_length() - 1)
        grid = (triton.cdiv(rows_, block_r), triton.cdiv(cols_, tile_c))
    else:
        block_r = _pow2_at_least(min(tile_r, rows_))
        grid = (triton.cdiv(rows_, tile_r), triton.cdiv(cols_, tile_c))
    extra = {} if is_interpreter() else {"num_warps": 8, "enable_fp_fusion": False}
    _block_quantize_kernel[grid](
        x2, codes, scale_inv, amax, e8m0, 0 if seed is None else int(seed),
        rows_, cols_, sx[0], sx[1], sc[0], sc[1], cnt[0], cnt[1], ss[0], ss[1],
        float(np.float32(epsilon)), float(np.float32(2.0**margin)),
        TILE_R=tile_r, TILE_C=tile_c, BLOCK_R=block_r, BLOCK_C=block_c,
        MX=int(is_mx), RCEIL=int(is_mx and gran.mx_rule == "rceil"), POW2=int(bool(pow2)),
        FMAX=float(fmt.max), EMAX=fmt.emax, RCP_MAX=float(np.float32(1.0 / fmt.max)),
        F32_MAX=_F32_MAX, **args, **extra,
    )
    check_sentinels(codes, fmt, shape)
    return codes.reshape(shape), scale_inv, amax, (e8m0 if is_mx else None)


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    out: dict = {}
    bq_types = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scale_inv_ptr": "*fp32",
                "amax_ptr": "*fp32", "e8m0_ptr": "*u8", "seed": "i64", "n_rows": "i32",
                "n_cols": "i32", "sx_r": "i32", "sx_c": "i32", "sc_r": "i32", "sc_c": "i32",
                "cnt_r": "i32", "cnt_c": "i32", "ss_r": "i32", "ss_c": "i32", "eps": "fp32",
                "margin_div": "fp32"}
    for name, tile, block, mx in [("block_quantize_mx", (1, 32), (16, 32), 1),
                                  ("block_quantize_128x128", (128, 128), (128, 128), 0)]:
        out[name] = (_block_quantize_kernel, bq_types,
                     dict(TILE_R=tile[0], TILE_C=tile[1], BLOCK_R=block[0], BLOCK_C=block[1],
                          MX=mx, RCEIL=mx, POW2=1 - mx, FMAX=448.0, EMAX=8, RCP_MAX=1 / 448.0,
                          F32_MAX=3.4028234663852886e38, **cast_args("e4m3", "rne", True)),
                     {"num_warps": 8, "enable_fp_fusion": False})
    return out
