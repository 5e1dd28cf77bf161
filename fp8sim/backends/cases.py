"""Edge-case inputs for checking a backend or kernel against the emulator.

Shared by the tests and by the one-shot GPU check (``benchmarks/gpu_check.py``), so both probe
the same values: signed zeros, the format's subnormals and normals, every tie between two
neighbouring codes, max and the values just above it (the round-then-compare boundary), inf,
NaN, float32 subnormals and huge values, plus random values over the whole range; for NVFP4,
tiles whose elements land on the E2M1 rounding boundaries after the block scale.
"""

from __future__ import annotations

import numpy as np

from fp8sim.emulator import decode_table
from fp8sim.formats import FloatFormat, get_format
from fp8sim.nvfp4 import NVFP4_LAYOUTS, block_scales, cast_multiplier, check_variant, tensor_scale_for

__all__ = ["edge_values", "random_values", "nvfp4_boundary_tiles"]


def edge_values(fmt: FloatFormat | str, max_codes: int = 256) -> np.ndarray:
    """float32 edge cases for ``fmt`` with both signs (1-D, unique bit patterns, NaNs kept).

    Formats with more than ``2 * max_codes`` magnitudes contribute about ``2 * max_codes`` of
    them (both ends of the range and an even sample between).
    """
    fmt = get_format(fmt)
    table = decode_table(fmt, np.float64)
    mags = np.unique(np.abs(table[np.isfinite(table)]))  # sorted representable magnitudes
    top = mags[-1]
    step_above = top - mags[-2]
    mids = (mags[:-1] + mags[1:]) / 2  # ties (exact in float64; rounded to float32 below)
    if mags.size > 2 * max_codes:  # 16-bit formats: both ends of the range and a sparse middle
        stride = mags.size // max_codes
        keep = np.zeros(mags.size, dtype=bool)
        keep[: max_codes // 2] = keep[-max_codes // 2 :] = keep[::stride] = True
        mags, mids = mags[keep], mids[keep[:-1]]
    special = [
        0.0,
        top,
        top + step_above / 2,  # tie between max and the first value past it
        top + step_above / 4,
        top + step_above * 3 / 4,
        top + step_above,
        2 * top,
        np.inf,
        np.nan,
        1.0,
        fmt.min_subnormal / 2,  # tie with zero
        fmt.min_subnormal / 4,
        fmt.min_subnormal * 3 / 4,
        fmt.min_normal,
        2.0**-126,  # smallest float32 normal
        2.0**-149,  # smallest float32 subnormal
        3 * 2.0**-140,
        3.0e38,
    ]
    with np.errstate(over="ignore"):  # bf16 has values past float32 max: they become inf
        vals = np.concatenate([mags, mids, special]).astype(np.float32)
    # the float32 neighbours of every code and tie: the last bits that decide a rounding
    near = vals[np.isfinite(vals)]
    up = np.nextafter(near, np.float32(np.inf))
    down = np.nextafter(near, np.float32(0))
    allv = np.concatenate([vals, up, down])
    allv = np.concatenate([allv, -allv])
    bits = np.unique(allv.view(np.uint32))
    return bits.view(np.float32)


def random_values(n: int, seed: int = 0, spread: float = 12.0) -> np.ndarray:
    """``n`` float32 values ``normal * 2**uniform(-spread, spread)``: many binades, both signs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp2(rng.uniform(-spread, spread, n))
    return x.astype(np.float32)


def nvfp4_boundary_tiles(layout: str, variant: str = "te", grid: tuple[int, int] = (5, 6),
                         seed: int = 0) -> np.ndarray:
    """float32 ``(grid[0] * R, grid[1] * C)`` of NVFP4 tiles (``layout`` ``R x C``) whose
    elements sit on and 1-3 float32 ulps around the E2M1 rounding boundaries (0.25, 0.75, 1.25,
    1.75, 2.5, 3.5, 5; both signs) after the ``variant``'s element cast: ``t / r`` for the
    tile's multiplier ``r`` (compressed-tensors: ``t * (b / G)``), from :mod:`fp8sim.nvfp4`'s
    rules. Tile amaxes span 2**-30 .. 2**31. A multiplier or divisor off by one ulp, or a
    differently rounded product, changes codes here, where random data almost never lands."""
    variant = check_variant(variant)
    rng = np.random.default_rng(seed)
    tr, tc = NVFP4_LAYOUTS[layout]
    amax = (rng.uniform(1, 2, grid) * np.exp2(rng.integers(-30, 30, grid))).astype(np.float32)
    ga = amax.max()
    _, b = block_scales(amax, ga, variant)
    with np.errstate(divide="ignore", over="ignore"):
        if variant == "compressed-tensors":
            step = 1.0 / (b / tensor_scale_for(ga, variant)).astype(np.float32).astype(np.float64)
        else:
            step = cast_multiplier(b, ga, variant).astype(np.float64)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = np.zeros((grid[0] * tr, grid[1] * tc), np.float32)
    for (i, j), a in np.ndenumerate(amax):
        near = [np.float32(ties[(i * grid[1] + j) % ties.size] / step[i, j])]
        for _ in range(3):
            near = [np.nextafter(near[0], np.float32(0)), *near,
                    np.nextafter(near[-1], np.float32(np.inf))]
        vals = np.array([a, *near, *(-np.array(near))] + [0.0] * (tr * tc - 15), np.float32)
        x[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc] = rng.permutation(vals[: tr * tc]).reshape(tr, tc)
    return x
