"""The scale rules of :mod:`fp8sim.scaling` on torch tensors of any device, bit for bit.

Twins of :func:`fp8sim.scaling.scale_from_amax` and :func:`fp8sim.scaling.mx_shared_scale`
(the numba/numpy rules stay the reference; ``tests/test_scaling_torch.py`` holds the twins to
them on every edge: 0, subnormal and huge amaxes, inf, NaN, epsilon, margin, pow2) and the
per-group cast they serve, :func:`block_quantize_torch`, with which a backend casts blocks on the
tensor's device (no host round trip): the codes, scales and amaxes of
:func:`fp8sim.scaling.quantize_scaled` for row, ``block:RxC`` and MX granularities.

Float32 arithmetic on the GPU is IEEE here (torch builds its kernels without fast math: division
and multiplication are correctly rounded), so one rule gives one answer on CPU and CUDA.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from fp8sim.formats import FloatFormat, get_format
from fp8sim.granularity import Granularity, view2d

__all__ = ["scale_from_amax_torch", "mx_shared_scale_torch", "block_quantize_torch", "torchao_scale"]

_F32_MAX = float(np.finfo(np.float32).max)


def _pow2_floor(s: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= s for finite float32 s >= 0 (subnormals included; 0 stays 0)."""
    bits = s.view(torch.int32)
    normal = (bits & 0x7F800000).view(torch.float32)
    m, e = torch.frexp(s.double())  # exact for float32 values
    sub = torch.ldexp(torch.ones_like(m), e - 1).to(torch.float32)
    return torch.where(bits >= 0x00800000, normal, torch.where(s == 0, s, sub))


def scale_from_amax_torch(amax: torch.Tensor, fmt: FloatFormat | str, *, margin: float = 0, pow2: bool = False,
                          epsilon: float = 0.0) -> torch.Tensor:
    """:func:`fp8sim.scaling.scale_from_amax` on a float32 tensor of amaxes (same device out):
    ``a = epsilon if amax < epsilon else amax``; ``s = float32(scaled_max / a)``; inf -> float32
    max; ``pow2`` rounds down to a power of two; amax 0, inf or NaN gives 1."""
    from fp8sim.scaling import scaled_format_max

    a = amax.to(torch.float32)
    scaled_max = float(scaled_format_max(get_format(fmt), margin))
    eps = torch.tensor(np.float32(epsilon), device=a.device)
    a = torch.where(a < eps, eps, a)
    bad = ~(a < float("inf")) | (a == 0)
    s = torch.tensor(np.float32(scaled_max), device=a.device) / torch.where(bad, torch.ones_like(a), a)
    s = torch.where(torch.isinf(s), torch.full_like(s, _F32_MAX), s)
    if pow2:
        s = _pow2_floor(s)
    return torch.where(bad, torch.ones_like(s), s)


def mx_shared_scale_torch(amax: torch.Tensor, fmt: FloatFormat | str, rule: str = "floor") -> torch.Tensor:
    """:func:`fp8sim.scaling.mx_shared_scale` on a float32 tensor of block amaxes: ``X = 2**e``
    (``floor``: ``floor(log2(amax)) - emax``; ``rceil``: ``ceil(log2(float32(amax * float32(1 /
    fmax))))``), ``e`` clamped to [-127, 127], amax 0 -> ``2**-127``, NaN or inf -> NaN."""
    fmt = get_format(fmt)
    a = amax.to(torch.float32)
    finite = torch.isfinite(a)
    pos = finite & (a > 0)
    safe = torch.where(pos, a, torch.ones_like(a))
    if str(rule) == "floor":
        _, ex = torch.frexp(safe)
        e = ex.to(torch.int64) - 1 - fmt.emax
    else:
        d = safe * torch.tensor(np.float32(1.0 / fmt.max), device=a.device)
        pos = pos & (d > 0)
        f, ex = torch.frexp(torch.where(d > 0, d, torch.ones_like(d)))
        e = torch.where(f == 0.5, ex - 1, ex).to(torch.int64)
    e = torch.where(pos, e, torch.full_like(e, -127)).clamp(-127, 127)
    x = torch.ldexp(torch.ones_like(a, dtype=torch.float64), e).to(torch.float32)  # 2**-127 is exact in float64
    return torch.where(finite, x, torch.full_like(x, float("nan")))


def torchao_scale(amax: torch.Tensor, fmt: FloatFormat | str, *, pow2: bool = False) -> torch.Tensor:
    """torchao.float8's ``amax_to_scale`` (0.18, float8_utils.py): ``float32(fmax / clamp(
    float64(amax), min=1e-12))``, then with ``pow2`` its ``_round_scale_down_to_power_of_2``,
    ``exp2(floor(log2(scale)))`` on the float32 scale -- torch's own ops, as torchao calls them,
    so the result is torchao's on the same device (``log2`` rounds a scale a few ulps below
    ``2**k`` to ``k``: the scale goes up to ``2**k``). amax inf gives 0, NaN gives NaN."""
    fmax = get_format(fmt).max
    scale = (fmax / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def block_quantize_torch(x: torch.Tensor, fmt: FloatFormat, gran: Granularity, cast: Callable[[torch.Tensor], Any], *,
                         margin: float = 0, pow2: bool = False, epsilon: float = 0.0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale_inv, amax) of ``quantize_scaled(x, fmt, gran, ...)`` for row, ``block:RxC``
    and MX granularities, computed with torch ops on ``x``'s device; ``cast(y)`` encodes the
    scaled float32 values (the backend's own cast: rounding and overflow rule are its).

    Per tile (ragged edges cut): the amax over the non-NaN elements (MX: NaN if the block holds
    a NaN), the scale by the rule, ``y = float32(x * scale)``; MX blocks with a NaN scale encode
    their elements as NaN (0 in a format without NaN)."""
    m, n = view2d(tuple(x.shape))
    x2 = x.detach().to(torch.float32).reshape(m, n)
    gm, gn = gran.grid2d(m, n)
    r, c = gran.tile(m, n)
    r, c = min(r, max(m, 1)), min(c, max(n, 1))
    isnan = torch.isnan(x2)
    padded = torch.zeros((gm * r, gn * c), dtype=torch.float32, device=x.device)
    padded[:m, :n] = torch.where(isnan, torch.zeros_like(x2), x2.abs())  # zeros never raise an amax
    amax = padded.view(gm, r, gn, c).amax(dim=(1, 3))  # (gm, gn)
    if gran.kind == "mx":
        nans = torch.zeros((gm * r, gn * c), dtype=torch.bool, device=x.device)
        nans[:m, :n] = isnan
        amax = torch.where(nans.view(gm, r, gn, c).any(dim=3).any(dim=1), torch.full_like(amax, float("nan")), amax)
        scale_inv = mx_shared_scale_torch(amax, fmt, gran.mx_rule)
        mult = torch.reciprocal(scale_inv)  # exact: powers of two in [2**-127, 2**127]
    else:
        mult = scale_from_amax_torch(amax, fmt, margin=margin, pow2=pow2, epsilon=epsilon)
        scale_inv = torch.reciprocal(mult)  # float32; a scale 0 gives inf, as quantize_scaled
    full = mult.repeat_interleave(r, 0)[:m].repeat_interleave(c, 1)[:, :n]
    y = x2 * full
    if gran.kind == "mx":
        bad = torch.isnan(scale_inv).repeat_interleave(r, 0)[:m].repeat_interleave(c, 1)[:, :n]
        y = torch.where(bad, torch.full_like(y, float("nan") if fmt.has_nan else 0.0), y)
    codes = cast(y)
    grid = scale_inv if gran.kind != "tensor" else scale_inv.reshape(())
    return codes.reshape(x.shape), grid, amax
