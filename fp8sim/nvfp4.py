"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one float32 scale per tensor.

The numerics of three libraries, each named as a ``variant`` and emulated bit for bit (every
step below is one float32 operation rounded to nearest even, in the order written; ``E4M3(v)``
is the saturating round-to-nearest-even cast to E4M3 -- Transformer Engine clamps to +-448 before
its cast, which is the same -- and ``f32max`` the largest float32).

Notation: ``A`` is the tensor amax (``global_amax``; the max of |x| over the non-NaN elements
unless given), ``a`` a block's amax, ``b`` the block's decoded E4M3 scale, ``x`` an element
(float32), ``y`` what is cast to E2M1 with the chosen rounding, saturating at 6.

``te`` (default; Transformer Engine 2.x: ``NVFP4QuantizerRef`` in
``pytorch/custom_recipes/quantization_nvfp4.py``, ``compute_global_encode_scaling_factor_FP4`` and
``compute_decoding_scaling_factor`` in ``common/cast/nvfp4/core_nvfp4.cuh``)::

    S = 2688 / A;  S = f32max if S is inf;  S = 1 if A == 0 or S == 0   (2688 = 448 * 6)
    b = E4M3(min(a * (S * float32(1/6)), f32max))
    r = min(1 / (b * (1 / S)), f32max)               (a zero block: r = f32max)
    y = x * r
    stored: the amax A;  decode: value = e2m1 * ((b * A) * float32(1/2688))

``torchao`` (0.18: ``nvfp4_quantize`` with ``per_tensor_scale = per_tensor_amax_to_scale(A)``
in ``torchao/prototype/mx_formats/nvfp4_tensor.py``)::

    P = A / 2688
    b = E4M3(clamp((a / 6) / P, 2**-6, 448))          (E4M3's smallest normal, never subnormal)
    y = x * ((1 / P) / b)
    stored: P;  decode: value = e2m1 * (P * b)

``torchao-block`` (the same function with ``per_tensor_scale=None``: one level)::

    b = E4M3(clamp(a / 6, 2**-6, 448));  y = x * (1 / b);  stored: 1;  decode: e2m1 * b

(torchao before 0.18 divided instead: ``y = x / (P * b)`` and ``y = x / b``.)

``compressed-tensors`` (``generate_gparam`` and ``calculate_qparams`` in
``compressed_tensors/quantization/utils/helpers.py``, ``_quantize`` in
``quantization/lifecycle/forward_helpers.py``)::

    G = 2688 * (1 / max(A, 2**-126));  G = 1 if G is inf or NaN   (torch's scalar / tensor)
    b = E4M3(clamp(G * (a / 6), -448, 448));  b = 0.125 if b == 0
    y = x / (b / G)                                   (a y of -0 gets the code of +0)
    stored: G;  decode: value = e2m1 * (b / G)

Where they differ: a zero block is scale 0 in ``te`` (its elements 0), ``2**-6`` in torchao,
0.125 in compressed-tensors; an all-zero tensor makes torchao's ``P`` zero and every block scale
NaN (``(0 / 6) / 0``), while ``te`` uses ``S = 1``; tiny block scales become E4M3 subnormals or
0 in ``te`` and compressed-tensors but are clamped up to ``2**-6`` in torchao; ``te`` and
torchao multiply by differently rounded reciprocals and compressed-tensors divides, so codes
differ near rounding boundaries.

Blocks (``tile``) on the 2-D view ``(M, N)`` (last axis, product of the others): ``1x16``
(along rows: activations, the forward GEMM's operands), ``16x1`` (along columns: the operand
layout of the weight-gradient GEMM), ``16x16`` (weights: the same scales serve both directions);
a ragged last block is cut at the array's edge (Transformer Engine pads with zeros, which changes
no amax). The amaxes ignore NaN. fp8sim's convention where E2M1 has no NaN: a block holding a NaN
gets the E4M3 NaN scale (code 0x7F) and element codes 0, so it decodes to NaN (Transformer
Engine's reference turns every scale NaN instead; torchao writes NaN-derived nibbles).

Stochastic rounding (``rounding="stochastic"``) rounds ``y`` with :func:`fp8sim.encode`'s rule and
Philox stream, counter = the flat C-order index of the element in ``x``; block scales always round
to nearest even. Packed storage (:func:`pack_e2m1`): two codes per byte, the element with the
lower index in the low nibble, as ``torch.float4_e2m1fn_x2``, Transformer Engine, torchao and
compressed-tensors store them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8sim.emulator import decode, encode
from fp8sim.granularity import NVFP4_LAYOUTS, NVFP4_VARIANTS, check_layout, check_variant

__all__ = [
    "NVFP4_BLOCK",
    "NVFP4_LAYOUTS",
    "NVFP4_VARIANTS",
    "NVFP4Parts",
    "check_variant",
    "check_layout",
    "block_decode_scale_torch",
    "tensor_scale_for",
    "block_scales",
    "cast_multiplier",
    "block_decode_scale",
    "gemm_alpha",
    "quantize_nvfp4_2d",
    "dequantize_nvfp4_2d",
    "pack_e2m1",
    "unpack_e2m1",
]

NVFP4_BLOCK = 16

_F32_MAX = np.float32(np.finfo(np.float32).max)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)  # 2**-126
_E2M1_MAX = np.float32(6.0)
_E4M3_MAX = np.float32(448.0)
_E4M3_MIN_NORMAL = np.float32(2.0**-6)
_GLOBAL = np.float32(448.0 * 6.0)  # 2688
_RCP_6 = np.float32(1.0 / 6.0)
_RCP_GLOBAL = np.float32(1.0 / (448.0 * 6.0))
_E4M3_NAN = np.uint8(0x7F)
_CT_ZERO_SCALE = np.float32(0.125)


def _check_amax(global_amax: Any) -> np.float32:
    a = np.float32(global_amax)
    if np.isnan(a) or a < 0:
        raise ValueError(f"global_amax must be >= 0 (inf allowed), got {global_amax!r}")
    return a


def tensor_scale_for(global_amax: Any, variant: str = "te") -> np.float32:
    """The per-tensor float32 the variant stores for a tensor amax (module docstring): ``te``
    the amax itself, ``torchao`` ``P = A / 2688``, ``torchao-block`` 1, ``compressed-tensors``
    ``G = 2688 * (1 / max(A, 2**-126))`` (1 if that is inf)."""
    variant = check_variant(variant)
    a = _check_amax(global_amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if variant == "te":
            return a
        if variant == "torchao":
            return np.float32(a / _GLOBAL)
        if variant == "torchao-block":
            return np.float32(1.0)
        g = np.float32(_GLOBAL * np.float32(np.float32(1.0) / max(a, _F32_TINY)))
    return g if np.isfinite(g) else np.float32(1.0)


def _te_encode_scale(amax: np.float32) -> np.float32:
    with np.errstate(divide="ignore", over="ignore"):
        s = np.float32(_GLOBAL / amax)
    if s == np.inf:
        s = _F32_MAX
    if amax == 0 or s == 0:
        s = np.float32(1.0)
    return s


def block_scales(block_amax: Any, global_amax: Any, variant: str = "te") -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes uint8, decoded float32) of the block scales for float32 block amaxes under a
    tensor amax (module docstring). A NaN block amax (a block holding a NaN) gives code 0x7F."""
    variant = check_variant(variant)
    amax = np.asarray(block_amax, dtype=np.float32)
    ga = _check_amax(global_amax)
    t = tensor_scale_for(ga, variant)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if variant == "te":
            pre = np.minimum(amax * np.float32(_te_encode_scale(ga) * _RCP_6), _F32_MAX)
        elif variant == "compressed-tensors":
            pre = np.clip(t * (amax / _E2M1_MAX), -_E4M3_MAX, _E4M3_MAX)
        elif variant == "torchao":
            pre = np.clip((amax / _E2M1_MAX) / t, _E4M3_MIN_NORMAL, _E4M3_MAX)
        else:
            pre = np.clip(amax / _E2M1_MAX, _E4M3_MIN_NORMAL, _E4M3_MAX)
    nan = np.isnan(pre)
    codes = encode(np.where(nan, np.float32(0), pre).astype(np.float32), "e4m3", rounding="rne",
                   saturate=True)  # fmt: skip
    if variant == "compressed-tensors":
        codes = np.where(codes == 0, np.uint8(0x20), codes)  # a zero scale becomes 0.125
    codes = np.where(nan, _E4M3_NAN, codes).astype(np.uint8)
    return codes, decode(codes, "e4m3", dtype=np.float32)


def cast_multiplier(block_scale: Any, global_amax: Any, variant: str = "te") -> np.ndarray:
    """Per block, the float32 ``r`` of the element cast ``y = float32(x * r)``: ``te``
    ``min(1 / (b * (1 / S)), f32max)``, ``torchao`` ``(1 / P) / b``, ``torchao-block`` ``1 / b``.
    compressed-tensors divides (``y = x / (b / G)``, not a product with a rounded reciprocal):
    ValueError."""
    variant = check_variant(variant)
    if variant == "compressed-tensors":
        raise ValueError("cast_multiplier: compressed-tensors divides by b / G; no multiplier")
    b = np.asarray(block_scale, dtype=np.float32)
    ga = _check_amax(global_amax)
    one = np.float32(1.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if variant == "te":
            s_dec = np.float32(one / _te_encode_scale(ga))
            r = np.minimum(one / (b * s_dec).astype(np.float32), _F32_MAX)
        elif variant == "torchao":
            r = (one / tensor_scale_for(ga, variant)) / b
        else:
            r = one / b
    return np.asarray(r, dtype=np.float32)


def block_decode_scale(block_scale: Any, tensor_scale: Any, variant: str = "te") -> np.ndarray:
    """Per block, the float32 factor that multiplies a decoded E2M1 value (module docstring):
    ``te`` ``(b * A) * float32(1/2688)`` (Transformer Engine's dequantize kernel), ``torchao``
    ``P * b``, ``torchao-block`` ``b``, ``compressed-tensors`` ``b / G``. NaN blocks stay NaN."""
    variant = check_variant(variant)
    b = np.asarray(block_scale, dtype=np.float32)
    t = np.float32(tensor_scale)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if variant == "te":
            out = (b * t).astype(np.float32) * _RCP_GLOBAL
        elif variant == "torchao":
            out = t * b
        elif variant == "torchao-block":
            out = b.copy()
        else:
            out = b / t
    return np.asarray(out, dtype=np.float32)


def block_decode_scale_torch(block_scale: Any, tensor_scale: Any, variant: str = "te") -> Any:
    """:func:`block_decode_scale` on torch tensors of any device (the same float32 operations
    in the same order, so the same values bit for bit)."""
    import torch

    variant = check_variant(variant)
    b = block_scale.to(torch.float32)
    t = torch.as_tensor(tensor_scale, dtype=torch.float32, device=b.device)
    if variant == "te":
        return (b * t) * torch.tensor(_RCP_GLOBAL, device=b.device)
    if variant == "torchao":
        return t * b
    if variant == "torchao-block":
        return b.clone()
    return b / t


def gemm_alpha(tensor_scale_a: Any, tensor_scale_b: Any, variant: str = "te") -> np.float32:
    """The float32 epilogue factor of an NVFP4 GEMM whose block scales are the decoded E4M3
    values: ``te`` ``(A_a * A_b) / 7225344`` (Transformer Engine's reference ``qgemm``: 7225344 =
    6 * 6 * 448 * 448), ``torchao`` ``P_a * P_b``, ``torchao-block`` 1, ``compressed-tensors``
    ``1 / (G_a * G_b)`` computed as ``(1 / G_a) / G_b``."""
    variant = check_variant(variant)
    ta, tb = np.float32(tensor_scale_a), np.float32(tensor_scale_b)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if variant == "te":
            return np.float32(np.float32(ta * tb) / np.float32(7225344.0))
        if variant == "torchao":
            return np.float32(ta * tb)
        if variant == "torchao-block":
            return np.float32(1.0)
        return np.float32(np.float32(np.float32(1.0) / ta) / tb)


@dataclass(frozen=True)
class NVFP4Parts:
    """What :func:`quantize_nvfp4_2d` returns (arrays over the 2-D view ``(M, N)``).

    Attributes:
        codes: uint8 ``(M, N)``, one E2M1 code per element (0..15, sign in bit 3).
        block_codes: uint8 E4M3 codes of the block scales, ``(ceil(M/R), ceil(N/C))``.
        block_scale: float32 decoded ``block_codes`` (NaN for a block holding a NaN).
        tensor_scale: float32, the per-tensor value the variant stores (:func:`tensor_scale_for`).
        global_amax: float32, the tensor amax used (given or computed; NaN ignored).
        block_amax: float32 per-block amax over the non-NaN elements.
        nan_count: NaN elements in the input.
    """

    codes: np.ndarray
    block_codes: np.ndarray
    block_scale: np.ndarray
    tensor_scale: np.float32
    global_amax: np.float32
    block_amax: np.ndarray
    nan_count: int


def _tile_amax(x2d: np.ndarray, tile: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(amax over the non-NaN elements, NaN count) per tile; ragged tiles are cut at the edge."""
    m, n = x2d.shape
    r, c = tile
    grid = (-(-m // r), -(-n // c))
    if m == 0 or n == 0:
        return np.zeros(grid, np.float32), np.zeros(grid, np.int64)
    rows, cols = np.arange(0, m, r), np.arange(0, n, c)
    isnan = np.isnan(x2d)
    mag = np.where(isnan, np.float32(0), np.abs(x2d))
    amax = np.maximum.reduceat(np.maximum.reduceat(mag, cols, axis=1), rows, axis=0)
    nans = np.add.reduceat(np.add.reduceat(isnan.astype(np.int64), cols, axis=1), rows, axis=0)
    return amax.astype(np.float32), nans


def _expand(grid: np.ndarray, tile: tuple[int, int], m: int, n: int) -> np.ndarray:
    r, c = tile
    return np.repeat(np.repeat(grid, r, axis=0)[:m], c, axis=1)[:, :n]


def quantize_nvfp4_2d(
    x2d: np.ndarray,
    tile: tuple[int, int] | str = (1, NVFP4_BLOCK),
    variant: str = "te",
    *,
    global_amax: Any = None,
    rounding: str = "rne",
    seed: int | None = None,
    srbits: int | None = None,
) -> NVFP4Parts:
    """Quantize a float32 2-D array to NVFP4 with the ``variant``'s rules (module docstring).

    ``tile``: the block, ``(1, 16)``, ``(16, 1)``, ``(16, 16)`` or its name. ``global_amax``:
    the tensor amax the per-tensor scale comes from (e.g. a delayed or calibrated one); None
    computes it from ``x2d`` (NaN ignored). ``rounding``: ``rne`` or ``stochastic`` (with
    ``seed``, optional ``srbits``), or any other :data:`fp8sim.ROUNDING_MODES` mode.
    """
    variant = check_variant(variant)
    tile = check_layout(tile)
    x2d = np.asarray(x2d, dtype=np.float32)
    if x2d.ndim != 2:
        raise ValueError(f"quantize_nvfp4_2d: x2d must be 2-D, got shape {x2d.shape}")
    m, n = x2d.shape
    amax, nans = _tile_amax(x2d, tile)
    nan_block = nans > 0
    if global_amax is None:
        ga = np.float32(amax.max()) if amax.size else np.float32(0)
    else:
        ga = _check_amax(global_amax)
    tscale = tensor_scale_for(ga, variant)
    bcodes, b = block_scales(np.where(nan_block, np.float32(np.nan), amax), ga, variant)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        if variant == "compressed-tensors":
            y = x2d / _expand((b / tscale).astype(np.float32), tile, m, n)
        else:
            y = x2d * _expand(cast_multiplier(b, ga, variant), tile, m, n)
        y = np.asarray(y, dtype=np.float32)
    bad = nan_block | np.isnan(b)  # NaN input, or a NaN scale (torchao: 0 / 0)
    bcodes = np.where(bad, _E4M3_NAN, bcodes).astype(np.uint8)
    b = np.where(bad, np.float32(np.nan), b).astype(np.float32)
    if bad.any() or np.isnan(y).any():
        y = np.where(_expand(bad, tile, m, n) | np.isnan(y), np.float32(0), y)
    codes = encode(y, "e2m1", rounding=rounding, saturate=True, seed=seed, srbits=srbits)
    if variant == "compressed-tensors":  # its cast takes the sign from torch.sign: +0 for -0
        codes = np.where(y == 0, np.uint8(0), codes).astype(np.uint8)
    return NVFP4Parts(codes=codes, block_codes=bcodes, block_scale=b, tensor_scale=tscale,
                      global_amax=ga, block_amax=amax, nan_count=int(nans.sum()))  # fmt: skip


def dequantize_nvfp4_2d(
    codes: np.ndarray,
    block_scale: np.ndarray,
    tensor_scale: Any,
    tile: tuple[int, int] | str = (1, NVFP4_BLOCK),
    variant: str = "te",
) -> np.ndarray:
    """``float32(e2m1(code) * factor)`` with the per-block factor of :func:`block_decode_scale`
    (one float32 product per element, as each library's dequantize does)."""
    tile = check_layout(tile)
    codes = np.asarray(codes)
    m, n = codes.shape
    f = block_decode_scale(block_scale, tensor_scale, variant)
    v = decode(codes, "e2m1", dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (v * _expand(f, tile, m, n)).astype(np.float32)


def pack_e2m1(codes: Any) -> np.ndarray:
    """Two E2M1 codes per byte along the last axis: element ``2k`` in the low nibble, ``2k+1``
    in the high one (``torch.float4_e2m1fn_x2``'s order); an odd last axis is padded with code
    0. Returns uint8 of shape ``(..., ceil(N / 2))``."""
    c = np.asarray(codes)
    if c.dtype.kind not in "ui" or (c.size and (c.min() < 0 or c.max() > 15)):
        raise ValueError("pack_e2m1: codes must be integers in 0..15")
    c = c.astype(np.uint8)
    if c.ndim == 0:
        c = c.reshape(1)
    if c.shape[-1] % 2:
        c = np.concatenate([c, np.zeros((*c.shape[:-1], 1), np.uint8)], axis=-1)
    return (c[..., 0::2] | (c[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_e2m1(packed: Any, n: int | None = None) -> np.ndarray:
    """The inverse of :func:`pack_e2m1`: uint8 codes ``(..., 2 * K)``, cut to ``n`` if given."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"unpack_e2m1: packed must be uint8, got {p.dtype}")
    out = np.stack([p & np.uint8(0xF), p >> np.uint8(4)], axis=-1).reshape(*p.shape[:-1], -1)
    if n is not None:
        if not 0 <= n <= out.shape[-1]:
            raise ValueError(f"unpack_e2m1: n={n} is outside 0..{out.shape[-1]}")
        out = out[..., :n]
    return np.ascontiguousarray(out)
