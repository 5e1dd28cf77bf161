"""fp8sim._numba.fma.square_add: d*d + s for a float32 d, fused or not, equals numpy's unfused float64
d**2 + s bit for bit (the square of a float32 is exact in float64)."""

import numba
import numpy as np
import pytest

import fp8sim._numba.fma as fma


def _operands():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 0x7F800000, 20000, dtype=np.uint32)  # every finite magnitude range
    d = bits.view(np.float32) * np.where(rng.random(bits.size) < 0.5, -1, 1).astype(np.float32)
    edges = np.array([0.0, np.float32(1.4e-45), np.finfo(np.float32).tiny,
                      np.finfo(np.float32).max, 1.0 + 2.0**-23, 3.0], np.float32)  # fmt: skip
    d = np.concatenate([d, edges, -edges])
    s = np.concatenate([
        rng.standard_normal(d.size // 2) * np.exp2(rng.integers(-300, 300, d.size // 2)),
        -(d[d.size // 2 :].astype(np.float64) ** 2) * (1 + 2.0**-40),  # near-cancellation
    ])  # fmt: skip
    return d, s


def _kernel():
    @numba.njit(cache=False)
    def run(d, s, out):
        for k in range(d.size):
            out[k] = fma.square_add(d[k], s[k])

    return run


@pytest.mark.parametrize("fused", [True, False])
def test_square_add_equals_unfused_float64(monkeypatch, fused):
    if fused and not fma.HAS_FMA:
        pytest.skip("this CPU has no fused multiply-add")
    monkeypatch.setattr(fma, "HAS_FMA", fused)  # read when the kernel below compiles
    d, s = _operands()
    out = np.empty_like(s)
    _kernel()(d, s, out)
    ref = d.astype(np.float64) ** 2 + s  # exact square, one rounding of the sum
    assert np.array_equal(out.view(np.uint64), ref.view(np.uint64))


def test_square_add_takes_float32_only():
    @numba.njit(cache=False)
    def bad(d, s):
        return fma.square_add(d, s)

    with pytest.raises(numba.core.errors.TypingError):
        bad(1.0, 2.0)  # a float64 d: its square need not be exact
