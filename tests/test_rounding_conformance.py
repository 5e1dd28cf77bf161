"""One conformance suite for every rounding implementation in :mod:`tests.roundings`' registry,
against the scalar reference (:func:`fp8sim.reference.encode_reference`).

Inputs: every float16 value (as float32: all 65,536 bit patterns, NaNs and infinities included)
and the format's edge values (:func:`fp8sim.backends.cases.edge_values`: every code, every tie,
their float32 neighbours, the values around max and min_subnormal / 2). Each implementation is
swept over every format it takes, every deterministic rounding mode it offers and both overflow
rules: codes compared one by one, counts compared with the counts the reference's codes give.
A combination an implementation refuses must be one it documents (``NotImplementedError``), and
each implementation must take round to nearest even, saturating, in E4M3 and E5M2.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

from fp8sim.backends.cases import edge_values
from fp8sim.formats import get_format
from fp8sim.reference import encode_reference
from tests.roundings import REGISTRY, reference_counts, wider

FORMATS = ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e3m4", "e4m3b11fnuz", "e2m3", "e3m2", "e2m1", "e8m0",
           "fp16", "bf16"]  # fmt: skip


@functools.lru_cache(maxsize=None)
def _inputs(fmt: str) -> np.ndarray:
    every_f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    return np.concatenate([every_f16, edge_values(fmt)])


@functools.lru_cache(maxsize=None)
def _reference(fmt: str, rounding: str, saturate: bool) -> np.ndarray:
    return encode_reference(_inputs(fmt), fmt, rounding=rounding, saturate=saturate)


def _available(entry) -> None:
    if entry.needs and importlib.util.find_spec(entry.needs) is None:
        pytest.skip(f"{entry.name} needs {entry.needs}")
    if entry.name == "backend-triton":
        from fp8sim.kernels.cast import is_interpreter

        if not is_interpreter():
            pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1 (GPU: test_kernels_gpu.py)")


@pytest.mark.parametrize("entry", [e for e in REGISTRY if e.kind == "codes"], ids=lambda e: e.name)
@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_equal_the_reference(entry, fmt):
    _available(entry)
    if entry.name == "backend-triton" and get_format(fmt).bits > 8:
        pytest.skip("the interpreter is slow on 16-bit edge sets; test_backends.py checks fp16/bf16 in Triton")
    x = _inputs(fmt)
    offered = 0
    for rounding in entry.roundings:
        for saturate in (True, False):
            ref = _reference(fmt, rounding, saturate)
            ok = ref >= 0  # the reference refuses NaN (and overflow unless saturating) where fmt has no code
            try:
                codes = entry.fn(x[ok], fmt, rounding, saturate)
            except NotImplementedError:
                continue
            offered += 1
            got = np.asarray(codes).astype(np.int64)
            bad = np.flatnonzero(got != ref[ok])
            assert bad.size == 0, (f"{entry.name} {fmt} {rounding} saturate={saturate}: {bad.size} of {got.size} "
                                   f"differ; first {x[ok][bad[0]]!r} -> {got[bad[0]]:#x}, reference {ref[ok][bad[0]]:#x}")
    if fmt in ("e4m3", "e5m2"):
        assert offered, f"{entry.name} takes no rounding of {fmt}"


@pytest.mark.parametrize("entry", [e for e in REGISTRY if e.kind == "counts"], ids=lambda e: e.name)
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f not in ("e8m0", "fp16", "bf16")])
def test_counts_equal_the_reference(entry, fmt):
    f = get_format(fmt)
    x = _inputs(fmt)
    for rounding in entry.roundings:
        wide = encode_reference(x, wider(f), rounding=rounding, saturate=False)
        want = reference_counts(x, _reference(fmt, rounding, True), wide, f)
        got = entry.fn(x, f, rounding)
        assert got == {k: want[k] for k in got}, (entry.name, fmt, rounding, got, want)


def test_the_registry_covers_every_kind_of_implementation():
    names = {e.name for e in REGISTRY}
    assert {"emulator-fast-f32", "emulator-general-f32", "backend-emulator", "backend-torch", "backend-triton",
            "analysis-stats", "trace-statistics"} <= names  # fmt: skip
