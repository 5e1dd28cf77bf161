"""amax -> scale -> cast, as small pure functions shared by analysis and training.

Shapes. Every tensor is viewed as 2-D ``(M, N)``: ``N`` is the last axis, ``M`` the product of the
others (a 1-D tensor is one row, a 0-d tensor is ``(1, 1)``). A granularity tiles that view:

=====================  ============  =====================================================
granularity            tile          scale / amax array shape
=====================  ============  =====================================================
``tensor``             ``(M, N)``    ``()`` (0-d)
``row``                ``(1, N)``    ``(M, 1)``
``col``                ``(M, 1)``    ``(1, N)``
``block:RxC``          ``(R, C)``    ``(ceil(M/R), ceil(N/C))``, e.g. ``block:1x128``,
                                     ``block:128x128`` (DeepSeek-V3)
``mx``, ``mx:rceil``   ``(1, 32)``   ``(M, ceil(N/32))``, E8M0 shared scales (OCP MX)
``nvfp4[:L][:V]``      ``(1, 16)``   ``(M, ceil(N/16))``: E4M3 block scales and a float32
                                     tensor scale (:mod:`fp8sim.nvfp4`); ``L`` = ``1x16``
                                     (default), ``16x1``, ``16x16`` / ``2d``; ``V`` = te
                                     (default), torchao, torchao-block, compressed-tensors
=====================  ============  =====================================================

Ragged edges: a tile that runs past the array is cut at its edge ("padded logically"); nothing
outside the array is read and the missing elements never enter a tile's amax.

Scale rule (``scale_from_amax``, the multiplier applied before the cast), all in float32:
``a = max(amax, epsilon)``; ``scale = (fmt.max * 2**-margin) / a`` (Transformer Engine's
order: the scaled max first); a scale that would be inf
(tiny amax) becomes the float32 max; ``pow2=True`` then rounds it down to a power of two.
amax 0, inf or NaN gives scale 1 (Transformer Engine's current-scaling convention; the stateful
policies in :mod:`fp8sim.policies` keep their previous scale instead).

MX rule (``mx_shared_scale``), per 32-element block, ``X = 2**e`` stored as E8M0:
``floor`` (OCP MX v1.0 section 6.3): ``e = floor(log2(amax)) - emax_elem``; ``rceil`` (cuBLAS,
Transformer Engine, cuDNN): ``e = ceil(log2(float32(amax * float32(1 / fmt.max))))``, i.e. the
float32 descale rounded up to a power of two as ``cvt.rp.ue8m0`` does (it equals
``ceil(log2(amax / fmt.max))`` except within one float32 ulp of a power of two). ``e`` is clamped
to E8M0's range ``[-127, 127]`` (amax 0 gives ``2**-127``). A block holding a NaN or an inf has a
NaN scale (E8M0 code 0xFF), as the MX spec says for NaN and torchao's ``to_mx`` does for both;
Transformer Engine gives an inf block 0xFE (see docs/numerics.md).

Cast (``quantize_scaled``): ``codes = encode(float32(float32(x) * scale))`` -- the input is taken
to float32 first and the product rounded once to float32, as a GPU kernel does -- then encoded
with the chosen rounding and overflow rule. ``scale_inv = float32(1 / scale)`` (MX: ``X``) and
``dequantize`` returns ``decode(codes) * scale_inv`` rounded once to float32.

NVFP4 (``nvfp4...`` granularities, format e2m1): the two-level rules of :mod:`fp8sim.nvfp4`;
``scale_inv`` holds the decoded E4M3 block scales and ``tensor_scale`` the per-tensor float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8sim._numba.bitcast import bits_f32, f32_bits
from fp8sim._numba.jit import jit_scalar, jit_serial
from fp8sim.emulator import as_float_array, decode, encode
from fp8sim.formats import FloatFormat, get_format
from fp8sim.granularity import (GRANULARITY_KINDS, MX_BLOCK, MX_RULES, E8M0Rule, Granularity, parse_granularity,
                                view2d)  # fmt: skip
from fp8sim.nvfp4 import (block_decode_scale, block_scales, cast_multiplier, dequantize_nvfp4_2d, quantize_nvfp4_2d,
                          tensor_scale_for)  # fmt: skip

__all__ = [
    "GRANULARITY_KINDS",
    "MX_BLOCK",
    "MX_RULES",
    "E8M0Rule",
    "Granularity",
    "parse_granularity",
    "check_margin",
    "view2d",
    "compute_amax",
    "scale_from_amax",
    "scale_multiplier",
    "scaled_format_max",
    "mx_shared_scale",
    "block_multiplier",
    "e8m0_codes",
    "ScaledTensor",
    "quantize_scaled",
    "dequantize",
]

_E8M0_EMIN, _E8M0_EMAX = -127, 127
_F32_MAX = np.float32(np.finfo(np.float32).max)


# -- inputs ------------------------------------------------------------------------------------


def _as_float32(x: Any) -> np.ndarray:
    """``float32(x)`` as a numpy array: float16/bfloat16 widen exactly, float64 rounds once
    (values beyond float32's range become +-inf). CPU torch tensors are accepted."""
    arr, _ = as_float_array(x)
    with np.errstate(over="ignore"):  # documented: beyond float32's range becomes +-inf
        return np.asarray(arr, dtype=np.float32)


def _tile_stats(x2d: np.ndarray, gran: Granularity) -> tuple[np.ndarray, np.ndarray]:
    """Per tile: (max |x| over the non-NaN elements, float32; NaN count, int64), grid2d shape.

    ``np.maximum.reduceat`` over the tile starts (NaNs replaced by 0 first): ragged last tiles
    are just shorter, nothing is padded or read out of bounds. A tile of only NaNs (or an empty
    tensor) has amax 0 here.
    """
    m, n = x2d.shape
    r, c = gran.tile(m, n)
    if m == 0 or n == 0:
        grid = gran.grid2d(m, n)
        return np.zeros(grid, np.float32), np.zeros(grid, np.int64)
    rows, cols = np.arange(0, m, r), np.arange(0, n, c)
    mag = np.abs(x2d)
    isnan = np.isnan(x2d)
    if isnan.any():
        # NaNs out before the max: numpy's fmax/nanmax skip quiet NaNs but may drop other
        # values next to a signalling NaN (found with random bit patterns)
        mag = np.where(isnan, np.float32(0), mag)
        nans = np.add.reduceat(np.add.reduceat(isnan.astype(np.int64), cols, axis=1), rows, axis=0)
    else:
        nans = None
    amax = np.maximum.reduceat(np.maximum.reduceat(mag, cols, axis=1), rows, axis=0)
    if nans is None:
        nans = np.zeros(amax.shape, np.int64)
    return amax.astype(np.float32, copy=False), nans


def _grid_out(a: np.ndarray, gran: Granularity) -> np.ndarray:
    return a.reshape(()) if gran.kind == "tensor" else a


def compute_amax(
    x: Any, granularity: str | Granularity = "tensor", *, ignore_nan: bool = False
) -> np.ndarray:
    """``max |float32(x)|`` per tensor / row / col / block (shapes: see the module table).

    Inf is a valid amax. NaN propagates (a group holding a NaN has amax NaN, like ``torch.amax``
    and the backends' ``amax``) unless ``ignore_nan=True``, which takes the max over the other
    values (0 for a group of only NaNs). Returns float32.
    """
    gran = parse_granularity(granularity)
    x32 = _as_float32(x)
    m, n = view2d(x32.shape)
    amax, nans = _tile_stats(x32.reshape(m, n), gran)
    if not ignore_nan:
        amax = np.where(nans > 0, np.float32(np.nan), amax).astype(np.float32)
    return _grid_out(amax, gran)


# -- scale rules -------------------------------------------------------------------------------


@jit_scalar
def _pow2_floor_f32(s):
    """Largest power of two <= s for a finite float32 s > 0 (exact, subnormals included): the
    exponent bits of a normal s, the leading one of a subnormal's; 0 stays 0."""
    u = f32_bits(s)
    if u >= np.uint32(0x00800000) or u == np.uint32(0):
        return bits_f32(np.uint32(u & np.uint32(0x7F800000)))
    top = np.uint32(1)
    while u > np.uint32(1):
        u >>= np.uint32(1)
        top <<= np.uint32(1)
    return bits_f32(top)


@jit_scalar
def scale_multiplier(amax, scaled_max, epsilon, pow2):
    """The scale rule of :func:`scale_from_amax` for one ``amax`` (numba code and Python):
    ``scaled_max`` is :func:`scaled_format_max`, ``epsilon`` >= 0; all three are taken to
    float32 first, and the result is a float32."""
    amax = np.float32(amax)
    scaled_max = np.float32(scaled_max)
    epsilon = np.float32(epsilon)
    a = epsilon if amax < epsilon else amax
    if not (a < np.inf) or a == np.float32(0):  # NaN, inf or 0: scale 1
        return np.float32(1)
    s = np.float32(scaled_max / a)  # one float32 division (double rounding is innocuous)
    if s == np.inf:
        s = _F32_MAX
    return _pow2_floor_f32(s) if pow2 else s


@jit_serial
def _scale_multipliers(amax, scaled_max, epsilon, pow2, out):
    for i in range(amax.size):
        out[i] = scale_multiplier(amax[i], scaled_max, epsilon, pow2)


def scaled_format_max(fmt: FloatFormat | str, margin: float = 0) -> np.float32:
    """``float32(float32(fmt.max) * float32(2**-margin))``: the value an amax is mapped to
    (Transformer Engine's order: the scaled max first, then the division by the amax)."""
    margin = check_margin(margin, "scale_from_amax")
    return np.float32(np.float32(get_format(fmt).max) * np.float32(2.0 ** (-margin)))


def check_margin(margin: float, where: str = "margin") -> float:
    """``margin`` as a float if it is a usable scale headroom in binades (finite, |margin| <=
    126: the scale stays a normal float32 factor), else ValueError ``"<where>: ..."``."""
    margin = float(margin)
    if not math.isfinite(margin) or abs(margin) > 126:
        raise ValueError(f"{where}: margin must be finite with |margin| <= 126, got {margin}")
    return margin


def scale_from_amax(
    amax: Any,
    fmt: FloatFormat | str,
    *,
    margin: float = 0,
    pow2: bool = False,
    epsilon: float = 0.0,
) -> np.ndarray:
    """The multiplier that maps ``amax`` to ``fmt.max / 2**margin``, in float32, elementwise.

    ``a = epsilon if amax < epsilon else amax``; ``s = float32(float32(fmt.max * 2**-margin) /
    a)`` (Transformer Engine's order: the scaled max first; for a whole margin the same as
    dividing the scale by ``2**margin`` afterwards); ``s = float32 max`` if ``s`` is inf;
    ``pow2``: ``s`` rounded down to a power of two (the mantissa bits dropped; an ``s`` that
    underflowed to 0, a huge amax under a margin near 126, stays 0). amax 0, +inf or NaN (after
    the epsilon clamp) gives ``s = 1``. Negative amax is an error.
    Returns a float32 array of ``amax``'s shape (0-d for a scalar). The rule itself is
    :func:`scale_multiplier` (numba), which the analysis kernels call too.
    """
    fmt = get_format(fmt)
    a = np.array(amax, dtype=np.float32)
    if np.any(a < 0):
        raise ValueError("scale_from_amax: amax must be >= 0 (it is a maximum of |x|)")
    scaled_max = scaled_format_max(fmt, margin)
    epsilon = float(epsilon)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"scale_from_amax: epsilon must be finite and >= 0, got {epsilon}")
    out = np.empty(a.shape, np.float32)
    _scale_multipliers(a.reshape(-1), scaled_max, np.float32(epsilon), bool(pow2), out.reshape(-1))
    return out


def mx_shared_scale(amax: Any, fmt: FloatFormat | str, rule: str = "floor") -> np.ndarray:
    """The MX shared scale ``X = 2**e`` (float32, the block's ``scale_inv``) for block amaxes.

    ``floor``: ``e = floor(log2(amax)) - fmt.emax`` (OCP MX v1.0: the largest power of two
    <= amax divided by the largest power of two of the element format).
    ``rceil``: ``e = ceil(log2(d))`` with ``d = float32(amax * float32(1 / fmt.max))``.
    ``e`` is clamped to ``[-127, 127]``; amax 0 gives ``2**-127``; NaN or inf amax gives NaN.
    Elements are then cast as ``x / X`` (``x * 2**-e``, exact in float32's normal range).
    """
    fmt = get_format(fmt)
    if rule not in MX_RULES:
        raise ValueError(f"unknown MX scale rule {rule!r}; valid: {', '.join(MX_RULES)}")
    a = np.array(amax, dtype=np.float32)
    finite = np.isfinite(a)
    pos = finite & (a > 0)
    safe = np.where(pos, a, np.float32(1))
    if rule == "floor":
        _, ex = np.frexp(safe)  # safe = f * 2**ex, 0.5 <= f < 1 -> floor(log2) = ex - 1
        e = ex.astype(np.int64) - 1 - fmt.emax
    else:
        d = (safe * np.float32(1.0 / fmt.max)).astype(np.float32)
        pos = pos & (d > 0)
        d = np.where(d > 0, d, np.float32(1))
        f, ex = np.frexp(d)
        e = np.where(f == 0.5, ex - 1, ex).astype(np.int64)  # exact power of two: no round-up
    e = np.where(pos, e, _E8M0_EMIN)
    e = np.clip(e, _E8M0_EMIN, _E8M0_EMAX)
    x = np.ldexp(np.float32(1), e).astype(np.float32)
    return np.where(finite, x, np.float32(np.nan)).astype(np.float32)


def block_multiplier(gran: Granularity, amax: float, fmt: FloatFormat | str) -> np.float32:
    """The multiplier of one ``mx`` or ``nvfp4`` block whose amax is ``amax`` -- for NVFP4 the
    block holding the tensor amax (its block amax is the tensor amax):

    * ``mx``: ``1 / X`` with ``X`` = :func:`mx_shared_scale` (NaN for a NaN or inf amax);
    * ``nvfp4``: :func:`fp8sim.nvfp4.cast_multiplier` of its E4M3 scale; compressed-tensors
      divides by ``b / G``, so its value is ``float32(1 / float32(b / G))``. ``fmt`` is ignored
      (NVFP4 elements are E2M1). NaN where the variant's rule gives NaN (torchao, amax 0).
    """
    a = np.float32(amax)
    if gran.kind == "mx":
        return np.float32(np.float32(1) / mx_shared_scale(a, fmt, gran.mx_rule))
    if gran.kind != "nvfp4":
        raise ValueError(f"block_multiplier: for mx and nvfp4 granularities, not {gran.spec}")
    _, b = block_scales(a, a, gran.variant)
    if gran.variant != "compressed-tensors":
        return np.float32(cast_multiplier(b, a, gran.variant))
    d = block_decode_scale(b, tensor_scale_for(a, gran.variant), gran.variant)  # b / G
    with np.errstate(divide="ignore"):
        return np.float32(np.float32(1) / d)


def e8m0_codes(scale_inv: Any) -> np.ndarray:
    """E8M0 codes (uint8, ``e + 127``; NaN -> 0xFF) of powers of two in ``[2**-127, 2**127]``."""
    s = np.asarray(scale_inv, dtype=np.float32)
    nan = np.isnan(s)
    f, ex = np.frexp(np.where(nan, np.float32(1), s))
    if np.any((f != 0.5) & ~nan):
        raise ValueError("e8m0_codes: scales must be positive powers of two (or NaN)")
    code = ex.astype(np.int64) - 1 + 127
    if np.any(((code < 0) | (code > 254)) & ~nan):
        raise ValueError("e8m0_codes: scales must lie in [2**-127, 2**127]")
    return np.where(nan, 255, code).astype(np.uint8)


# -- scaled tensors ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaledTensor:
    """A tensor cast to ``fmt`` with per-group scales: ``value = decode(code) * scale_inv``.

    Attributes:
        codes: ``fmt.code_dtype`` array of the original ``shape``.
        scale_inv: float32 array, one entry per group (shapes: module table; 0-d for tensor).
        fmt: the element format.
        granularity: canonical granularity spec (``Granularity.spec``), e.g. ``"block:1x128"``.
        shape: the original shape.
        amax: the amax per group the scales came from (float32, NaN ignored except for MX),
            None when the caller gave the scale.
        nan_count: number of NaN inputs.
        tensor_scale: NVFP4 only: the per-tensor float32 the variant stores
            (:func:`fp8sim.nvfp4.tensor_scale_for`); ``scale_inv`` then holds the decoded E4M3
            block scales and ``value = decode(code) * block_decode_scale(scale_inv,
            tensor_scale)``. None for every other granularity.
        global_amax: NVFP4 only: the tensor amax the tensor scale came from.
    """

    codes: np.ndarray
    scale_inv: np.ndarray
    fmt: FloatFormat
    granularity: str
    shape: tuple[int, ...]
    amax: np.ndarray | None = None
    nan_count: int = 0
    tensor_scale: np.float32 | None = None
    global_amax: np.float32 | None = None

    def dequantize(self, dtype: Any = np.float32) -> np.ndarray:
        """See :func:`dequantize`."""
        return dequantize(self, dtype)

    @property
    def scale_inv_codes(self) -> np.ndarray:
        """The scale codes (uint8): E8M0 for MX (0xFF for a NaN block), E4M3 for NVFP4 (0x7F)."""
        kind = parse_granularity(self.granularity).kind
        if kind == "nvfp4":
            return encode(self.scale_inv, "e4m3")  # exact: the values are E4M3's
        if kind != "mx":
            raise ValueError(
                f"scale_inv_codes: only MX and NVFP4 tensors have coded scales, not {self.granularity}"
            )
        return e8m0_codes(self.scale_inv)


def _expand(grid: np.ndarray, gran: Granularity, m: int, n: int) -> np.ndarray:
    """Per-group values spread to the 2-D view ``(m, n)`` (a scalar for tensor granularity)."""
    if gran.kind == "tensor":
        return np.asarray(grid, np.float32).reshape(())
    r, c = gran.tile(m, n)
    g = np.asarray(grid).reshape(gran.grid2d(m, n))
    return np.repeat(np.repeat(g, r, axis=0)[:m], c, axis=1)[:, :n]


def _given_scale(scale: Any, gran: Granularity, grid: tuple[int, ...]) -> np.ndarray:
    s = np.asarray(scale, dtype=np.float32)
    try:
        s = np.broadcast_to(s, grid).astype(np.float32)
    except ValueError:
        raise ValueError(
            f"quantize_scaled: scale of shape {np.shape(scale)} does not broadcast to the "
            f"{gran.spec} scale shape {grid}"
        ) from None
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError("quantize_scaled: scale must be finite and > 0")
    if gran.kind == "mx":
        e8m0_codes(np.float32(1) / s)  # raises unless 1/scale is an E8M0 value
    return s


def quantize_scaled(
    x: Any,
    fmt: FloatFormat | str,
    granularity: str | Granularity = "tensor",
    *,
    scale: Any = None,
    margin: float = 0,
    pow2: bool = False,
    epsilon: float = 0.0,
    rounding: str = "rne",
    saturate: bool = True,
    seed: int | None = None,
    srbits: int | None = None,
    global_amax: Any = None,
) -> ScaledTensor:
    """Cast ``x`` to ``fmt`` with one scale per group: ``encode(float32(float32(x) * scale))``.

    ``scale=None``: just in time from each group's amax (:func:`scale_from_amax` with
    ``margin``, ``pow2``, ``epsilon``; NaNs are counted and left out of the amax, then encode
    as the format's NaN -- a format with no NaN code (e2m1, e2m3, e3m2) outside MX raises
    ValueError, as :func:`fp8sim.encode` does, rather than invent a value). For ``mx`` granularities the E8M0 rule applies instead (``margin``,
    ``pow2`` and ``epsilon`` must stay at their defaults) and a block with a NaN or inf gets a
    NaN scale; its elements are encoded as NaN (or as 0 in formats without NaN; the block's
    NaN lives in its scale either way). A given ``scale`` (scalar or the scale shape) must be
    finite and > 0 (for MX, ``1/scale`` must be an E8M0 value).

    ``rounding``, ``saturate``, ``seed``, ``srbits`` go to :func:`fp8sim.encode` (stochastic
    counter = flat C-order index of ``x``). Returns numpy arrays even for torch inputs.

    ``nvfp4`` granularities (``fmt`` must be e2m1): the variant's two-level rules
    (:func:`fp8sim.nvfp4.quantize_nvfp4_2d`); ``global_amax`` (NVFP4 only) replaces the tensor
    amax the per-tensor scale comes from; ``scale``, ``margin``, ``pow2``, ``epsilon`` and
    ``saturate=False`` do not apply.
    """
    fmt = get_format(fmt)
    gran = parse_granularity(granularity)
    x32 = _as_float32(x)
    shape = tuple(x32.shape)
    m, n = view2d(shape)
    x2d = x32.reshape(m, n)
    if gran.kind == "nvfp4":
        if fmt.name != "e2m1" or scale is not None or margin != 0 or pow2 or epsilon != 0 or not saturate:
            raise ValueError("quantize_scaled: nvfp4 needs fmt='e2m1' and takes no scale, margin, "
                             "pow2, epsilon or saturate=False (global_amax= sets the tensor scale)")  # fmt: skip
        p = quantize_nvfp4_2d(x2d, gran.block, gran.variant, global_amax=global_amax,
                              rounding=rounding, seed=seed, srbits=srbits)  # fmt: skip
        return ScaledTensor(p.codes.reshape(shape), p.block_scale, fmt, gran.spec, shape,
                            amax=p.block_amax, nan_count=p.nan_count, tensor_scale=p.tensor_scale,
                            global_amax=p.global_amax)  # fmt: skip
    if global_amax is not None:
        raise ValueError("quantize_scaled: global_amax is for nvfp4 granularities only")
    grid2d = gran.grid2d(m, n)
    is_mx = gran.kind == "mx"
    if is_mx and (margin != 0 or pow2 or epsilon != 0):
        raise ValueError(
            "quantize_scaled: margin/pow2/epsilon do not apply to mx (E8M0 scale rule)"
        )
    amax = None
    if scale is None:
        amax, nans = _tile_stats(x2d, gran)
        nan_count = int(nans.sum())
        if is_mx:
            amax = np.where(nans > 0, np.float32(np.nan), amax).astype(np.float32)
            scale_inv = mx_shared_scale(amax, fmt, gran.mx_rule)
            mult = np.float32(1) / scale_inv  # exact: powers of two in [2**-127, 2**127]
        else:
            mult = scale_from_amax(amax, fmt, margin=margin, pow2=pow2, epsilon=epsilon)
            with np.errstate(divide="ignore", over="ignore"):  # a scale 0 (or tiny): inf
                scale_inv = (np.float32(1) / mult).astype(np.float32)
    else:
        nan_count = int(np.isnan(x2d).sum())
        mult = _given_scale(scale, gran, grid2d)
        scale_inv = (np.float32(1) / mult).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        y = (x2d * _expand(mult, gran, m, n)).astype(np.float32)
    if is_mx and np.isnan(scale_inv).any():
        bad = _expand(np.isnan(scale_inv), gran, m, n)
        y = np.where(bad, np.float32(np.nan if fmt.has_nan else 0.0), y)
    codes = encode(
        y.reshape(shape), fmt, rounding=rounding, saturate=saturate, seed=seed, srbits=srbits
    )
    return ScaledTensor(
        codes=codes,
        scale_inv=_grid_out(np.asarray(scale_inv, np.float32).reshape(grid2d), gran),
        fmt=fmt,
        granularity=gran.spec,
        shape=shape,
        amax=None if amax is None else _grid_out(amax, gran),
        nan_count=nan_count,
    )


def dequantize(st: ScaledTensor, dtype: Any = np.float32) -> np.ndarray:
    """``decode(codes) * scale_inv`` per element: exact in float64, rounded once for float32.

    Other dtypes (float16, bfloat16) are cast from the float32 result, as a GPU kernel that
    computes in float32 does. NVFP4: ``float32(e2m1 * factor)`` with the variant's per-block
    factor (:func:`fp8sim.nvfp4.block_decode_scale`), for every dtype (float64 widens it). NaN scales (MX) make their whole block NaN; an infinite
    scale_inv (a scale that underflowed to 0) makes its zeros NaN (0 x inf) and the rest inf.
    """
    dtype = np.dtype(dtype)
    gran = parse_granularity(st.granularity)
    m, n = view2d(st.shape)
    if gran.kind == "nvfp4":  # float32 arithmetic as the variant's library does it
        out32 = dequantize_nvfp4_2d(st.codes.reshape(m, n), st.scale_inv, st.tensor_scale,
                                    gran.block, gran.variant).reshape(st.shape)  # fmt: skip
        return out32 if dtype == np.float32 else out32.astype(dtype)
    values = decode(st.codes, st.fmt, dtype=np.float64).reshape(m, n)
    with np.errstate(invalid="ignore"):  # 0 x inf
        out = values * _expand(np.asarray(st.scale_inv, np.float64), gran, m, n)
    out = out.reshape(st.shape)
    if dtype == np.float64:
        return out
    with np.errstate(over="ignore"):
        out32 = out.astype(np.float32)
    return out32 if dtype == np.float32 else out32.astype(dtype)
