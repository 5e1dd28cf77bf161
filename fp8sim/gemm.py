"""Emulated scaled FP8 GEMM: ``C = (A_q * sA) @ (B_q * sB)`` from codes and inverse scales.

Operands: ``A`` codes ``(M, K)`` and ``B`` codes ``(K, N)``, each with its ``scale_inv`` laid out
by a granularity of :mod:`fp8sim.scaling` over the operand's own 2-D view: ``tensor`` (0-d),
``row`` of A ``(M, 1)``, ``col`` of B ``(1, N)``, ``block:1x128`` of A ``(M, ceil(K/128))``,
``block:128x128`` of B ``(ceil(K/128), ceil(N/128))``, or any other ``block:RxC`` / ``mx``.

Arithmetic, for each output element, K in increasing order (fixed, reproducible):

* products of decoded codes are exact (at most 11 x 11 significant bits);
* they are added into a partial accumulator with ``acc_bits`` stored mantissa bits
  (``acc_bits=23``, ``acc_rounding="rne"``: IEEE float32, bit-exact incl. overflow), rounded after
  every addition with ``acc_rounding`` (``rne`` or ``rtz``, truncation); the reduced accumulator
  has float32's exponent range in practice (its exponent is not bounded; results are rounded to
  float32 on promotion);
* the partial sum is promoted into a float32 accumulator (round to nearest even) at the end, every
  ``k_chunk`` elements if ``k_chunk`` is set (DeepSeek-V3's report on Hopper FP8 tensor cores:
  about 14 bits retained, promotion to CUDA-core float32 every 128 elements), and at every
  boundary where a scale changes along K;
* scales constant along K (tensor, row of A, col of B) are applied once at the end as cuBLAS's
  epilogue does: ``C = float32(acc * float32(sA * sB))``; scales that change along K (blocks)
  are applied at each promotion with one rounding, as DeepGEMM's fused multiply-add:
  ``acc = float32(acc + float32(sA * sB) * partial)``.

NVFP4 operands (:func:`gemm` of two ``nvfp4`` :class:`~fp8sim.scaling.ScaledTensor`): A's
blocks must run along K (``nvfp4`` 1x16 or ``nvfp4:2d``), B's too (``nvfp4:16x1`` or
``nvfp4:2d`` on B's ``(K, N)`` view); the decoded E4M3 block scales are the varying scales above
(16-element segments: the E2M1 products and their sums are exact in float32, as are the scale
products, so the only roundings are the float32 accumulation and the epilogue), and the
per-tensor scales give ``alpha`` (:func:`fp8sim.nvfp4.gemm_alpha`): ``C = float32(acc * alpha)``,
as Transformer Engine's reference NVFP4 GEMM does.

:data:`HOPPER_FP8` holds the reduced-precision settings as we model them (13 stored bits, i.e.
14 significant, truncated; promotion every 128). The float64 matmul of the dequantized operands
is the reference the tests hold this to.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from fp8sim._numba.jit import jit_kernel, jit_scalar
from fp8sim.emulator import decode
from fp8sim.formats import FloatFormat, get_format
from fp8sim.nvfp4 import gemm_alpha
from fp8sim.scaling import Granularity, ScaledTensor, parse_granularity

__all__ = ["ACC_ROUNDINGS", "HOPPER_FP8", "scaled_gemm", "gemm"]

ACC_ROUNDINGS = ("rne", "rtz")
#: reduced-precision accumulation as reported for Hopper FP8 tensor cores (DeepSeek-V3, sec. 3.3)
HOPPER_FP8 = {"acc_bits": 13, "acc_rounding": "rtz", "k_chunk": 128}


@jit_scalar
def _two_sum(a, b):
    """``s = fl(a + b)`` and the exact error ``e``: ``a + b == s + e`` (Knuth)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


@jit_scalar
def _round_sum(s, err, p, rtz):
    """The exact ``s + err`` (``s = fl64(s + err)``) rounded to ``p`` significant bits."""
    if s == 0.0 or not math.isfinite(s):
        return s
    neg = s < 0.0
    mag = -s if neg else s
    below = (err > 0.0) if neg else (err < 0.0)  # exact magnitude slightly below |s|
    above = (err < 0.0) if neg else (err > 0.0)
    m, e = math.frexp(mag)  # mag = m * 2**e, 0.5 <= m < 1
    y = math.ldexp(m, p)  # in [2**(p-1), 2**p), exact
    f = math.floor(y)
    d = y - f  # exact fraction
    if rtz:
        if d == 0.0 and below:
            if m == 0.5:  # a power of two: step into the binade below
                r = math.ldexp(2.0**p - 1.0, e - 1 - p)
                return -r if neg else r
            f -= 1.0
    else:
        if d > 0.5 or (d == 0.5 and (above or (not below and f % 2.0 == 1.0))):
            f += 1.0
    r = math.ldexp(f, e - p)
    return -r if neg else r


@jit_scalar
def _gemm_element(a, b, sa, sb, ra, ca, rb, cb, seg, scales_vary, p, rtz, native32, i, j):
    """Output element (i, j): a (M, K) / b (K, N) decoded float64; sa, sb float32 scale grids
    with tiles (ra, ca), (rb, cb); seg: K boundaries of the promotion segments (0 ... K)."""
    acc = np.float32(0.0)
    for s in range(seg.size - 1):
        k0, k1 = seg[s], seg[s + 1]
        if native32:  # IEEE float32 accumulation (the products are exact in float32)
            part32 = np.float32(0.0)
            for k in range(k0, k1):
                part32 = np.float32(part32 + np.float32(a[i, k] * b[k, j]))
            part = np.float64(part32)
        else:
            part = 0.0
            for k in range(k0, k1):
                t, err = _two_sum(part, a[i, k] * b[k, j])
                part = _round_sum(t, err, p, rtz)
            part = np.float64(np.float32(part))  # promotion to float32 (exact for p <= 24)
        if scales_vary:
            f = np.float32(np.float32(sa[i // ra, k0 // ca]) * np.float32(sb[k0 // rb, j // cb]))
            t, err = _two_sum(np.float64(acc), np.float64(f) * part)  # the product is exact
            acc = np.float32(_round_sum(t, err, 24, False))  # fused multiply-add, one rounding
        else:
            acc = np.float32(acc + np.float32(part))
    if not scales_vary:
        f = np.float32(np.float32(sa[i // ra, 0]) * np.float32(sb[0, j // cb]))
        acc = np.float32(acc * f)
    return acc


@jit_kernel
def _gemm_kernel(a, b, sa, sb, ra, ca, rb, cb, seg, scales_vary, p, rtz, native32, out):
    """One output row per thread (disjoint writes)."""
    m_rows, n_cols = out.shape
    for i in numba.prange(m_rows):
        for j in range(n_cols):
            out[i, j] = _gemm_element(
                a, b, sa, sb, ra, ca, rb, cb, seg, scales_vary, p, rtz, native32, i, j
            )


def _codes(x: Any, what: str) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "ui" or arr.ndim != 2:
        raise TypeError(
            f"scaled_gemm: {what} must be a 2-D unsigned integer code array, "
            f"got {arr.dtype} {arr.shape}"
        )
    return arr


def _scales(
    s: Any, gran: Granularity, rows: int, cols: int, what: str
) -> tuple[np.ndarray, int, int]:
    if type(s).__module__.startswith("torch"):
        s = s.detach().cpu().numpy()
    arr = np.asarray(s, dtype=np.float32)
    grid = gran.grid2d(rows, cols)
    if arr.size != grid[0] * grid[1] or (gran.kind != "tensor" and arr.shape != grid):
        want = "()" if gran.kind == "tensor" else str(grid)
        raise ValueError(
            f"scaled_gemm: {what} scale_inv has shape {arr.shape}, {gran.spec} needs {want}"
        )
    if np.any(arr < 0) or np.any(np.isinf(arr)):
        raise ValueError(
            f"scaled_gemm: {what} scale_inv must be finite and > 0, or 0 for an all-zero block "
            "(NaN marks a NaN block)"
        )
    r, c = gran.tile(rows, cols)
    return np.ascontiguousarray(arr.reshape(grid)), r, c


def _infer(s: Any, rows: int, cols: int, axis_kind: str, what: str) -> Granularity:
    shape = np.shape(s)
    if math.prod(shape) == 1 and len(shape) <= 2:
        return Granularity("tensor")
    if shape == ((rows, 1) if axis_kind == "row" else (1, cols)):
        return Granularity(axis_kind)
    raise ValueError(
        f"scaled_gemm: cannot infer the granularity of {what} scale_inv with shape {shape}; "
        f"pass {what}_granularity (e.g. 'block:1x128')"
    )


def scaled_gemm(
    a_codes: Any,
    a_fmt: FloatFormat | str,
    a_scale_inv: Any,
    b_codes: Any,
    b_fmt: FloatFormat | str,
    b_scale_inv: Any,
    *,
    a_granularity: str | Granularity | None = None,
    b_granularity: str | Granularity | None = None,
    acc_bits: int = 23,
    acc_rounding: str = "rne",
    k_chunk: int | None = None,
    alpha: Any = None,
    out_dtype: Any = np.float32,
) -> np.ndarray:
    """``(decode(A) * sA) @ (decode(B) * sB)`` with the accumulation rules of the module docstring.

    ``a_codes`` (M, K) and ``b_codes`` (K, N) are code arrays (numpy or CPU torch). A missing
    granularity is inferred from the scale's shape: one element -> tensor, ``(M, 1)`` -> row of
    A, ``(1, N)`` -> col of B; blocks must be named. ``acc_bits`` in 1..23, ``acc_rounding`` in
    :data:`ACC_ROUNDINGS`, ``k_chunk`` >= 1 or None. ``alpha``: a float32 epilogue factor,
    ``C = float32(C * alpha)`` after everything else (None: none). Returns ``(M, N)`` in ``out_dtype``
    (float32 default; other dtypes are cast from the float32 result).
    """
    a, b = _codes(a_codes, "a_codes"), _codes(b_codes, "b_codes")
    a_fmt, b_fmt = get_format(a_fmt), get_format(b_fmt)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"scaled_gemm: inner dimensions differ: A is {a.shape}, B is {b.shape}")
    if (
        isinstance(acc_bits, bool)
        or not isinstance(acc_bits, (int, np.integer))
        or not 1 <= acc_bits <= 23
    ):
        raise ValueError(
            f"scaled_gemm: acc_bits must be an int in 1..23 (23 = float32), got {acc_bits!r}"
        )
    if acc_rounding not in ACC_ROUNDINGS:
        raise ValueError(
            f"scaled_gemm: acc_rounding must be one of {', '.join(ACC_ROUNDINGS)}, "
            f"got {acc_rounding!r}"
        )
    if k_chunk is not None and (
        isinstance(k_chunk, bool) or not isinstance(k_chunk, (int, np.integer)) or k_chunk < 1
    ):
        raise ValueError(f"scaled_gemm: k_chunk must be a positive int or None, got {k_chunk!r}")
    ga = (
        parse_granularity(a_granularity)
        if a_granularity is not None
        else _infer(a_scale_inv, m, k, "row", "a")
    )
    gb = (
        parse_granularity(b_granularity)
        if b_granularity is not None
        else _infer(b_scale_inv, k, n, "col", "b")
    )
    sa, ra, ca = _scales(a_scale_inv, ga, m, k, "a")
    sb, rb, cb = _scales(b_scale_inv, gb, k, n, "b")

    steps = [s for s in (ca if ca < k else None, rb if rb < k else None, k_chunk) if s]
    bounds = {0, k}
    for step in steps:
        bounds.update(range(0, k, step))
    seg = np.array(sorted(bounds), dtype=np.int64) if k else np.zeros(1, np.int64)

    # decode() checks the code range (one clear error) and is exact in float64
    av = decode(a, a_fmt, dtype=np.float64)
    bv = decode(b, b_fmt, dtype=np.float64)
    out = np.empty((m, n), dtype=np.float32)
    native32 = acc_bits == 23 and acc_rounding == "rne"
    _gemm_kernel(
        np.ascontiguousarray(av),
        np.ascontiguousarray(bv),
        sa,
        sb,
        ra,
        ca,
        rb,
        cb,
        seg,
        bool(ca < k or rb < k),
        int(acc_bits) + 1,
        acc_rounding == "rtz",
        native32,
        out,
    )
    if alpha is not None:
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            out = (out * np.float32(alpha)).astype(np.float32)
    return out if np.dtype(out_dtype) == np.float32 else out.astype(out_dtype)


def gemm(a: ScaledTensor, b: ScaledTensor, **kwargs: Any) -> np.ndarray:
    """:func:`scaled_gemm` of two :class:`~fp8sim.scaling.ScaledTensor` (A (M, K), B (K, N))."""
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ValueError(f"gemm: operands must be 2-D, got {a.shape} and {b.shape}")
    ga, gb = parse_granularity(a.granularity), parse_granularity(b.granularity)
    if "nvfp4" in (ga.kind, gb.kind):
        if ga.kind != gb.kind or ga.variant != gb.variant:
            raise ValueError(f"gemm: NVFP4 operands must both be NVFP4 of one variant, got "
                             f"{a.granularity} and {b.granularity}")  # fmt: skip
        if ga.block[1] != 16 or gb.block[0] != 16:
            raise ValueError(f"gemm: NVFP4 blocks must run along K: A nvfp4 or nvfp4:2d, B "
                             f"nvfp4:16x1 or nvfp4:2d, got {a.granularity} and {b.granularity}")  # fmt: skip
        if "alpha" in kwargs:
            raise ValueError("gemm: NVFP4 operands set alpha from their tensor scales")
        return scaled_gemm(a.codes, a.fmt, a.scale_inv, b.codes, b.fmt, b.scale_inv,
                           a_granularity=f"block:{ga.block[0]}x{ga.block[1]}",
                           b_granularity=f"block:{gb.block[0]}x{gb.block[1]}",
                           alpha=gemm_alpha(a.tensor_scale, b.tensor_scale, ga.variant), **kwargs)  # fmt: skip
    return scaled_gemm(
        a.codes,
        a.fmt,
        a.scale_inv,
        b.codes,
        b.fmt,
        b.scale_inv,
        a_granularity=a.granularity,
        b_granularity=b.granularity,
        **kwargs,
    )
