"""``assert_scaled_bitexact``: a user's scaled cast (codes and scale_inv) against
``fp8sim.scaling.quantize_scaled``, the scale rule included. Runs as
:func:`fp8sim.testing.assert_bitexact` does: fixed cases, then hypothesis draws."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fp8sim.backends.cases import edge_values, random_values
from fp8sim.formats import FloatFormat, get_format
from fp8sim.scaling import (
    Granularity,
    mx_shared_scale,
    parse_granularity,
    quantize_scaled,
    scale_from_amax,
    view2d,
)
from fp8sim.testing import _report as rep
from fp8sim.testing.assertions import (
    as_numpy,
    bad_codes,
    call_repr,
    check_hypothesis,
    check_search_args,
    code_rows,
    search_draws,
    received_codes,
    to_input,
)
from fp8sim.testing.strategies import as_dtype, arrays, tie_values

__all__ = ["assert_scaled_bitexact"]


def _case_shape(gran: Granularity) -> tuple[int, int]:
    """A 2-D shape whose last tiles are ragged: 2 tiles less one element along each axis."""
    if gran.kind in ("tensor", "row", "col"):
        return 5, 37
    r, c = gran.block
    return (2 * r - 1 if r > 1 else 3), (2 * c - 1 if c > 1 else 5)


def _scaled_cases(fmt: FloatFormat, gran: Granularity, skw: dict
                  ) -> list[tuple[str, np.ndarray]]:
    """Named float64 inputs: random, the format's boundaries at scale 1, its ties through a
    scale that is not a power of two, zeros, tiny values, and random values with inf, NaN,
    float32 max and subnormals among them (``skw``: margin, pow2, epsilon)."""
    m, n = _case_shape(gran)
    rnd = random_values(m * n, seed=1).astype(np.float64).reshape(m, n)
    # every boundary value of the format, with each tile's first element +-max: amax = max,
    # so the scale is 1 (times 2**-margin) and the ties reach the cast unchanged
    ev = edge_values(fmt).astype(np.float64)
    ev = ev[np.abs(ev) <= fmt.max]
    bnd = np.resize(ev, m * n).reshape(m, n)
    r, c = gran.tile(m, n)
    bnd[::r, ::c] = np.where(np.arange(bnd[::r, ::c].size).reshape(bnd[::r, ::c].shape) % 2,
                             -fmt.max, fmt.max)
    # ties of the format divided by a scale that is not a power of two, and the float32
    # neighbours: float32(x * scale) lands on or next to the tie -- a product kept in float64
    # (or fused into the cast) rounds these differently
    anchor = np.float64(np.float32(3.0))
    s = np.float32(1) / mx_shared_scale(anchor, fmt, gran.mx_rule) if gran.kind == "mx" else \
        scale_from_amax(anchor, fmt, **skw)
    t = tie_values(fmt)
    t = t[np.abs(t) < fmt.max].astype(np.float32) / np.float32(s)
    near = np.concatenate([t, np.nextafter(t, np.float32(0)), np.nextafter(t, t * 2)])
    near = near[np.isfinite(near) & (np.abs(near) < anchor)].astype(np.float64)
    scaled_ties = np.resize(near, m * n).reshape(m, n)
    scaled_ties[::r, ::c] = anchor
    special = rnd.copy().reshape(-1)
    picks = np.random.default_rng(2).choice(special.size, 8, replace=False)
    special[picks] = [np.inf, -np.inf, np.nan, 3.4e38, -1e-45, 1e-40, 0.0, -0.0]
    return [
        ("random values over many binades", rnd),
        (f"the boundary values of {fmt.name}, every tile holding +-max (scale 1)", bnd),
        ("the format's ties divided by the scale of amax 3, and their float32 neighbours",
         scaled_ties),
        ("all zeros", np.zeros((m, n))),
        ("tiny values (float32 subnormals; the scale clamps to float32 max)", rnd * 2.0**-140),
        ("random values with inf, NaN, float32 max and subnormals", special.reshape(m, n)),
    ]


def _sanitize(x: np.ndarray, fmt: FloatFormat, gran: Granularity, saturate: bool) -> np.ndarray:
    """Formats with no NaN outside MX blocks: NaN (and inf unless saturating) -> 0, the inputs
    ``quantize_scaled`` refuses for them."""
    if fmt.has_nan or gran.kind == "mx":
        return x
    bad = np.isnan(x) if saturate else ~np.isfinite(x)
    return np.where(bad, 0, x).astype(x.dtype) if bad.any() else x


def _received_scale(s: Any, fmt: FloatFormat, gran: Granularity, grid: tuple, what: str
                    ) -> np.ndarray:
    """scale_inv as float32 of the grid's size (any shape of that size; MX scales may come as
    E8M0 codes, uint8)."""
    arr = as_numpy(s)
    if gran.kind == "mx" and arr.dtype == np.uint8:
        arr = np.where(arr == 255, np.nan, np.ldexp(1.0, arr.astype(np.int64) - 127))
    if arr.dtype.kind != "f":
        raise TypeError(f"{what} must return scale_inv as floats (MX: floats or E8M0 codes), "
                        f"got {arr.dtype}")
    size = int(np.prod(grid))
    if arr.size != size:
        raise AssertionError(f"{what} returned scale_inv of shape {arr.shape}; the "
                             f"{gran.spec} scale shape is {grid} ({size} values)")
    return np.asarray(arr, np.float32).reshape(grid)


def _per_element(grid: np.ndarray, gran: Granularity, m: int, n: int) -> np.ndarray:
    r, c = gran.tile(m, n)
    g = np.asarray(grid).reshape(gran.grid2d(m, n))
    return np.repeat(np.repeat(g, r, axis=0)[:m], c, axis=1)[:, :n]


def assert_scaled_bitexact(
    fn: Callable[[Any], tuple[Any, Any]],
    fmt: FloatFormat | str,
    granularity: str | Granularity = "tensor",
    *,
    margin: float = 0,
    pow2: bool = False,
    epsilon: float = 0.0,
    rounding: str = "rne",
    saturate: bool = True,
    seed: int | None = None,
    srbits: int | None = None,
    dtype: Any = np.float32,
    device: str | None = None,
    inputs: Any = None,
    shape: Any = None,
    max_examples: int = 50,
    hypothesis_seed: int | None = 0,
    exact_nan: bool = False,
    max_report: int = 8,
    msg: str | Callable[[str], str] | None = None,
) -> None:
    """Assert that ``fn(x) -> (codes, scale_inv)`` equals
    ``fp8sim.scaling.quantize_scaled(x, fmt, granularity, margin=..., pow2=..., epsilon=...,
    rounding=..., saturate=...)`` bit for bit: the scale rule (just-in-time from each group's
    amax; the E8M0 ``floor``/``rceil`` rule for ``mx``/``mx:rceil``) and every code.

    ``granularity``: ``tensor``, ``row``, ``col``, ``block:RxC``, ``mx``, ``mx:rceil``.
    ``fn`` gets ``x`` as in :func:`assert_bitexact` (``dtype``, ``device``) and returns codes
    of x's shape and ``scale_inv`` (the dequantization factor, ``1 / scale``): float32 values,
    any shape holding the scale grid's values in C order (``(M, 1)``, ``(M,)`` for row; the
    shapes are in :mod:`fp8sim.scaling`), or for MX the E8M0 codes as uint8. scale_inv is
    compared bit for bit (any NaN matches NaN).

    Inputs: 2-D arrays with ragged last tiles -- random values over many binades; every
    boundary value of the format with each tile holding +-max (scale 1, so ties reach the
    cast); the ties divided by the scale of amax 3 and their float32 neighbours (a product
    not rounded to float32 before the cast shows there); zeros; float32 subnormals; random
    values with +-inf, NaN, float32 max -- after ``inputs`` if given; then ``max_examples``
    draws of :func:`fp8sim.testing.arrays` of ``shape`` (a tuple or a hypothesis strategy of
    tuples; default 1-3 dimensions of 1-40 -- give 2-D shapes for a 2-D-only kernel).
    Formats with no NaN (e2m1, e2m3, e3m2) outside MX get 0 for NaN (and for inf unless
    saturating), which ``quantize_scaled`` refuses for them.

    On a mismatch: AssertionError with the case, the shape, then the scale_inv mismatches
    (group, amax, expected, received) and the code mismatches (index, input, the float32
    product ``x * scale`` the reference casts, expected and received code). ``msg`` as in
    :func:`assert_bitexact`. A bad argument (``max_examples=-1``, ``pow2="no"``) raises
    :class:`~fp8sim.errors.ArgumentError` naming it.
    """
    from fp8sim.errors import expect_bool

    check_search_args(max_examples, hypothesis_seed, max_report, exact_nan)
    expect_bool(pow2, "pow2")
    fmt = get_format(fmt)
    gran = parse_granularity(granularity)
    kw = dict(rounding=rounding, saturate=saturate, seed=seed, srbits=srbits)
    skw = dict(margin=margin, pow2=pow2, epsilon=epsilon) if gran.kind != "mx" else {}
    call = call_repr("fp8sim.scaling.quantize_scaled", fmt, {**skw, **kw},
                      f", {gran.spec!r}")
    dtype = np.dtype(as_dtype(np.zeros(0), dtype).dtype)
    name = getattr(fn, "__name__", "fn")

    def check(x: np.ndarray, where: str, raise_: bool = True) -> bool:
        x = _sanitize(x, fmt, gran, saturate)
        exp = quantize_scaled(x, fmt, gran, **skw, **kw)
        out = fn(to_input(x, device))
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"{name} must return (codes, scale_inv), got {type(out).__name__}")
        grid = np.shape(exp.scale_inv)
        got_s = _received_scale(out[1], fmt, gran, grid, name)
        got_c = received_codes(out[0], fmt, x.shape, name)
        exp_s = np.asarray(exp.scale_inv, np.float32)
        bad_s = (exp_s.view(np.uint32) != got_s.view(np.uint32)) & ~(
            np.isnan(exp_s) & np.isnan(got_s))
        bad_c = bad_codes(exp.codes, got_c, fmt, exact_nan)
        if not (bad_s.any() or bad_c.any()):
            return False
        if not raise_:
            return True
        parts = [f"{name} is not bit-exact to {call}\non {where}, {x.dtype.name} shape "
                 f"{x.shape}."]
        if bad_s.any():
            rows = []
            amax = exp.amax if exp.amax is not None else np.full(grid, np.nan, np.float32)
            for g in np.flatnonzero(bad_s)[:max_report]:
                at = np.unravel_index(g, grid) if grid else ()
                rows.append([str(tuple(int(i) for i in at)),
                             rep.describe_float(np.float32(np.asarray(amax)[at])),
                             rep.describe_float(exp_s[at]), rep.describe_float(got_s[at])])
            k = int(bad_s.sum())
            parts.append(f"Mismatched scale_inv: {k} of {bad_s.size} groups:\n" + rep.table(
                ["group", "amax (NaN ignored)", "expected scale_inv", "received"], rows))
        if bad_c.any():
            m, n = view2d(x.shape)
            if gran.kind == "mx":
                mult = np.float32(1) / exp_s
            else:
                mult = scale_from_amax(exp.amax, fmt, **skw)
            mult = np.broadcast_to(_per_element(mult, gran, m, n), (m, n))
            with np.errstate(all="ignore"):
                prod = (np.asarray(x, np.float32).reshape(m, n) * mult).astype(np.float32)
            parts.append(code_rows(x, exp.codes, got_c, bad_c, fmt, max_report,
                                    prod.reshape(x.shape)))
        raise AssertionError(rep.with_msg("\n".join(parts), msg))

    cases = _scaled_cases(fmt, gran, skw)
    if inputs is not None:
        cases = [("your inputs", np.asarray(a)) for a in (
            inputs if isinstance(inputs, (list, tuple)) else [inputs])] + cases
    for where, x in cases:
        check(as_dtype(np.asarray(x, np.float64), dtype), f"fixed case '{where}'")
    if max_examples > 0:
        check_hypothesis()
        strategy = arrays(fmt, shape, dtype=dtype).map(
            lambda a: _sanitize(a, fmt, gran, saturate))
        search_draws(strategy, check, max_examples, hypothesis_seed, name,
                     "an array drawn by hypothesis")
