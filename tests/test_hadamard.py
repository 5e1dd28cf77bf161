"""The Random Hadamard Transform: its float32 order against a scalar reference written from the
docstring, its algebra against the float64 matrix product, its signs."""

from __future__ import annotations

import numpy as np
import pytest

from fp8sim.hadamard import TE_RHT_SIGNS, hadamard_matrix, rht, rht_signs
from fp8sim.philox import randint

F32 = np.float32


def scalar_rht(group, signs):
    """One group, step by step as the module docstring states, in Python float32 scalars."""
    v = [F32(F32(x) * F32(F32(s) * F32(0.25))) for x, s in zip(group, signs)]
    for h in (1, 2, 4, 8):
        for j in range(16):
            if j & h == 0:
                a, b = v[j], v[j + h]
                v[j], v[j + h] = F32(a + b), F32(a - b)
    return np.array(v, F32)


def test_float32_order_matches_scalar_reference():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 32)) * np.exp2(rng.integers(-20, 20, (6, 1)))).astype(F32)
    got = rht(x, axis=1, signs="te")
    for i in range(6):
        for g in range(2):
            want = scalar_rht(x[i, 16 * g : 16 * g + 16], TE_RHT_SIGNS)
            np.testing.assert_array_equal(got[i, 16 * g : 16 * g + 16].view(np.uint32), want.view(np.uint32))


def test_transform_is_the_signed_hadamard_product_and_orthonormal():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((48, 5)).astype(F32)
    h = hadamard_matrix(16).astype(np.float64)
    np.testing.assert_array_equal(h @ h, 16 * np.eye(16))
    np.testing.assert_array_equal(h, h.T)
    s = rht_signs(3).astype(np.float64)
    y = rht(x, axis=0, signs=3)
    want = np.concatenate([(h / 4) @ (s[:, None] * x[16 * g : 16 * g + 16].astype(np.float64))
                           for g in range(3)])  # fmt: skip
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(np.linalg.norm(y, axis=0), np.linalg.norm(x, axis=0), rtol=1e-6)
    np.testing.assert_allclose(rht(y, axis=0, signs=3, inverse=True), x, rtol=0, atol=1e-6)


def test_gemm_of_transformed_operands_is_the_product():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((7, 64)).astype(F32)
    b = rng.standard_normal((64, 9)).astype(F32)
    got = rht(a, axis=1, signs=11).astype(np.float64) @ rht(b, axis=0, signs=11).astype(np.float64)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=0, atol=1e-5)


def test_signs():
    # Transformer Engine's get_wgrad_sign_vector
    assert TE_RHT_SIGNS.tolist() == [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    s = rht_signs(1234)
    np.testing.assert_array_equal(s < 0, randint(1234, np.arange(16)) >> np.uint32(31) == 1)
    assert 0 < (s < 0).sum() < 16
    np.testing.assert_array_equal(rht(np.eye(16, dtype=F32), 1, signs=list(s)), rht(np.eye(16, dtype=F32), 1, signs=1234))


@pytest.mark.parametrize("kwargs, match", [
    ({"x": np.ones((3, 20), F32)}, "multiple of 16"),
    ({"x": np.ones(16, F32), "signs": [1] * 15}, "16 values"),
    ({"x": np.ones(16, F32), "signs": [2] * 16}, "16 values"),
    ({"x": np.ones(16, F32), "signs": "torchao"}, "signs"),
    ({"x": np.ones(16, F32), "axis": 1}, "out of range"),
])  # fmt: skip
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rht(**kwargs)
