"""nvfp4_quantize: E2M1 codes, E4M3 block scales and the float32 tensor scale of NVFP4.

The same numbers, bit for bit, as ``fp8sim.nvfp4.quantize_nvfp4_2d`` (read its module docstring
for the four variants' rules; every step here is the same float32 operation, rounded to nearest
even, in the same order). Two passes over ``x``:

1. the tensor amax ``A``: ``max |float32(x)|`` over the non-NaN elements
   (:func:`fp8sim.kernels.amax.amax` with ``ignore_nan=True``), unless ``global_amax`` is given;
2. one kernel: each program loads a ``(BLOCK_R, BLOCK_C)`` region holding whole 1x16, 16x1 or
   16x16 tiles (ragged tiles cut at the array's edge: the missing elements enter no amax),
   computes the per-tensor constants from ``A`` (``S``, ``P`` or ``G``), each tile's amax over
   its non-NaN elements, the E4M3 block scale (software cast, saturating round-to-nearest-even),
   its decoded value ``b``, the variant's multiplier (or divisor) and the E2M1 codes (software
   cast, saturating, any rounding mode; stochastic rounding draws ``tl.randint(seed, i)`` with
   ``i`` the element's flat C-order index in ``x``, the emulator's Philox stream).

A tile holding a NaN gets the E4M3 NaN scale (0x7F) and element codes 0, as the emulator does.
Codes are written one per byte, or packed two per byte along the last axis (the element with the
lower index in the low nibble, ``torch.float4_e2m1fn_x2``'s order, :func:`fp8sim.nvfp4.pack_e2m1`;
an odd last axis gets a high nibble 0 in its last byte).

All divisions are ``tl.div_rn`` (IEEE, correctly rounded) and the GPU launch disables
floating-point contraction, so the compiled kernel computes what the interpreter does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from fp8sim.kernels.amax import amax as _amax
from fp8sim.kernels.cast import cast_args, decode_args, decode_f32, encode_f32, is_interpreter, widen_f32
from fp8sim.nvfp4 import NVFP4_BLOCK, check_layout, check_variant, tensor_scale_for
from fp8sim.scaling import view2d

__all__ = ["NVFP4_VARIANT_IDS", "NVFP4Quantized", "nvfp4_quantize", "aot_variants"]

#: the variant names of :mod:`fp8sim.nvfp4` -> the kernel's ``VARIANT`` constexpr
NVFP4_VARIANT_IDS = {"te": 0, "torchao": 1, "torchao-block": 2, "compressed-tensors": 3}

_F32_MAX = tl.constexpr(float(np.finfo(np.float32).max))
_F32_TINY = tl.constexpr(float(np.finfo(np.float32).tiny))  # 2**-126
_GLOBAL = tl.constexpr(2688.0)  # 448 * 6
_RCP_6 = tl.constexpr(float(np.float32(1.0 / 6.0)))  # float32(1/6), as fp8sim.nvfp4
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)



def _scale_cast_args() -> dict:
    """The constexprs (``S_*``) of the block scales' cast: E4M3, round to nearest even,
    saturating (:func:`encode_f32`), and of its decode (:func:`decode_f32`)."""
    enc, dec = cast_args("e4m3", "rne", True), decode_args("e4m3")
    keys = ("M", "EMIN", "MAX_CODE", "SIGN_MASK", "NAN_KIND", "NAN_CODE", "INF_CODE")
    return {**{"S_" + k: enc[k] for k in keys},
            **{"S_" + k: dec[k] for k in ("BIAS", "MAG_BITS", "SUB_SCALE")}}


_CT_ZERO_SCALE_CODE = tl.constexpr(0x20)  # E4M3 0.125: compressed-tensors' scale for a zero


@triton.jit
def _clamp_keep_nan(v, lo, hi):
    """``min(max(v, lo), hi)`` with a NaN ``v`` kept NaN (numpy's ``clip``; the GPU's max/min
    would return the other operand)."""
    c = tl.minimum(tl.maximum(v, lo), hi)
    return tl.where(v != v, v, c)


@triton.jit
def _to_tiles(g, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TILE_R: tl.constexpr,
              TILE_C: tl.constexpr):
    """A per-tile block ``(BLOCK_R // TILE_R, BLOCK_C // TILE_C)`` spread over the elements
    ``(BLOCK_R, BLOCK_C)`` of the region."""
    g4 = tl.reshape(g, (BLOCK_R // TILE_R, 1, BLOCK_C // TILE_C, 1))
    g4 = tl.broadcast_to(g4, (BLOCK_R // TILE_R, TILE_R, BLOCK_C // TILE_C, TILE_C))
    return tl.reshape(g4, (BLOCK_R, BLOCK_C))


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr,  # input, any float dtype, logical 2-D (n_rows, n_cols), any strides
    gamax_ptr,  # float32, one value: the tensor amax A the per-tensor scale comes from
    codes_ptr,  # output uint8, contiguous: (n_rows, ceil(n_cols / 2)) packed, else (n_rows, n_cols)
    bcodes_ptr,  # output uint8 E4M3 codes of the block scales, contiguous (grid_r, grid_c)
    bscale_ptr,  # output float32 decoded block scales (NaN for a tile holding a NaN), same shape
    bamax_ptr,  # output float32 tile amax over the non-NaN elements, same shape
    tscale_ptr,  # output float32, one value: the variant's stored per-tensor scale
    seed,  # Philox key of stochastic rounding (unused otherwise)
    n_rows, n_cols,  # the 2-D view's sizes
    sx_r, sx_c,  # element strides of x
    grid_r, grid_c,  # tiles along each axis: ceil(n_rows / TILE_R), ceil(n_cols / TILE_C)
    TILE_R: tl.constexpr,  # tile rows: 1 or 16
    TILE_C: tl.constexpr,  # tile columns: 16 or 1
    BLOCK_R: tl.constexpr,  # rows per program, a power of two and a multiple of TILE_R
    BLOCK_C: tl.constexpr,  # columns per program, a power of two >= 2, a multiple of TILE_C
    VARIANT: tl.constexpr,  # NVFP4_VARIANT_IDS: 0 te, 1 torchao, 2 torchao-block, 3 compressed-tensors
    PACK: tl.constexpr,  # 1: two codes per byte (low nibble first), 0: one code per byte
    M: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr, SIGN_MASK: tl.constexpr,
    SIGNED: tl.constexpr, HAS_SUB: tl.constexpr, NAN_KIND: tl.constexpr, NAN_CODE: tl.constexpr,
    INF_CODE: tl.constexpr, MODE: tl.constexpr, SATURATE: tl.constexpr, K: tl.constexpr,
    S_M: tl.constexpr, S_EMIN: tl.constexpr, S_MAX_CODE: tl.constexpr, S_SIGN_MASK: tl.constexpr,
    S_NAN_KIND: tl.constexpr, S_NAN_CODE: tl.constexpr, S_INF_CODE: tl.constexpr,
    S_BIAS: tl.constexpr, S_MAG_BITS: tl.constexpr, S_SUB_SCALE: tl.constexpr,
):
    # M .. K: the element cast (E2M1, saturating; cast_args); S_*: the block scales' E4M3 cast
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * sx_r + cols[None, :] * sx_c, mask=mask, other=0.0)
    x = widen_f32(x)

    # -- tile amaxes over the non-NaN elements, (BLOCK_R // TILE_R, BLOCK_C // TILE_C) ---------
    is_nan = (x != x) & mask
    mag = tl.where(is_nan | (mask == 0), 0.0, tl.abs(x))
    mag4 = tl.reshape(mag, (BLOCK_R // TILE_R, TILE_R, BLOCK_C // TILE_C, TILE_C))
    nan4 = tl.reshape(is_nan.to(tl.int32), (BLOCK_R // TILE_R, TILE_R, BLOCK_C // TILE_C, TILE_C))
    amax = tl.max(tl.max(mag4, axis=3), axis=1)
    nans = tl.sum(tl.sum(nan4, axis=3), axis=1)

    # -- per-tensor constants from A (0-d), and each tile's E4M3 scale before its cast --------
    ga = tl.load(gamax_ptr)
    one = tl.zeros_like(amax) + 1.0
    if VARIANT == 0:  # te: S = 2688 / A (inf -> f32max; A = 0 or S = 0 -> 1)
        s_enc = tl.div_rn(tl.full((), _GLOBAL, tl.float32), ga)
        s_enc = tl.where(s_enc > _F32_MAX, _F32_MAX, s_enc)
        s_enc = tl.where((ga == 0) | (s_enc == 0), 1.0, s_enc)
        pre = amax * (s_enc * _RCP_6)
        pre = tl.where(pre > _F32_MAX, _F32_MAX, pre)
        tscale = ga
    elif VARIANT == 1:  # torchao: P = A / 2688
        p = tl.div_rn(ga, tl.full((), _GLOBAL, tl.float32))
        pre = tl.div_rn(tl.div_rn(amax, one * 6.0), tl.zeros_like(amax) + p)
        pre = _clamp_keep_nan(pre, _E4M3_MIN_NORMAL, 448.0)
        tscale = p
    elif VARIANT == 2:  # torchao-block: one level
        pre = _clamp_keep_nan(tl.div_rn(amax, one * 6.0), _E4M3_MIN_NORMAL, 448.0)
        tscale = tl.full((), 1.0, tl.float32)
    else:  # compressed-tensors: G = 2688 * (1 / max(A, 2**-126)); not finite -> 1
        g = tl.div_rn(tl.full((), 1.0, tl.float32), tl.maximum(ga, _F32_TINY)) * _GLOBAL
        g = tl.where(tl.abs(g) <= _F32_MAX, g, 1.0)
        pre = _clamp_keep_nan(g * tl.div_rn(amax, one * 6.0), -448.0, 448.0)
        tscale = g

    # -- E4M3 block scales: code, decoded value; a tile with a NaN (or a NaN scale) is bad ----
    bad = (nans > 0) | (pre != pre)
    pre = tl.where(pre != pre, 0.0, pre)
    bcode = encode_f32(pre, pre.to(tl.uint32, bitcast=True), S_M, S_EMIN, S_MAX_CODE, S_SIGN_MASK,
                       1, 1, S_NAN_KIND, S_NAN_CODE, S_INF_CODE, 0, 1, 32)
    if VARIANT == 3:
        bcode = tl.where(bcode == 0, _CT_ZERO_SCALE_CODE, bcode)
    bcode = tl.where(bad, S_NAN_CODE, bcode)
    b = decode_f32(bcode, S_M, S_BIAS, S_MAG_BITS, 1, 1, S_NAN_KIND, S_NAN_CODE, S_INF_CODE,
                   S_SUB_SCALE)

    # -- the element cast: y = x * r (compressed-tensors: x / (b / G)), then E2M1 ------------
    if VARIANT == 0:  # r = min(1 / (b * (1 / S)), f32max)
        s_dec = tl.div_rn(tl.full((), 1.0, tl.float32), s_enc)
        r = tl.div_rn(one, b * s_dec)
        r = tl.where(r > _F32_MAX, _F32_MAX, r)
    elif VARIANT == 1:  # r = (1 / P) / b
        r = tl.div_rn(tl.zeros_like(b) + tl.div_rn(tl.full((), 1.0, tl.float32), p), b)
    elif VARIANT == 2:  # r = 1 / b
        r = tl.div_rn(one, b)
    else:  # the divisor b / G
        r = tl.div_rn(b, tl.zeros_like(b) + g)
    if VARIANT == 3:
        y = tl.div_rn(x, _to_tiles(r, BLOCK_R, BLOCK_C, TILE_R, TILE_C))
    else:
        y = x * _to_tiles(r, BLOCK_R, BLOCK_C, TILE_R, TILE_C)
    bad_x = _to_tiles(bad.to(tl.int32), BLOCK_R, BLOCK_C, TILE_R, TILE_C) != 0
    y = tl.where(bad_x | (y != y), 0.0, y)
    cnt = rows[:, None] * n_cols + cols[None, :]  # flat C-order index: the stochastic counter
    if MODE == 6:
        rnd = tl.randint(seed, cnt)
    else:
        rnd = cnt.to(tl.uint32)  # unused
    code = encode_f32(y, rnd, M, EMIN, MAX_CODE, SIGN_MASK, SIGNED, HAS_SUB, NAN_KIND, NAN_CODE,
                      INF_CODE, MODE, SATURATE, K)
    if VARIANT == 3:  # its sign comes from torch.sign: a zero y (-0 too) is code 0
        code = tl.where(y == 0, 0, code)
    code = tl.where(mask, code, 0)  # outside the array: the zero padding nibble

    if PACK:
        lo, hi = tl.split(tl.reshape(code, (BLOCK_R, BLOCK_C // 2, 2)))
        byte = lo | (hi << 4)
        n_bytes = (n_cols + 1) // 2
        bcols = pid_c * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
        bmask = (rows[:, None] < n_rows) & (bcols[None, :] < n_bytes)
        tl.store(codes_ptr + rows[:, None] * n_bytes + bcols[None, :], byte.to(tl.uint8), mask=bmask)
    else:
        tl.store(codes_ptr + rows[:, None] * n_cols + cols[None, :], code.to(tl.uint8), mask=mask)

    # -- per-tile outputs --------------------------------------------------------------------
    tr = pid_r * (BLOCK_R // TILE_R) + tl.arange(0, BLOCK_R // TILE_R)
    tc = pid_c * (BLOCK_C // TILE_C) + tl.arange(0, BLOCK_C // TILE_C)
    t_off = tr[:, None] * grid_c + tc[None, :]
    t_mask = (tr[:, None] < grid_r) & (tc[None, :] < grid_c)
    tl.store(bcodes_ptr + t_off, bcode.to(tl.uint8), mask=t_mask)
    tl.store(bscale_ptr + t_off, b, mask=t_mask)
    tl.store(bamax_ptr + t_off, amax, mask=t_mask)
    if (pid_r == 0) & (pid_c == 0):
        tl.store(tscale_ptr, tscale)


class NVFP4Quantized(NamedTuple):
    """What :func:`nvfp4_quantize` returns (torch tensors on x's device).

    ``codes``: uint8, packed ``(*x.shape[:-1], ceil(N / 2))`` (``pack=True``) or one E2M1 code
    per element in x's shape. ``block_codes``: uint8 E4M3 codes of the block scales,
    ``(ceil(M / R), ceil(N / C))`` on the 2-D view ``(M, N)``; ``block_scale``: their float32
    values (NaN for a tile holding a NaN); ``block_amax``: float32 tile amaxes over the non-NaN
    elements. ``tensor_scale``: 0-d float32, the per-tensor value the variant stores
    (``fp8sim.nvfp4.tensor_scale_for``); ``global_amax``: 0-d float32, the ``A`` it came from.
    """

    codes: torch.Tensor
    block_codes: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    global_amax: torch.Tensor
    block_amax: torch.Tensor


def _global_amax(x: torch.Tensor, global_amax: Any) -> torch.Tensor:
    """A as a 0-d float32 tensor on x's device: computed (NaN ignored) or the given value."""
    if global_amax is None:
        return _amax(x, ignore_nan=True)
    if isinstance(global_amax, torch.Tensor):
        a = global_amax.detach().to(device=x.device, dtype=torch.float32).reshape(())
        bad = bool(torch.isnan(a) | (a < 0))
    else:
        if isinstance(global_amax, (bool, np.bool_)) or not isinstance(global_amax, (int, float, np.number)):
            raise TypeError(f"global_amax must be a number or a 0-d tensor, got {type(global_amax).__name__}")
        with np.errstate(over="ignore"):
            v = np.float32(global_amax)
        bad = bool(np.isnan(v) or v < 0)
        a = torch.tensor(float(v), dtype=torch.float32, device=x.device)
    if bad:
        raise ValueError(f"global_amax must be >= 0 (inf allowed), got {global_amax!r}")
    return a


def nvfp4_quantize(
    x: torch.Tensor,
    layout: str | tuple[int, int] = "1x16",
    variant: str = "te",
    *,
    global_amax: Any = None,
    rounding: str = "rne",
    seed: int | None = None,
    srbits: int | None = None,
    pack: bool = True,
    block: tuple[int, int] | None = None,
) -> NVFP4Quantized:
    """NVFP4 of ``x`` (float16/bfloat16/float32/float64, any shape; the 2-D view ``(M, N)`` is
    the last axis and the product of the others), bit for bit ``fp8sim.nvfp4.quantize_nvfp4_2d``.

    ``layout``: ``"1x16"`` (along rows), ``"16x1"`` (along columns), ``"16x16"``. ``variant``:
    ``te`` (default), ``torchao``, ``torchao-block``, ``compressed-tensors``. ``global_amax``:
    the tensor amax of the per-tensor scale (a number or 0-d tensor, >= 0, inf allowed); None
    computes it (NaN ignored). ``rounding``: the E2M1 rounding (``rne``, ``stochastic`` with
    ``seed`` and optional ``srbits``, or any other mode of ``fp8sim.ROUNDING_MODES``); the block
    scales always round to nearest even. ``pack``: two codes per byte. ``block``: rows and columns
    per program (powers of two, multiples of the tile; default by device).
    """
    variant = check_variant(variant)
    tile = check_layout(layout)
    args = cast_args("e2m1", rounding, True, srbits)
    if rounding == "stochastic" and seed is None:
        raise ValueError("rounding='stochastic' needs seed=")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16,
                                                          torch.float32, torch.float64):
        raise TypeError("nvfp4_quantize: x must be a float16/bfloat16/float32/float64 tensor")
    shape = tuple(x.shape)
    m, n = view2d(shape)
    if m * n >= 2**31:
        raise ValueError(f"nvfp4_quantize: at most 2**31 - 1 elements per call, got {m * n}")
    x2 = x.reshape(m, n) if x.dim() != 2 else x
    dev = x.device
    grid_r, grid_c = -(-m // tile[0]), -(-n // tile[1])
    n_bytes = (n + 1) // 2
    codes = torch.empty((m, n_bytes) if pack else (m, n), dtype=torch.uint8, device=dev)
    bcodes = torch.empty((grid_r, grid_c), dtype=torch.uint8, device=dev)
    bscale = torch.empty((grid_r, grid_c), dtype=torch.float32, device=dev)
    bamax = torch.empty((grid_r, grid_c), dtype=torch.float32, device=dev)
    ga = _global_amax(x2, global_amax)
    packed_shape = (*shape[:-1], n_bytes) if shape else (1,)
    if m * n == 0:
        ts = torch.tensor(float(tensor_scale_for(float(ga), variant)), dtype=torch.float32, device=dev)
        return NVFP4Quantized(codes.reshape(packed_shape if pack else shape), bcodes, bscale, ts,
                              ga, bamax)
    tscale = torch.empty((), dtype=torch.float32, device=dev)
    if block is None:
        block = (64, 128) if is_interpreter() else (32, 64)
    block_r, block_c = block
    for side, t in ((block_r, tile[0]), (block_c, tile[1])):
        if side < max(t, 2) or side & (side - 1) or side % t:
            raise ValueError(f"nvfp4_quantize: block sides must be powers of two >= 2 and multiples "
                             f"of the tile {tile}, got {block}")
    grid = (triton.cdiv(m, block_r), triton.cdiv(n, block_c))
    extra = {} if is_interpreter() else {"num_warps": 4, "enable_fp_fusion": False}
    _nvfp4_quantize_kernel[grid](
        x2, ga, codes, bcodes, bscale, bamax, tscale, 0 if seed is None else int(seed),
        m, n, x2.stride(0), x2.stride(1), grid_r, grid_c,
        TILE_R=tile[0], TILE_C=tile[1], BLOCK_R=block_r, BLOCK_C=block_c,
        VARIANT=NVFP4_VARIANT_IDS[variant], PACK=int(bool(pack)), **args, **_scale_cast_args(), **extra,
    )
    return NVFP4Quantized(codes.reshape(packed_shape if pack else shape), bcodes, bscale, tscale,
                          ga, bamax)


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    types = {"x_ptr": "*bf16", "gamax_ptr": "*fp32", "codes_ptr": "*u8", "bcodes_ptr": "*u8",
             "bscale_ptr": "*fp32", "bamax_ptr": "*fp32", "tscale_ptr": "*fp32", "seed": "i64",
             "n_rows": "i32", "n_cols": "i32", "sx_r": "i32", "sx_c": "i32", "grid_r": "i32",
             "grid_c": "i32"}
    out: dict = {}
    for name, tile, variant, rounding in [
        ("nvfp4_1x16_te_rne", (1, NVFP4_BLOCK), "te", "rne"),
        ("nvfp4_16x1_te_stochastic", (NVFP4_BLOCK, 1), "te", "stochastic"),
        ("nvfp4_16x16_te_rne", (NVFP4_BLOCK, NVFP4_BLOCK), "te", "rne"),
        ("nvfp4_1x16_torchao_rne", (1, NVFP4_BLOCK), "torchao", "rne"),
    ]:
        out[name] = (_nvfp4_quantize_kernel, types,
                     dict(TILE_R=tile[0], TILE_C=tile[1], BLOCK_R=32, BLOCK_C=64,
                          VARIANT=NVFP4_VARIANT_IDS[variant], PACK=1,
                          **cast_args("e2m1", rounding, True), **_scale_cast_args()),
                     {"num_warps": 4, "enable_fp_fusion": False})
    return out
