"""The registry of every implementation of fp8sim's rounding, for one conformance suite
(``tests/test_rounding_conformance.py``) that sweeps them all against the scalar reference.

Each entry says what it rounds and what it gives back:

* ``codes``: ``codes(x, fmt, rounding, saturate)`` -> the codes of float32 ``x`` (1-D numpy),
  or raises ``NotImplementedError`` for a combination the implementation does not offer (its
  documented refusal). The numba emulator's three kernels, and every backend's ``quantize``
  (the emulator backend, torch's native casts, the Triton kernels in the interpreter).
* ``counts``: ``counts(x, fmt, rounding)`` -> ``{"overflow", "underflow", ...}`` of a saturating
  cast of ``x`` at scale 1, for the implementations that classify values without writing codes:
  the analyzer's branch-free casts (:mod:`fp8sim.analysis.stats`, round to nearest even) and the
  trace statistics' thresholds (:mod:`fp8sim.trace.statistics`, rne / rna / rtz).

The oracle is :func:`fp8sim.reference.encode_reference`, which shares no rounding code with any
of them (a table and a bisection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

#: rounding modes a deterministic sweep covers (stochastic rounding needs each implementation's
#: own random bits: the emulator's are swept in test_emulator_exhaustive.py, the backends' in
#: test_backends.py)
DETERMINISTIC = ("rne", "rna", "rtz", "up", "down", "odd")


@dataclass(frozen=True)
class Rounding:
    name: str
    kind: str  # "codes" or "counts"
    fn: Callable
    roundings: tuple[str, ...] = DETERMINISTIC
    needs: str | None = None  # an optional package (the entry is skipped without it)


def _emulator_kernel(allow_fast: bool, dtype) -> Callable:
    def codes(x, fmt, rounding, saturate):
        from fp8sim import emulator
        from fp8sim.formats import get_format

        with np.errstate(invalid="ignore"):
            xd = x.astype(dtype)
        return emulator._encode_numpy(xd, get_format(fmt), rounding, saturate, None, None, None,
                                      allow_fast=allow_fast)  # fmt: skip

    return codes


def _backend(name: str) -> Callable:
    def codes(x, fmt, rounding, saturate):
        import torch

        from fp8sim import backends

        c, _ = backends.get(name).quantize(torch.from_numpy(x.copy()), fmt, 1.0, rounding=rounding,
                                           saturate=saturate)  # fmt: skip
        return c.numpy()

    return codes


def _analysis_counts(x, fmt, rounding):
    from fp8sim.analysis.stats import parse_variants, tensor_stats

    if rounding != "rne":
        raise NotImplementedError("the analyzer casts with round to nearest even")
    v = tensor_stats(x, parse_variants([fmt.name], ["none"])).variants[0]
    return {"overflow": v.overflow, "underflow": v.underflow, "subnormal": v.subnormal}


def _trace_counts(x, fmt, rounding):
    from fp8sim.trace import COUNT_ROUNDINGS
    from fp8sim.trace.statistics import histogram_and_counts

    if rounding not in COUNT_ROUNDINGS:
        raise NotImplementedError(f"the trace counts {', '.join(COUNT_ROUNDINGS)}")
    r = histogram_and_counts(x, fmt, 1.0, rounding, 5, engine="numba")
    t = histogram_and_counts(x, fmt, 1.0, rounding, 5, engine="torch")
    if (r.overflow, r.underflow) != (t.overflow, t.underflow):
        raise AssertionError(f"trace engines differ: numba {r.overflow, r.underflow}, torch {t.overflow, t.underflow}")
    return {"overflow": r.overflow, "underflow": r.underflow}


REGISTRY = (
    Rounding("emulator-fast-f32", "codes", _emulator_kernel(True, np.float32)),
    Rounding("emulator-fast-f64", "codes", _emulator_kernel(True, np.float64)),
    Rounding("emulator-general-f32", "codes", _emulator_kernel(False, np.float32)),
    Rounding("backend-emulator", "codes", _backend("emulator")),
    Rounding("backend-torch", "codes", _backend("torch")),
    Rounding("backend-triton", "codes", _backend("triton"), needs="triton"),
    Rounding("analysis-stats", "counts", _analysis_counts, roundings=("rne",)),
    Rounding("trace-statistics", "counts", _trace_counts, roundings=("rne", "rna", "rtz")),
)


def wider(fmt):
    """``fmt`` with one more exponent bit, the same bias and mantissa, IEEE infinities and NaNs:
    rounding into it is rounding with an unbounded exponent at ``fmt``'s top (and the same
    subnormals at its bottom)."""
    from fp8sim.formats import FloatFormat

    return FloatFormat(f"{fmt.name}-wide", fmt.exponent_bits + 1, fmt.mantissa_bits, fmt.bias, True, "ieee",
                       fmt.has_subnormals, True)  # fmt: skip


def reference_counts(x: np.ndarray, ref_sat: np.ndarray, ref_wide: np.ndarray, fmt) -> dict:
    """What a saturating cast of ``x`` at scale 1 does, from the reference's codes (``ref_sat``:
    in ``fmt``, saturating; ``ref_wide``: in :func:`wider` ``(fmt)``, the same rounding):
    ``overflow`` -- finite values whose rounding with an unbounded exponent lands above
    ``fmt.max``; ``underflow`` -- nonzero finite values whose code decodes to 0; ``subnormal`` --
    codes that decode to a nonzero magnitude below ``min_normal``."""
    from fp8sim.emulator import decode_table

    table = decode_table(fmt, np.float64)
    wide = np.abs(decode_table(wider(fmt), np.float64)[ref_wide])
    finite = np.isfinite(x)
    val = np.abs(table[np.maximum(ref_sat, 0)])
    return {"overflow": int((finite & (wide > fmt.max)).sum()),
            "underflow": int((finite & (x != 0) & (val == 0)).sum()),
            "subnormal": int((finite & (val > 0) & (val < fmt.min_normal)).sum())}  # fmt: skip
