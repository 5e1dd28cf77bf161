"""The torch twins of the scale rules (:mod:`fp8sim.scaling_torch`) equal the numba/numpy rules
of :mod:`fp8sim.scaling` bit for bit, on every edge."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8sim.scaling import mx_shared_scale, scale_from_amax
from fp8sim.scaling_torch import mx_shared_scale_torch, scale_from_amax_torch


def _amaxes() -> np.ndarray:
    """0, the smallest subnormal, every power of two and its neighbours, float32 max, inf, NaN,
    and 50,000 random positive float32 bit patterns."""
    p = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    edges = np.concatenate([p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf)),
                            np.float32([0, 1e-45, 448, 464, 465, 57344, 61440, 3.4028235e38, np.inf, np.nan])])
    bits = np.random.default_rng(0).integers(0, 0x7F800000, 50_000, dtype=np.uint32)
    return np.concatenate([edges.astype(np.float32), bits.view(np.float32)])


def _same(a: torch.Tensor, b: np.ndarray) -> bool:
    return torch.equal(a.view(torch.int32), torch.from_numpy(np.ascontiguousarray(b, np.float32)).view(torch.int32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("kw", [{}, {"pow2": True}, {"epsilon": 1e-12}, {"margin": 3, "pow2": True},
                                {"margin": -2.5, "epsilon": 2.0**-20}, {"margin": 126, "pow2": True}])
def test_scale_from_amax_torch_equals_the_numba_rule(fmt, kw):
    a = _amaxes()
    assert _same(scale_from_amax_torch(torch.from_numpy(a), fmt, **kw), scale_from_amax(a, fmt, **kw))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e3m2"])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_shared_scale_torch_equals_the_numpy_rule(fmt, rule):
    a = _amaxes()
    got = mx_shared_scale_torch(torch.from_numpy(a), fmt, rule)
    want = mx_shared_scale(a, fmt, rule)
    assert torch.equal(torch.isnan(got), torch.from_numpy(np.isnan(want)))
    assert _same(got.nan_to_num(-1.0), np.nan_to_num(want, nan=-1.0))
