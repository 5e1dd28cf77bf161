"""Exhaustive and dense sweeps of the emulator against independent references.

* every float16 and every bfloat16 input, for every format x rounding mode x overflow rule,
  against the scalar reference (fp8sim.reference, a table-and-bisect algorithm that shares no code
  with the bit-splitting kernels) -- through the branch-free kernel on float32 and on float64
  inputs, and through the general float32 kernel;
* a float32 sweep of 2**24 bit patterns plus every boundary, against ml_dtypes (round to nearest
  even, non-saturating) and torch (e4m3fn saturating, e5m2 and FNUZ non-saturating).
"""

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8sim
from fp8sim import emulator
from fp8sim.emulator import ROUNDING_MODES
from fp8sim.reference import encode_reference
from tests.test_formats import ML_DTYPES

ALL_FORMATS = list(ML_DTYPES) + ["e6m9", "e3m3", "e8m5"]
EXHAUSTIVE_COUNT = {"n": 0}


def _all_inputs(kind: str) -> np.ndarray:
    bits = np.arange(1 << 16, dtype=np.uint16)
    if kind == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)  # every bfloat16


def _encode_all_kernels(x32, fmt, mode, sat, kw):
    """Codes from the branch-free kernel (float32 and float64 input) and the general float32
    kernel (the general float64 kernel serves the formats the branch-free one does not take)."""
    out = []
    rbits = kw.get("rbits")
    srbits = kw.get("srbits")
    for use_fast, dtype in ((True, np.float32), (True, np.float64), (False, np.float32)):
        with np.errstate(invalid="ignore"):  # widening signalling NaNs sets the flag only
            xd = x32.astype(dtype)
        out.append(emulator._encode_numpy(xd, fmt, mode, sat, rbits, srbits, None,
                                          allow_fast=use_fast))
    return out


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_every_16bit_input_every_mode_matches_reference(kind, name):
    fmt = fp8sim.get_format(name)
    x = _all_inputs(kind)
    rbits = np.random.default_rng(7).integers(0, 1 << 32, x.size, dtype=np.uint32)
    for mode in ROUNDING_MODES:
        for sat in (True, False):
            kw = dict(rbits=rbits, srbits=11) if mode == "stochastic" else {}
            ref = encode_reference(x, fmt, rounding=mode, saturate=sat, **kw)
            ok = ref >= 0
            if not ok.all():
                # formats without NaN: the emulator must refuse exactly the refused inputs
                with pytest.raises(ValueError, match=f"{fmt.name}"):
                    fp8sim.encode(x, fmt, rounding=mode, saturate=sat, **kw)
                kw = dict(rbits=rbits[ok], srbits=11) if mode == "stochastic" else {}
            for codes in _encode_all_kernels(x[ok], fmt, mode, sat, kw):
                mismatch = np.flatnonzero(codes.astype(np.int64) != ref[ok])
                assert mismatch.size == 0, (
                    f"{name} {mode} sat={sat}: {mismatch.size} mismatches, first input "
                    f"{x[ok][mismatch[0]]!r} -> {codes[mismatch[0]]:#x}, "
                    f"reference {ref[ok][mismatch[0]]:#x}"
                )
            EXHAUSTIVE_COUNT["n"] += int(ok.sum()) * 3


def test_reference_jit_and_plain_python_agree():
    """The exhaustive sweeps run the reference jitted; the plain Python must say the same."""
    rng = np.random.default_rng(3)
    x = np.concatenate([
        rng.standard_normal(300) * 10.0 ** rng.integers(-12, 6, 300),
        [0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, 464.0001, 2.0**-10, 57344.0, 61440.0],
    ])
    rbits = rng.integers(0, 1 << 32, x.size, dtype=np.uint32)
    for name in ["e4m3", "e5m2", "e4m3fnuz", "e2m1", "e8m0", "bf16"]:
        for mode in ROUNDING_MODES:
            for sat in (True, False):
                kw = dict(rbits=rbits, srbits=7) if mode == "stochastic" else {}
                a = encode_reference(x, name, rounding=mode, saturate=sat, jit=True, **kw)
                b = encode_reference(x, name, rounding=mode, saturate=sat, jit=False, **kw)
                assert np.array_equal(a, b), (name, mode, sat)


# -- float32 sweep against ml_dtypes and torch ----------------------------------------------


def _float32_sweep() -> np.ndarray:
    """2**24 float32 bit patterns spread over the whole range, plus every format boundary."""
    step = 1 << 8
    pats = np.arange(0, 1 << 32, step, dtype=np.uint64)
    pats = (pats + (pats >> np.uint64(8)) % np.uint64(step)).astype(np.uint32)  # vary low bits
    sweep = [pats.view(np.float32)]
    for name in ML_DTYPES:
        fmt = fp8sim.get_format(name)
        mags = emulator.decode_table(fmt, np.float64)[: fmt.max_code + 1]
        virtual_next = 2 * mags[-1] - mags[-2] if fmt.mantissa_bits else 2 * mags[-1]
        mags = np.append(mags, virtual_next)
        ties = (mags[:-1] + mags[1:]) / 2  # every tie, incl. the one just above max
        pts = np.concatenate([mags, ties, [fmt.min_subnormal / 2, fmt.max]])
        pts = pts[np.isfinite(pts) & (pts < 3e38)].astype(np.float32)
        near = [pts, np.nextafter(pts, np.float32(0)), np.nextafter(pts, np.float32(np.inf))]
        sweep += near + [-p for p in near]
    sweep.append(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan], np.float32))
    return np.concatenate(sweep)


@pytest.fixture(scope="module")
def sweep32():
    x = _float32_sweep()
    assert x.size >= 1 << 24
    return x


def _same_codes(ours: np.ndarray, theirs: np.ndarray, fmt) -> np.ndarray:
    """Elementwise agreement; NaN codes agree when both are NaN (payloads are not semantics)."""
    a = fp8sim.decode(ours, fmt, dtype=np.float64)
    b = fp8sim.decode(theirs, fmt, dtype=np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    return both_nan | (ours == theirs)


@pytest.mark.parametrize("name", [n for n in ML_DTYPES if n != "e8m0"])
def test_float32_sweep_matches_ml_dtypes_rne_nonsaturating(sweep32, name):
    fmt = fp8sim.get_format(name)
    x = sweep32
    if fmt.nan == "none":  # ml_dtypes clamps where no NaN exists; compare the finite range only
        x = x[np.abs(x) <= fmt.max]
    ours = fp8sim.encode(x, fmt, rounding="rne", saturate=False)
    with np.errstate(over="ignore", invalid="ignore"):
        theirs = x.astype(ML_DTYPES[name])
    theirs = theirs.view(np.uint16 if fmt.bits > 8 else np.uint8) & (fmt.num_codes - 1)
    bad = np.flatnonzero(~_same_codes(ours, theirs.astype(ours.dtype), fmt))
    assert bad.size == 0, f"{bad.size} disagreements, first {x[bad[0]]!r}"


def test_e8m0_matches_ml_dtypes_except_documented_zero(sweep32):
    """ml_dtypes maps 0 to NaN; we map it to 2**-127 as torch does (E8M0 has no zero)."""
    x = sweep32[np.abs(sweep32) > 0]
    ours = fp8sim.encode(x, "e8m0", saturate=False)
    with np.errstate(over="ignore", invalid="ignore"):
        theirs = x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    assert _same_codes(ours, theirs, fp8sim.get_format("e8m0")).all()
    assert fp8sim.encode(np.float32(0.0), "e8m0") == 0


@pytest.mark.parametrize(
    "name,torch_dtype,saturate",
    [
        ("e4m3", torch.float8_e4m3fn, True),
        ("e5m2", torch.float8_e5m2, False),
        ("e4m3fnuz", torch.float8_e4m3fnuz, False),
        ("e5m2fnuz", torch.float8_e5m2fnuz, False),
    ],
)
def test_float32_sweep_matches_torch(sweep32, name, torch_dtype, saturate):
    fmt = fp8sim.get_format(name)
    ours = fp8sim.encode(sweep32, fmt, rounding="rne", saturate=saturate)
    theirs = torch.from_numpy(sweep32).to(torch_dtype).view(torch.uint8).numpy()
    bad = np.flatnonzero(~_same_codes(ours, theirs, fmt))
    assert bad.size == 0, f"{bad.size} disagreements, first {sweep32[bad[0]]!r}"


def test_torch_and_ml_dtypes_overflow_rules_differ_as_documented():
    """Why the comparisons above pick different saturate flags: e4m3fn 500.0."""
    x = np.array([500.0], np.float32)
    assert torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).item() == 0x7E
    assert x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0] == 0x7F
    assert fp8sim.encode(x, "e4m3", saturate=True)[0] == 0x7E
    assert fp8sim.encode(x, "e4m3", saturate=False)[0] == 0x7F


def test_float32_rne_lane_kernels_equal_the_general_kernel(sweep32):
    """float32 round-to-nearest-even runs 32-bit-lane kernels of its own (one FPU add where the
    format allows, integer operations only otherwise): on the 17.5 M-input float32 sweep both
    give the general kernel's codes for every format they serve, both overflow rules (the 16-bit
    exhaustive test above holds them to the reference too)."""
    from fp8sim._numba.encode_core import fpu_rne_ok

    served = [n for n in ALL_FORMATS if emulator._fast_path_ok(fp8sim.get_format(n), np.dtype(np.float32))]
    assert {"e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "fp16", "bf16"} <= set(served)
    fpu = {n for n in served if fpu_rne_ok(fp8sim.get_format(n).emin, fp8sim.get_format(n).emax,
                                           fp8sim.get_format(n).mantissa_bits)}  # fmt: skip
    assert {"e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "fp16"} <= fpu and "bf16" not in fpu
    for name in served:
        fmt = fp8sim.get_format(name)
        for sat in (True, False):
            general = emulator._encode_numpy(sweep32, fmt, "rne", sat, None, None, None, allow_fast=False)
            for use_fpu in (True, False) if name in fpu else (False,):
                fast = emulator._encode_numpy(sweep32, fmt, "rne", sat, None, None, None, fpu=use_fpu)
                bad = np.flatnonzero(fast != general)
                assert bad.size == 0, f"{name} sat={sat} fpu={use_fpu}: {bad.size} differ, first {sweep32[bad[0]]!r}"


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1", "e8m0"])
def test_parallel_kernels_equal_their_serial_twins(name):
    """Small arrays run serial twins; large ones the parallel kernels: same source, same codes."""
    x = _all_inputs("float16")
    big = np.tile(x, 3)  # above PARALLEL_MIN_ELEMENTS
    assert big.size >= emulator.PARALLEL_MIN_ELEMENTS > x.size
    fmt = fp8sim.get_format(name)
    if fmt.nan == "none":
        x = x[np.isfinite(x)]
        big = np.tile(x, 3)
    for mode in ROUNDING_MODES:
        kw = dict(seed=5) if mode == "stochastic" else {}
        for allow_fast in (True, False):
            small = emulator._encode_numpy(x, fmt, mode, True, None, None, kw.get("seed"),
                                           allow_fast=allow_fast)
            large = emulator._encode_numpy(big, fmt, mode, True, None, None, kw.get("seed"),
                                           allow_fast=allow_fast)
            if mode == "stochastic":  # counters differ past the first copy; compare copy 1
                assert np.array_equal(large[: x.size], small)
            else:
                assert np.array_equal(large, np.tile(small, 3))
        assert np.array_equal(fp8sim.decode(np.tile(small, 3), fmt),
                              np.tile(fp8sim.decode(small, fmt), 3), equal_nan=True)


def test_float32_rne_kernel_ignores_denormals_are_zero(sweep32):
    """``torch.set_flush_denormal(True)`` sets the CPU's denormals-are-zero / flush-to-zero bits
    for the calling thread, where the serial kernels run: float32 subnormal inputs must still
    round as the reference says (bf16 and the e8mY formats give them nonzero codes)."""
    tiny = np.concatenate([sweep32[np.abs(sweep32) < np.float32(2.0**-120)][:50000],
                           np.array([1e-40, -3e-39, 1.4e-45, -1.17e-38], np.float32)])
    assert (np.abs(tiny[np.isfinite(tiny)]) < np.finfo(np.float32).tiny).sum() > 1000
    want = {n: encode_reference(tiny, fp8sim.get_format(n), rounding="rne", saturate=True)
            for n in ("bf16", "e8m3", "e8m5", "e4m3", "e5m2", "fp16")}  # the last three: FPU kernel
    assert torch.set_flush_denormal(True)
    try:
        for n, ref in want.items():
            got = emulator._encode_numpy(tiny, fp8sim.get_format(n), "rne", True, None, None, None)
            assert np.array_equal(got.astype(np.int64), ref), n
    finally:
        torch.set_flush_denormal(False)
