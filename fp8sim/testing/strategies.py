"""Values at and around every boundary of a format, as numpy arrays and hypothesis strategies.

The numpy functions (``*_values``) need nothing beyond numpy; the strategies need hypothesis, a
dependency of fp8sim: it is imported when a strategy is built, never by ``import fp8sim`` or
``import fp8sim.testing``, and a strategy built where it was uninstalled raises ImportError
saying so.

Every value is a float32 (strategies draw ``numpy.float32`` scalars). "Both signs" means each
value and its negation; for the unsigned E8M0 the negative ones are invalid inputs that
``fp8sim.encode`` maps to NaN, which is worth checking too.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from fp8sim.backends.cases import edge_values
from fp8sim.emulator import decode_table
from fp8sim.formats import FloatFormat, get_format

__all__ = [
    "edge_values",
    "representable_values",
    "tie_values",
    "near_tie_values",
    "special_values",
    "codes",
    "representable",
    "ties",
    "near_ties",
    "specials",
    "boundary_values",
    "values",
    "arrays",
]

HYPOTHESIS_HINT = (
    "fp8sim.testing strategies need hypothesis, a dependency of fp8sim that is not installed "
    "here: pip install hypothesis"
)


def _hypothesis() -> Any:
    """The ``hypothesis.strategies`` module, or ImportError naming ``pip install hypothesis``."""
    try:
        from hypothesis import strategies as st
    except ImportError as exc:
        raise ImportError(HYPOTHESIS_HINT) from exc
    return st


def _per_format(build: Any) -> Any:
    """Cache ``build(fmt)`` per format (names resolved first); arrays come back read-only."""
    cached = functools.lru_cache(maxsize=None)(build)

    @functools.wraps(build)
    def per_format(fmt: FloatFormat | str) -> Any:
        out = cached(get_format(fmt))
        if isinstance(out, np.ndarray):
            out.setflags(write=False)
        return out

    return per_format


# -- value sets (numpy, float32, sorted by bit pattern) --------------------------------------


def _magnitudes(fmt: FloatFormat) -> np.ndarray:
    """Sorted finite magnitudes of ``fmt`` (float64, exact), 0 first where the format has it."""
    table = decode_table(fmt, np.float64)
    return np.unique(np.abs(table[np.isfinite(table)]))


def _step_past_max(fmt: FloatFormat, mags: np.ndarray) -> float:
    """The value one code step above max, were the exponent range one binade wider."""
    if fmt.mantissa_bits == 0:  # E8M0: the next power of two
        return float(2 * mags[-1])
    return float(mags[-1] + (mags[-1] - mags[-2]))


def _both_signs(v: np.ndarray) -> np.ndarray:
    """float32 ``v`` and ``-v``, one entry per distinct bit pattern (so +0 and -0 both)."""
    with np.errstate(over="ignore"):  # bf16's largest ties lie past float32 max: they are inf
        v = np.asarray(v, np.float64).astype(np.float32)
    both = np.concatenate([v, -v])
    return np.unique(both.view(np.uint32)).view(np.float32)


@_per_format
def representable_values(fmt: FloatFormat | str) -> np.ndarray:
    """Every finite value of ``fmt`` as float32: both signs (and -0, which FNUZ formats encode
    as +0) for signed formats, the positive ones for the unsigned E8M0."""
    fmt = get_format(fmt)
    mags = _magnitudes(fmt)
    return _both_signs(mags) if fmt.signed else mags.astype(np.float32)


@_per_format
def tie_values(fmt: FloatFormat | str) -> np.ndarray:
    """The midpoint between every two neighbouring magnitudes of ``fmt``, both signs: the
    values where round-to-nearest must break a tie. Includes the tie between 0 and the smallest
    subnormal (the underflow tie) and the tie between max and the next step past it (the
    overflow tie: under ``rne`` a value up to it rounds to max, past it overflows)."""
    fmt = get_format(fmt)
    mags = _magnitudes(fmt)
    ext = np.append(mags, _step_past_max(fmt, mags))
    mids = (ext[:-1] + ext[1:]) / 2  # exact in float64; exact in float32 for <= 16-bit formats
    return _both_signs(mids)


@_per_format
def near_tie_values(fmt: FloatFormat | str) -> np.ndarray:
    """One float32 ulp below and above every tie of :func:`tie_values`: the inputs that must
    round down and up, whatever the tie rule."""
    t = tie_values(fmt)
    t = t[np.isfinite(t)]
    return _both_signs(np.concatenate([np.nextafter(t, np.float32(0)),
                                       np.nextafter(t, np.float32(np.inf) * np.sign(t))]))


@_per_format
def special_values(fmt: FloatFormat | str) -> np.ndarray:
    """The special inputs: +-0, +-inf, NaN of both signs, max and the float32 values just
    around it, twice max, float32 max, the smallest float32 normal and subnormal, 1.0."""
    fmt = get_format(fmt)
    top = np.float32(fmt.max)
    vals = np.array(
        [0.0, 1.0, np.inf, np.nan, top, np.nextafter(top, np.float32(0)),
         np.nextafter(top, np.float32(np.inf)), 2 * float(top), np.finfo(np.float32).max,
         2.0**-126, 2.0**-149, fmt.min_normal, fmt.min_subnormal],
        dtype=np.float64,
    )
    with np.errstate(over="ignore"):
        return _both_signs(vals)


# -- hypothesis strategies -------------------------------------------------------------------


def codes(fmt: FloatFormat | str, *, finite_only: bool = False) -> Any:
    """Strategy: any code of ``fmt`` as a Python int (for decode kernels); with
    ``finite_only`` no NaN or inf code."""
    st = _hypothesis()
    fmt = get_format(fmt)
    if not finite_only:
        return st.integers(0, fmt.num_codes - 1)
    table = decode_table(fmt, np.float64)
    return st.sampled_from([int(c) for c in np.flatnonzero(np.isfinite(table))])


def _sampled(v: np.ndarray) -> Any:
    st = _hypothesis()
    return st.sampled_from(v.tolist()).map(np.float32)


@_per_format
def representable(fmt: FloatFormat | str) -> Any:
    """Strategy: a finite value of ``fmt`` (:func:`representable_values`)."""
    return _sampled(representable_values(fmt))


@_per_format
def ties(fmt: FloatFormat | str) -> Any:
    """Strategy: a tie between two neighbouring values (:func:`tie_values`)."""
    return _sampled(tie_values(fmt))


@_per_format
def near_ties(fmt: FloatFormat | str) -> Any:
    """Strategy: one float32 ulp either side of a tie (:func:`near_tie_values`)."""
    return _sampled(near_tie_values(fmt))


@_per_format
def specials(fmt: FloatFormat | str) -> Any:
    """Strategy: a special input (:func:`special_values`): zeros, inf, NaN, max's edges."""
    return _sampled(special_values(fmt))


def boundary_values(fmt: FloatFormat | str) -> Any:
    """Strategy: a float32 at or next to a code or rounding boundary of ``fmt`` -- a code,
    a tie, a tie's float32 neighbour, or a special value, each kind equally likely."""
    st = _hypothesis()
    return st.one_of(representable(fmt), ties(fmt), near_ties(fmt), specials(fmt))


def values(fmt: FloatFormat | str) -> Any:
    """Strategy: a float32 input for a cast to ``fmt``: a boundary value (half the draws), any
    float32 at all (NaN, inf, subnormals included), or a float32 within +-2 max."""
    st = _hypothesis()
    fmt = get_format(fmt)
    top = float(np.float32(min(2 * fmt.max, float(np.finfo(np.float32).max))))
    anywhere = st.floats(width=32, allow_nan=True, allow_infinity=True).map(np.float32)
    in_range = st.floats(-top, top, width=32).map(np.float32)
    return st.one_of(boundary_values(fmt), boundary_values(fmt), anywhere, in_range)


def as_dtype(x: np.ndarray, dtype: Any) -> np.ndarray:
    """float64 ``x`` rounded once to ``dtype`` (float16/32/64, or bfloat16 via ml_dtypes)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes  # the only numpy bfloat16

        dtype = ml_dtypes.bfloat16
    dtype = np.dtype(dtype)
    if dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"arrays: dtype must be a float type, got {dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype)


def arrays(
    fmt: FloatFormat | str,
    shape: Any = None,
    *,
    dtype: Any = np.float32,
    outliers: bool = True,
    max_side: int = 40,
) -> Any:
    """Strategy: a numpy array of ``dtype`` (float32, float16, float64, or ``"bfloat16"`` /
    ``ml_dtypes.bfloat16``) to cast to ``fmt``.

    ``shape``: a tuple, a strategy of tuples, or None for 1 to 3 dimensions of 1 to
    ``max_side`` each. The bulk is ``normal * 2**uniform(c - w, c + w)`` with a drawn centre
    binade ``c`` (from below the format's smallest subnormal to above its max) and width ``w``
    (0..8 binades), so some arrays sit in the subnormals, some around max, some across the
    range. With ``outliers``, up to 8 elements are then replaced by draws of :func:`values`
    (boundary values, NaN, inf, huge and tiny float32). Values are made in float64 (float32
    draws) and rounded once to ``dtype``.
    """
    st = _hypothesis()
    from hypothesis.extra import numpy as hnp

    fmt = get_format(fmt)
    if shape is None:
        shape = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=max_side)
    elif not hasattr(shape, "example"):  # a plain tuple, not a strategy
        shape = st.just(tuple(shape))
    lo = int(math.floor(math.log2(fmt.min_subnormal))) - 2
    hi = int(math.floor(math.log2(fmt.max))) + 2
    element = values(fmt)

    @st.composite
    def _draw(draw: Any) -> np.ndarray:
        shp = draw(shape)
        n = math.prod(shp)
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        centre = draw(st.integers(lo, hi))
        width = draw(st.integers(0, 8))
        x = rng.standard_normal(n) * np.exp2(centre + rng.uniform(-width, width, n))
        if outliers and n:
            k = draw(st.integers(0, min(n, 8)))
            where = draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k))
            for i in where:
                x[i] = float(draw(element))
        return as_dtype(x, dtype).reshape(shp)

    return _draw()
