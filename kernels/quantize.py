"""quantize: ``codes = encode(float32(x) * float32(scale))`` with the amax of x fused in.

One pass over ``x``: load (any float dtype, any 2-D strides), widen to float32, multiply by the
scale (per tensor, per row or per column), encode with the software cast (every format, rounding
mode and overflow rule of the emulator; stochastic rounding draws ``tl.randint(seed, i)`` for
the flat C-order index ``i``, as the emulator does), store the codes, and write each program's
``max |float32(x)|`` (NaN if the program saw a NaN) for the launcher to reduce.

``native=True`` (GPU only, e4m3 or e5m2, ``rne``, saturating): the hardware conversion
``.to(tl.float8e4nv / tl.float8e5)`` after a clamp to +-max, with NaN codes rewritten to the
canonical signed NaN. It must equal the software cast; ``benchmarks/gpu_check.py`` checks that on
the GPU. The interpreter's fp32 -> fp8 conversion is wrong (it drops the rounding carry), so
there the software cast is the only path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8sim.formats import FloatFormat, get_format
from fp8sim.kernels.cast import (cast_args, check_sentinels, code_dtype, encode_f32, is_interpreter, scale_f32,
                           widen_f32)

__all__ = ["quantize", "native_supported", "aot_variants"]

_SCALE_MODES = {"tensor": 0, "row": 1, "col": 2}


@triton.jit
def _quantize_kernel(
    x_ptr,  # input values, float16/bfloat16/float32/float64, logical 2-D (n_rows, n_cols)
    scale_ptr,  # float32 scale: 1 value, one per row, or one per column (SCALE_MODE)
    codes_ptr,  # output codes (uint8 / uint16), contiguous (n_rows, n_cols)
    amax_ptr,  # output float32, one partial amax per program (NaN if the block had a NaN)
    seed,  # Philox key of stochastic rounding (unused otherwise)
    n_rows,  # rows of the logical 2-D view
    n_cols,  # columns of the logical 2-D view
    stride_r,  # element stride between rows of x
    stride_c,  # element stride between columns of x
    SCALE_MODE: tl.constexpr,  # 0 per tensor, 1 per row, 2 per column
    CONTIGUOUS: tl.constexpr,  # x is C-contiguous: address = flat index
    NATIVE: tl.constexpr,  # 0 software cast; 1 hardware fp8e4nv; 2 hardware fp8e5 (GPU only)
    FMAX: tl.constexpr,  # the format's max (clamp of the native path)
    BLOCK: tl.constexpr,  # elements per program
    M: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr, SIGN_MASK: tl.constexpr,
    SIGNED: tl.constexpr, HAS_SUB: tl.constexpr, NAN_KIND: tl.constexpr, NAN_CODE: tl.constexpr,
    INF_CODE: tl.constexpr, MODE: tl.constexpr, SATURATE: tl.constexpr, K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # flat C-order index: the stochastic counter
    n = n_rows * n_cols
    mask = offs < n
    row = offs // n_cols
    col = offs % n_cols
    if CONTIGUOUS:
        x = widen_f32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    else:
        x = widen_f32(tl.load(x_ptr + row * stride_r + col * stride_c, mask=mask, other=0.0))
    if SCALE_MODE == 0:
        s = tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        s = tl.load(scale_ptr + row, mask=mask, other=1.0)
    else:
        s = tl.load(scale_ptr + col, mask=mask, other=1.0)
    y = scale_f32(x, s)  # float32 product, rounded once

    if NATIVE == 0:
        if MODE == 6:
            r = tl.randint(seed, offs)
        else:
            r = offs.to(tl.uint32)  # unused
        code = encode_f32(y, r, M, EMIN, MAX_CODE, SIGN_MASK, SIGNED, HAS_SUB, NAN_KIND,
                          NAN_CODE, INF_CODE, MODE, SATURATE, K)
    else:
        yc = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        if NATIVE == 1:
            f8 = yc.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            f8 = yc.to(tl.float8e5, fp_downcast_rounding="rtne")
        code = f8.to(tl.uint8, bitcast=True).to(tl.int32)
        neg = (y.to(tl.uint32, bitcast=True) >> 31) != 0
        code = tl.where(y != y, tl.where(neg, NAN_CODE | SIGN_MASK, NAN_CODE), code)
    tl.store(codes_ptr + offs, code.to(codes_ptr.dtype.element_ty), mask=mask)

    is_nan = (x != x) & mask
    mag = tl.where(is_nan | (mask == 0), 0.0, tl.abs(x))
    block_amax = tl.max(mag, axis=0)
    nan_count = tl.sum(is_nan.to(tl.int32), axis=0)
    nan = (nan_count * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    tl.store(amax_ptr + pid, tl.where(nan_count > 0, nan, block_amax))


def native_supported(fmt: FloatFormat, rounding: str, saturate: bool, device: torch.device) -> bool:
    """Whether the hardware fp8 conversion computes exactly this cast (GPU, sm_89+)."""
    if device.type != "cuda" or is_interpreter():
        return False
    if fmt.name not in ("e4m3", "e5m2") or rounding != "rne" or not saturate:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _as_2d(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, bool]:
    """(tensor, n_rows, n_cols, stride_r, stride_c, contiguous) of the logical 2-D view."""
    if x.dim() == 2:
        return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1), x.is_contiguous()
    x = x.contiguous()
    n_cols = x.shape[-1] if x.dim() else 1
    n_rows = x.numel() // n_cols if n_cols else 0
    return x, n_rows, n_cols, n_cols, 1, True


def quantize(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    scale: torch.Tensor,
    *,
    rounding: str = "rne",
    saturate: bool = True,
    seed: int | None = None,
    srbits: int | None = None,
    native: bool = False,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, amax): codes of ``encode(float32(x) * scale)`` in x's shape, and ``max |x|``.

    ``scale``: float32 tensor on x's device, 0-d, or (M, 1) / (1, N) for 2-D x. ``native``: use
    the hardware cast where :func:`native_supported` says it is the same cast (else ignored).
    ``block``: elements per program (a power of two; default by device).
    Raises ValueError as the emulator does for NaN/overflow into formats without NaN.
    """
    fmt = get_format(fmt)
    args = cast_args(fmt, rounding, saturate, srbits)
    if rounding == "stochastic" and seed is None:
        raise ValueError("rounding='stochastic' needs seed=")
    shape = tuple(x.shape)
    x2, n_rows, n_cols, stride_r, stride_c, contiguous = _as_2d(x)
    n = n_rows * n_cols
    if n >= 2**31:
        raise ValueError(f"quantize: at most 2**31 - 1 elements per call, got {n}")
    if scale.dim() == 0:
        scale_mode = 0
    elif scale.shape[0] == 1 and x.dim() == 2 and scale.shape[1] == n_cols:
        scale_mode = 2
    else:
        scale_mode = 1
    scale = scale.to(device=x.device, dtype=torch.float32).contiguous()
    codes = torch.empty(shape, dtype=code_dtype(fmt), device=x.device)
    use_native = native and native_supported(fmt, rounding, saturate, x.device)
    blk = block or (8192 if is_interpreter() else 2048)  # interpreter: fewer programs
    grid = (max(triton.cdiv(n, blk), 1),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    extra = {} if is_interpreter() else {"num_warps": 8}
    if n:
        _quantize_kernel[grid](
            x2, scale, codes, partial, 0 if seed is None else int(seed),
            n_rows, n_cols, stride_r, stride_c,
            SCALE_MODE=scale_mode, CONTIGUOUS=contiguous,
            NATIVE=(1 if fmt.name == "e4m3" else 2) if use_native else 0,
            FMAX=float(fmt.max), BLOCK=blk, **args, **extra,
        )
        check_sentinels(codes, fmt, shape)
        amax = partial.amax()
    else:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
    return codes, amax


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    out: dict = {}
    q_types = {"x_ptr": "*fp32", "scale_ptr": "*fp32", "codes_ptr": "*u8", "amax_ptr": "*fp32",
               "seed": "i64", "n_rows": "i32", "n_cols": "i32", "stride_r": "i32",
               "stride_c": "i32"}
    for name, fmt, rnd, native, x_ty in [
        ("quantize_e4m3_rne", "e4m3", "rne", 0, "*bf16"),
        ("quantize_e5m2_stochastic", "e5m2", "stochastic", 0, "*fp32"),
        ("quantize_e4m3_native", "e4m3", "rne", 1, "*bf16"),
        ("quantize_e5m2_native", "e5m2", "rne", 2, "*fp32"),
    ]:
        fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
        out[name] = (_quantize_kernel, {**q_types, "x_ptr": x_ty},
                     dict(SCALE_MODE=0, CONTIGUOUS=True, NATIVE=native, FMAX=fmax, BLOCK=2048,
                          **cast_args(fmt, rnd, True)), {"num_warps": 8})
    out["quantize_fp16_rowscale_strided"] = (
        _quantize_kernel, {**q_types, "codes_ptr": "*u16"},
        dict(SCALE_MODE=1, CONTIGUOUS=False, NATIVE=0, FMAX=65504.0, BLOCK=2048,
             **cast_args("fp16", "rtz", False)), {"num_warps": 8})
    return out
