"""The FP8 GEMM of two quantized operands under a :class:`~fp8sim.recipes.GemmRule`, on any
backend and device (:meth:`fp8sim.backends.base.Backend.gemm` calls :func:`gemm`).

Operands are :class:`~fp8sim.quantizer.QuantizedTensor` ``a`` (M, K) and ``b`` (N, K), both laid
out with the reduction axis K last; the result is ``A B^T`` (M, N). Rules:

* ``exact`` -- per-tensor and per-row scales: the backend's ``scaled_mm`` (decoded products
  exact, the sum in float32 -- ``accumulate="float64"``: in float64 -- then
  ``float32(acc * float32(sA * sB))``, cuBLAS's epilogue order). Block scales (``blocks(R, C)``,
  MX): a float32 matmul of the operands dequantized in float32 (``decode * scale_inv``, one
  rounding; exact for power-of-two scales). NVFP4: ``float32(mm(e2m1 * b_A, e2m1 * b_B) *
  alpha)`` -- each operand times its decoded E4M3 block scales (exact: 2 x 4 significant bits),
  every product exact, summed in float32, then the per-tensor factor
  :func:`fp8sim.nvfp4.gemm_alpha` once, as Transformer Engine's reference NVFP4 GEMM.
* ``torchao`` -- torchao.float8's emulated ``_scaled_mm``: each operand dequantized in float32
  as ``float32(decode(code)) / scale`` (its stored multiplier, per tensor or per row), then a
  float32 matmul (``torch.mm``) of the two.
* ``accumulator`` -- :func:`fp8sim.gemm.scaled_gemm` with :data:`fp8sim.gemm.HOPPER_FP8`
  (14 significant bits, truncated, promoted to float32 every 128 elements and at every block
  boundary): the emulator backend only (numba, on the host).

:func:`grouped_gemm` runs the GEMMs of MoE experts, one per expert on its own scales.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from fp8sim.recipes import GemmRule

__all__ = ["gemm", "grouped_gemm", "dequantize", "expand_grid"]


def expand_grid(grid: torch.Tensor, tile: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """A per-block grid spread over the (rows, cols) elements its blocks cover (ragged edges cut)."""
    r, c = tile
    want = (-(-rows // r), -(-cols // c))
    if tuple(grid.shape) != want:
        raise ValueError(f"block operand: scale grid {tuple(grid.shape)} for a ({rows}, {cols}) operand in "
                         f"{r}x{c} blocks (expected {want})")
    return grid.repeat_interleave(min(r, max(rows, 1)), 0)[:rows].repeat_interleave(min(c, max(cols, 1)), 1)[:, :cols]


def _tile(q: Any, rows: int, cols: int) -> tuple[int, int]:
    return q.granularity.tile(rows, cols)


def _block_values(backend: Any, q: Any) -> torch.Tensor:
    """``decode(codes) * scale_inv`` in float32 per group (exact decode, one rounding of the
    product; NVFP4: times the decoded E4M3 block scale, exact, without the tensor scale)."""
    values = backend.decode(q.codes, q.fmt)  # (R, C) float32, exact
    if q.granularity.kind == "tensor":
        return values * q.scale_inv
    rows, cols = values.shape
    grid = q.scale_inv.to(device=values.device, dtype=torch.float32)
    return values * expand_grid(grid, _tile(q, rows, cols), rows, cols)


def dequantize(backend: Any, q: Any) -> torch.Tensor:
    """The float32 values of a cast: ``decode(codes) * scale_inv`` (one rounding); NVFP4:
    ``decode(codes) * block_decode_scale`` (:func:`fp8sim.nvfp4.block_decode_scale`)."""
    if q.granularity.kind == "tensor":
        return backend.dequantize(q.codes, q.fmt, q.scale_inv, out_dtype=torch.float32)
    if q.tensor_scale is None:
        return _block_values(backend, q)
    from fp8sim.nvfp4 import block_decode_scale_torch

    values = backend.decode(q.codes, q.fmt)
    f = block_decode_scale_torch(q.scale_inv, q.tensor_scale, q.granularity.variant)
    return values * expand_grid(f.to(values.device), q.granularity.block, *values.shape)


def gemm(backend: Any, a: Any, b: Any, rule: GemmRule = GemmRule.EXACT, *, accumulate: str | None = None,
         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``A B^T`` (M, N) of ``a`` (M, K) and ``b`` (N, K) under ``rule`` (module docstring).

    ``accumulate``: the ``exact`` rule's per-tensor GEMM arithmetic (``"float32"`` or
    ``"float64"`` where the backend offers it; None: the backend's own). Raises ValueError for
    operands that do not pair (NVFP4 with anything else, two NVFP4 variants) and
    NotImplementedError for a rule the backend does not run."""
    rule = GemmRule(rule)
    ga, gb = a.granularity, b.granularity
    if (ga.kind == "nvfp4") != (gb.kind == "nvfp4") or (ga.kind == "nvfp4" and ga.variant != gb.variant):
        raise ValueError(f"gemm: NVFP4 operands need NVFP4 partners of one variant, got {ga.spec} and {gb.spec}")
    if rule == GemmRule.ACCUMULATOR:
        return backend.gemm_accumulator(a, b, out_dtype=out_dtype)
    if rule == GemmRule.TORCHAO:
        return _torchao(backend, a, b).to(out_dtype)
    if ga.kind in ("tensor", "row") and gb.kind in ("tensor", "row"):
        kw = {"out_dtype": out_dtype}
        if accumulate is not None:
            kw["accumulate"] = accumulate
        sb = b.scale_inv if gb.kind == "tensor" else b.scale_inv.reshape(1, -1)  # (N, 1) rows of b: columns of b^T
        return backend.scaled_mm(a.codes, a.fmt, a.scale_inv, b.codes.t(), b.fmt, sb, **kw)
    if ga.kind == "nvfp4":
        from fp8sim.nvfp4 import gemm_alpha

        alpha = gemm_alpha(float(a.tensor_scale), float(b.tensor_scale), ga.variant)
        acc = _block_values(backend, a) @ _block_values(backend, b).t()
        return (acc * torch.tensor(alpha, dtype=torch.float32, device=acc.device)).to(out_dtype)
    return (_block_values(backend, a) @ _block_values(backend, b).t()).to(out_dtype)


def grouped_gemm(backend: Any, a: Sequence[Any], b: Sequence[Any], rule: GemmRule = GemmRule.EXACT, *,
                 accumulate: str | None = None, out_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """``[A_g B_g^T for g]``: the GEMMs of MoE experts, group ``g`` on operands ``a[g]`` (M_g, K_g)
    and ``b[g]`` (N_g, K_g) cast with their own scales (per tensor, per row, per block, MX or
    NVFP4, as the recipe casts every operand), each exactly :func:`gemm` -- the grouped GEMM is
    bit for bit the loop of per-expert GEMMs.
    ValueError when ``a`` and ``b`` differ in length."""
    if len(a) != len(b):
        raise ValueError(f"grouped_gemm: {len(a)} A operands and {len(b)} B operands; one pair per group")
    return [gemm(backend, ag, bg, rule, accumulate=accumulate, out_dtype=out_dtype) for ag, bg in zip(a, b)]


def _torchao(backend: Any, a: Any, b: Any) -> torch.Tensor:
    """torchao's emulation: ``float32(decode(code)) / scale`` per operand, then ``torch.mm``."""
    def hp(q: Any) -> torch.Tensor:
        g = q.granularity
        if g.kind not in ("tensor", "row"):
            raise ValueError(f"gemm: the torchao rule takes per-tensor or per-row scales, not {g.spec}")
        scale = q.scale if q.scale is not None else torch.reciprocal(q.scale_inv.to(torch.float32))
        return backend.decode(q.codes, q.fmt) / scale.to(device=q.codes.device, dtype=torch.float32)

    return torch.mm(hp(a), hp(b).t())
