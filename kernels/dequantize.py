"""dequantize: ``float32(decode(codes)) * float32(scale_inv)``, cast to the output dtype (RNE).

bfloat16 output is rounded with integer operations (:func:`fp8sim.kernels.cast.bf16_bits`).

Decoding is the integer software decode of :func:`fp8sim.kernels.cast.decode_f32` (exact for every
code, NaN and inf included, where the interpreter's fp8 -> float32 conversion is not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8sim.formats import FloatFormat, get_format
from fp8sim.kernels.cast import (bf16_bits, decode_args, decode_f32, is_interpreter, narrow_keep_nan_sign,
                           scale_f32)

__all__ = ["dequantize", "aot_variants"]


@triton.jit
def _dequantize_kernel(
    codes_ptr,  # input codes (uint8 / uint16), logical 2-D (n_rows, n_cols), any strides
    scale_inv_ptr,  # float32 decode factor: 1 value, one per row, or one per column
    out_ptr,  # output values (float32 / float16; bfloat16 as int16 bits), contiguous
    n_rows,  # rows of the logical 2-D view
    n_cols,  # columns of the logical 2-D view
    stride_r,  # element stride between rows of codes
    stride_c,  # element stride between columns of codes
    SCALE_MODE: tl.constexpr,  # 0 per tensor, 1 per row, 2 per column
    OUT_BF16: tl.constexpr,  # 1: out_ptr is an int16 view of bfloat16 output
    BLOCK: tl.constexpr,  # elements per program
    M: tl.constexpr, BIAS: tl.constexpr, MAG_BITS: tl.constexpr, SIGNED: tl.constexpr,
    HAS_SUB: tl.constexpr, NAN_KIND: tl.constexpr, NAN_CODE: tl.constexpr,
    INF_CODE: tl.constexpr, SUB_SCALE: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_rows * n_cols
    row = offs // n_cols
    col = offs % n_cols
    code = tl.load(codes_ptr + row * stride_r + col * stride_c, mask=mask, other=0)
    val = decode_f32(code.to(tl.int32) & 0xFFFF, M, BIAS, MAG_BITS, SIGNED, HAS_SUB, NAN_KIND,
                     NAN_CODE, INF_CODE, SUB_SCALE)
    if SCALE_MODE == 0:
        s = tl.load(scale_inv_ptr)
    elif SCALE_MODE == 1:
        s = tl.load(scale_inv_ptr + row, mask=mask, other=1.0)
    else:
        s = tl.load(scale_inv_ptr + col, mask=mask, other=1.0)
    out = scale_f32(val, s)
    if OUT_BF16:
        tl.store(out_ptr + offs, bf16_bits(out), mask=mask)
    else:
        tl.store(out_ptr + offs, narrow_keep_nan_sign(out, out_ptr.dtype.element_ty), mask=mask)


def dequantize(
    codes: torch.Tensor,
    fmt: FloatFormat | str,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """Values of ``codes`` times ``scale_inv`` (float32 tensor: 0-d, (M, 1) or (1, N));
    ``block``: elements per program (a power of two; default by device)."""
    fmt = get_format(fmt)
    args = decode_args(fmt)
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dequantize: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    shape = tuple(codes.shape)
    c = codes if codes.dim() == 2 else codes.contiguous().reshape(-1, shape[-1] if shape else 1)
    n_rows, n_cols = c.shape
    if scale_inv.dim() == 0:
        mode = 0
    elif scale_inv.shape[0] == 1 and codes.dim() == 2 and scale_inv.shape[1] == n_cols:
        mode = 2
    else:
        mode = 1
    s = scale_inv.to(device=codes.device, dtype=torch.float32).contiguous()
    out = torch.empty(shape, dtype=out_dtype, device=codes.device)
    blk = block or (8192 if is_interpreter() else 2048)
    if c.numel():
        # the same bits as int16 where torch has no uint16 pointer arithmetic on every device
        raw = c.view(torch.int16) if c.element_size() == 2 else c.view(torch.uint8)
        _dequantize_kernel[(triton.cdiv(c.numel(), blk),)](
            raw, s, out.view(torch.int16) if out_dtype == torch.bfloat16 else out,
            n_rows, n_cols, c.stride(0), c.stride(1),
            SCALE_MODE=mode, OUT_BF16=int(out_dtype == torch.bfloat16), BLOCK=blk, **args,
        )
    return out


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    return {"dequantize_e5m2_bf16": (
        _dequantize_kernel,
        {"codes_ptr": "*u8", "scale_inv_ptr": "*fp32", "out_ptr": "*i16", "n_rows": "i32",
         "n_cols": "i32", "stride_r": "i32", "stride_c": "i32"},
        dict(SCALE_MODE=0, OUT_BF16=1, BLOCK=2048, **decode_args("e5m2")), {"num_warps": 8})}
