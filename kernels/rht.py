"""rht: the Random Hadamard Transform of NVFP4 training, bit for bit ``fp8sim.hadamard.rht``.

Groups of 16 consecutive elements along one axis, each mapped to ``(H / 4) @ (s * x)`` in the
float32 order of :mod:`fp8sim.hadamard` (its docstring is the contract):
``v = x * (s * 0.25)``, then the butterflies ``h = 1, 2, 4, 8`` with
``(v[j], v[j + h]) = (v[j] + v[j + h], v[j] - v[j + h])`` for ``j & h == 0``, each operation
rounded to nearest even; the inverse multiplies by ``0.25`` first and by the signs last.

How the butterflies are laid out: a program holds ``BLOCK_G`` groups as a ``(BLOCK_G, 2, 2, 2,
2)`` block whose last four axes are the bits 8, 4, 2, 1 of the index in the group. A stage splits
the last axis (bit ``h``) into the pair ``(v[j], v[j + h])``, joins ``(a + b, a - b)`` back in its
place, and rotates the four bit axes right by one so that the next stage's bit is last; after
four stages the axes are back in order. No add is contracted into a multiply: the GPU launch
disables floating-point contraction.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from fp8sim.hadamard import RHT_SIZE, check_signs
from fp8sim.kernels.cast import is_interpreter, widen_f32

__all__ = ["rht", "aot_variants"]


@triton.jit
def _rht_kernel(
    x_ptr,  # input, any float dtype, seen as (n_a, n_lg * 16, n_b) with strides (s_a, s_l, s_b)
    signs_ptr,  # float32, the 16 signs (+-1)
    out_ptr,  # output float32, contiguous (n_a, n_lg * 16, n_b)
    n_groups,  # n_a * n_lg * n_b
    n_lg,  # groups along the transformed axis
    n_b,  # size of the axes after it (their product)
    s_a, s_l, s_b,  # element strides of x over (before, transformed axis, after)
    INVERSE: tl.constexpr,  # 0: (H/4) @ (s * x); 1: s * ((H/4) @ x)
    BLOCK_G: tl.constexpr,  # groups per program (a power of two)
):
    pid = tl.program_id(0)
    gid = pid * BLOCK_G + tl.arange(0, BLOCK_G)  # group id: (a, lg, b) in C order
    gmask = gid < n_groups
    b = gid % n_b
    t = gid // n_b
    lg = t % n_lg
    a = t // n_lg
    i = tl.arange(0, 16)
    ax = lg[:, None] * 16 + i[None, :]  # index along the transformed axis, (BLOCK_G, 16)
    x = tl.load(x_ptr + a[:, None] * s_a + ax * s_l + b[:, None] * s_b, mask=gmask[:, None],
                other=0.0)
    x = widen_f32(x)
    s = tl.load(signs_ptr + i)
    if INVERSE:
        v = x * 0.25
    else:
        v = x * (s * 0.25)[None, :]
    v = tl.reshape(v, (BLOCK_G, 2, 2, 2, 2))  # index bits (8, 4, 2, 1)
    for _ in tl.static_range(4):  # h = 1, 2, 4, 8: always the last axis
        lo, hi = tl.split(v)
        v = tl.join(lo + hi, lo - hi)
        v = tl.permute(v, (0, 4, 1, 2, 3))  # the next bit last
    v = tl.reshape(v, (BLOCK_G, 16))
    if INVERSE:
        v = v * s[None, :]
    n_l = n_lg * 16
    tl.store(out_ptr + a[:, None] * (n_l * n_b) + ax * n_b + b[:, None], v, mask=gmask[:, None])


def rht(x: torch.Tensor, axis: int = -1, signs: Any = "te", *, inverse: bool = False,
        block: int | None = None) -> torch.Tensor:
    """``fp8sim.hadamard.rht(x, axis, signs, inverse=inverse)`` on x's device: a new float32
    tensor of x's shape, bit for bit the emulator's (a NaN result is NaN; its sign bit is the
    device's). ``x``: float16/bfloat16/float32/float64; the length of ``axis`` must be a
    multiple of 16. ``signs``: ``"te"``, an int seed or 16 values +-1 (``check_signs``).
    ``block``: groups per program (a power of two; default by device).
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16,
                                                          torch.float32, torch.float64):
        raise TypeError("rht: x must be a float16/bfloat16/float32/float64 tensor")
    if x.dim() == 0:
        raise ValueError("rht: x must have at least one axis")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"rht: axis {axis} is out of range for a {x.dim()}-D array")
    ax = axis % x.dim()
    n_l = x.shape[ax]
    if n_l % RHT_SIZE:
        raise ValueError(f"rht: the length of axis {axis} ({n_l}) must be a multiple of {RHT_SIZE}")
    s = torch.tensor(check_signs(signs), dtype=torch.float32, device=x.device)
    if x.numel() >= 2**31:
        raise ValueError(f"rht: at most 2**31 - 1 elements per call, got {x.numel()}")
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    if x.dim() == 2:  # any strides
        n_a, n_b = (x.shape[0], 1) if ax == 1 else (1, x.shape[1])
        s_a, s_l, s_b = (x.stride(0), x.stride(1), 0) if ax == 1 else (0, x.stride(0), x.stride(1))
    else:
        x = x.contiguous()
        n_a, n_b = math.prod(x.shape[:ax]), math.prod(x.shape[ax + 1:])
        s_a, s_l, s_b = n_l * n_b, n_b, 1
    n_groups = n_a * (n_l // RHT_SIZE) * n_b
    blk = block or (512 if is_interpreter() else 64)
    extra = {} if is_interpreter() else {"num_warps": 4, "enable_fp_fusion": False}
    _rht_kernel[(triton.cdiv(n_groups, blk),)](
        x, s, out, n_groups, n_l // RHT_SIZE, n_b, s_a, s_l, s_b,
        INVERSE=int(bool(inverse)), BLOCK_G=blk, **extra,
    )
    return out


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    types = {"x_ptr": "*bf16", "signs_ptr": "*fp32", "out_ptr": "*fp32", "n_groups": "i32",
             "n_lg": "i32", "n_b": "i32", "s_a": "i32", "s_l": "i32", "s_b": "i32"}
    return {f"rht{'_inverse' if inv else ''}": (_rht_kernel, types, dict(INVERSE=inv, BLOCK_G=64),
                                                {"num_warps": 4, "enable_fp_fusion": False})
            for inv in (0, 1)}
