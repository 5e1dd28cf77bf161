"""native_cast: Triton's own float32 -> fp8 conversion (``x.to(tl.float8e4nv / tl.float8e5)``),
as the conformance report checks it against the emulator.

This is the conversion the other kernels avoid (they encode with integer bit operations,
:mod:`fp8sim.kernels.cast`): Triton's interpreter loses the rounding carry, and the GPU's
conversion exists for two formats and one rounding mode. It lives here so that Triton is imported
only by ``fp8sim.kernels``; ``fp8sim conformance`` reports what it does, mismatches included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["native_cast"]

#: elements per program
_BLOCK = 1 << 14


@triton.jit
def _native_cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, E5: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # one block of elements
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if E5:
        y = x.to(tl.float8e5)
    else:
        y = x.to(tl.float8e4nv)
    tl.store(out_ptr + offs, y.to(tl.uint8, bitcast=True), mask=mask)


def native_cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The uint8 codes of Triton's native conversion of float32 ``x`` (1-D, contiguous, on the
    kernel's device) to ``fmt``: ``"e4m3"`` (``tl.float8e4nv``) or ``"e5m2"`` (``tl.float8e5``)."""
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"native_cast: Triton converts to e4m3 or e5m2 natively, got {fmt!r}")
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError("native_cast: x must be a contiguous 1-D float32 tensor")
    out = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    _native_cast_kernel[(triton.cdiv(x.numel(), _BLOCK),)](x, out, x.numel(), BLOCK=_BLOCK, E5=fmt == "e5m2")
    return out
