"""amax: ``max |float32(x)|`` of a tensor, NaN if any element is NaN, 0 if empty.

Each program reduces one block (NaNs counted apart, so the result does not depend on how a
device's max instruction treats NaN) and writes a partial; torch reduces the partials.
``ignore_nan=True`` takes the max over the non-NaN elements instead (0 if there are none): the
tensor amax of NVFP4 (:mod:`fp8sim.nvfp4`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8sim.kernels.cast import is_interpreter

__all__ = ["amax", "aot_variants"]


@triton.jit
def _amax_kernel(
    x_ptr,  # input values, any float dtype, logical 2-D (n_rows, n_cols), any strides
    partial_ptr,  # output float32, one partial amax per program
    n_rows,  # rows of the logical 2-D view
    n_cols,  # columns of the logical 2-D view
    stride_r,  # element stride between rows
    stride_c,  # element stride between columns
    BLOCK: tl.constexpr,  # elements per program
    IGNORE_NAN: tl.constexpr = 0,  # 1: the max over the non-NaN elements (NaN never returned)
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_rows * n_cols
    x = tl.load(x_ptr + (offs // n_cols) * stride_r + (offs % n_cols) * stride_c, mask=mask,
                other=0.0).to(tl.float32)
    is_nan = (x != x) & mask
    mag = tl.where(is_nan | (mask == 0), 0.0, tl.abs(x))
    nan_count = tl.sum(is_nan.to(tl.int32), axis=0)
    nan = (nan_count * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    if IGNORE_NAN:
        tl.store(partial_ptr + pid, tl.max(mag, axis=0))
    else:
        tl.store(partial_ptr + pid, tl.where(nan_count > 0, nan, tl.max(mag, axis=0)))


def amax(x: torch.Tensor, *, ignore_nan: bool = False, block: int | None = None) -> torch.Tensor:
    """``max |float32(x)|`` as a 0-d float32 tensor on x's device: NaN if any element is NaN,
    or with ``ignore_nan=True`` the max over the other elements (0 if all are NaN).
    ``block``: elements per program, a power of two; default by device."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    x2 = x if x.dim() == 2 else x.contiguous().reshape(-1, x.shape[-1] if x.dim() else 1)
    blk = block or (8192 if is_interpreter() else 4096)
    grid = (triton.cdiv(x2.numel(), blk),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    _amax_kernel[grid](x2, partial, x2.shape[0], x2.shape[1], x2.stride(0), x2.stride(1), BLOCK=blk,
                      IGNORE_NAN=int(bool(ignore_nan)))
    return partial.amax()


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    return {"amax": (_amax_kernel, {"x_ptr": "*bf16", "partial_ptr": "*fp32", "n_rows": "i32",
                                    "n_cols": "i32", "stride_r": "i32", "stride_c": "i32"},
                     dict(BLOCK=4096, IGNORE_NAN=0), {"num_warps": 8})}
