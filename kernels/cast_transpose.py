"""cast_transpose: the codes of a 2-D ``x`` and of ``x.T`` in one pass (FP8 backward needs both).

Each program loads one (BLOCK_M, BLOCK_N) tile, scales and encodes it once with the software
cast, and stores the tile and its transpose; so ``codes_t`` is exactly ``codes.T`` (stochastic
rounding included: the counter is the flat index in ``x``, not in ``x.T``). The tile's
``max |x|`` is written for the launcher to reduce (NaN if the tile had a NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8sim.formats import FloatFormat, get_format
from fp8sim.kernels.cast import cast_args, check_sentinels, code_dtype, encode_f32, scale_f32, widen_f32

__all__ = ["cast_transpose", "aot_variants"]


@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # input (n_rows, n_cols), any float dtype, any strides
    scale_ptr,  # float32 scale: 1 value, one per row, or one per column (SCALE_MODE)
    codes_ptr,  # output codes (n_rows, n_cols), contiguous
    codes_t_ptr,  # output codes of the transpose (n_cols, n_rows), contiguous
    amax_ptr,  # output float32, one partial amax per program
    seed,  # Philox key of stochastic rounding (unused otherwise)
    n_rows,  # rows of x
    n_cols,  # columns of x
    stride_r,  # element stride between rows of x
    stride_c,  # element stride between columns of x
    SCALE_MODE: tl.constexpr,  # 0 per tensor, 1 per row, 2 per column
    BLOCK_M: tl.constexpr,  # tile rows
    BLOCK_N: tl.constexpr,  # tile columns
    M: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr, SIGN_MASK: tl.constexpr,
    SIGNED: tl.constexpr, HAS_SUB: tl.constexpr, NAN_KIND: tl.constexpr, NAN_CODE: tl.constexpr,
    INF_CODE: tl.constexpr, MODE: tl.constexpr, SATURATE: tl.constexpr, K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    x = widen_f32(x)
    if SCALE_MODE == 0:
        s = tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        s = tl.load(scale_ptr + rows, mask=rows < n_rows, other=1.0)[:, None]
    else:
        s = tl.load(scale_ptr + cols, mask=cols < n_cols, other=1.0)[None, :]
    y = scale_f32(x, s)
    offs = rows[:, None] * n_cols + cols[None, :]  # flat index in x: the stochastic counter
    if MODE == 6:
        r = tl.randint(seed, offs)
    else:
        r = offs.to(tl.uint32)  # unused
    code = encode_f32(y, r, M, EMIN, MAX_CODE, SIGN_MASK, SIGNED, HAS_SUB, NAN_KIND, NAN_CODE,
                      INF_CODE, MODE, SATURATE, K).to(codes_ptr.dtype.element_ty)
    tl.store(codes_ptr + offs, code, mask=mask)
    offs_t = cols[:, None] * n_rows + rows[None, :]
    tl.store(codes_t_ptr + offs_t, tl.trans(code), mask=tl.trans(mask))

    is_nan = (x != x) & mask
    mag = tl.where(is_nan | (mask == 0), 0.0, tl.abs(x))
    tile_amax = tl.max(tl.max(mag, axis=1), axis=0)
    nan_count = tl.sum(tl.sum(is_nan.to(tl.int32), axis=1), axis=0)
    nan = (nan_count * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_n, tl.where(nan_count > 0, nan, tile_amax))


def cast_transpose(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    scale: torch.Tensor,
    *,
    rounding: str = "rne",
    saturate: bool = True,
    seed: int | None = None,
    srbits: int | None = None,
    block: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, codes_t, amax) of 2-D ``x``: ``codes = encode(float32(x) * scale)``,
    ``codes_t = codes.T`` (contiguous), ``amax = max |float32(x)|``; ``block``: tile side."""
    fmt = get_format(fmt)
    args = cast_args(fmt, rounding, saturate, srbits)
    if x.dim() != 2:
        raise ValueError(f"cast_transpose: x must be 2-D, got shape {tuple(x.shape)}")
    if rounding == "stochastic" and seed is None:
        raise ValueError("rounding='stochastic' needs seed=")
    n_rows, n_cols = x.shape
    if x.numel() >= 2**31:
        raise ValueError(f"cast_transpose: at most 2**31 - 1 elements per call, got {x.numel()}")
    if scale.dim() == 0:
        mode = 0
    elif scale.shape[0] == 1 and scale.shape[1] == n_cols:
        mode = 2
    else:
        mode = 1
    scale = scale.to(device=x.device, dtype=torch.float32).contiguous()
    codes = torch.empty((n_rows, n_cols), dtype=code_dtype(fmt), device=x.device)
    codes_t = torch.empty((n_cols, n_rows), dtype=code_dtype(fmt), device=x.device)
    bm = bn = block
    grid = (max(triton.cdiv(n_rows, bm), 1), max(triton.cdiv(n_cols, bn), 1))
    partial = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    if x.numel():
        _cast_transpose_kernel[grid](
            x, scale, codes, codes_t, partial, 0 if seed is None else int(seed),
            n_rows, n_cols, x.stride(0), x.stride(1),
            SCALE_MODE=mode, BLOCK_M=bm, BLOCK_N=bn, **args,
        )
        check_sentinels(codes, fmt, (n_rows, n_cols))
    return codes, codes_t, partial.amax()


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    return {"cast_transpose_e4m3_stochastic": (
        _cast_transpose_kernel,
        {"x_ptr": "*bf16", "scale_ptr": "*fp32", "codes_ptr": "*u8", "codes_t_ptr": "*u8",
         "amax_ptr": "*fp32", "seed": "i64", "n_rows": "i32", "n_cols": "i32",
         "stride_r": "i32", "stride_c": "i32"},
        dict(SCALE_MODE=0, BLOCK_M=64, BLOCK_N=64, **cast_args("e4m3", "stochastic", True)),
        {"num_warps": 8})}
