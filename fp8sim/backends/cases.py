"""Edge-case inputs for checking a backend or kernel against the emulator.

Shared by the tests and by the one-shot GPU check (``benchmarks/gpu_check.py``), so both probe
the same values: signed zeros, the format's subnormals and normals, every tie between two
neighbouring codes, max and the values just above it (the round-then-compare boundary), inf,
NaN, float32 subnormals and huge values, plus random values over the whole range.
"""

from __future__ import annotations

import numpy as np

from fp8sim.emulator import decode_table
from fp8sim.formats import FloatFormat, get_format

__all__ = ["edge_values", "random_values"]


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
