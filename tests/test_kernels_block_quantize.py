"""kernels.block_quantize against fp8sim.scaling.quantize_scaled: codes, scales, amaxes equal.

The scaling module is the reference for the just-in-time group scales (row, col, block:RxC, MX
floor/rceil); the kernel computes the same float32 rules in-kernel. Inputs mix binades, exact
powers of two (the MX rceil boundary), zeros, NaN and inf in some groups, and ragged edges.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.backends import get
from fp8sim.backends.cases import random_values
from fp8sim.scaling import e8m0_codes, quantize_scaled
from fp8sim.kernels.block_quantize import block_quantize

SEED = 99
# the interpreter runs on numpy: inf * 0 and overflowing products warn there (values are right)
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


def _input(shape, seed=0, specials=True):
    n = int(np.prod(shape))
    x = random_values(n, seed=seed, spread=20.0).reshape(shape)
    if specials and x.ndim == 2 and x.shape[0] >= 3 and x.shape[1] >= 70:
        x[0, :40] = 0.0  # an all-zero MX block and part of a row
        x[1, 3] = np.nan
        x[1, 40] = np.inf
        x[2, 64:96] = np.float32(2.0**-130)  # subnormal amax
        x[2, 5] = np.float32(448.0 * 2.0**3)  # power-of-two ratio to max (rceil boundary)
    return x


def _check(x, fmt, gran, **kw):
    ref = quantize_scaled(x, fmt, gran, **kw)
    codes, scale_inv, amax, e8 = block_quantize(torch.from_numpy(x), fmt, gran, **kw)
    assert torch.equal(codes, torch.from_numpy(ref.codes)), gran
    want_s = torch.from_numpy(np.asarray(ref.scale_inv, np.float32))
    assert scale_inv.shape == want_s.shape
    assert torch.equal(torch.isnan(scale_inv), torch.isnan(want_s))
    ok = ~torch.isnan(want_s)
    assert torch.equal(scale_inv[ok], want_s[ok])
    want_a = torch.from_numpy(np.asarray(ref.amax, np.float32))
    assert torch.equal(torch.isnan(amax), torch.isnan(want_a))
    assert torch.equal(amax[~torch.isnan(want_a)], want_a[~torch.isnan(want_a)])
    if e8 is not None:
        assert torch.equal(e8, torch.from_numpy(e8m0_codes(ref.scale_inv)))
    return codes, scale_inv


@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (257, 31)])
@pytest.mark.parametrize("gran", ["row", "col", "block:1x32", "block:16x16", "mx", "mx:rceil"])
def test_matches_scaling(shape, gran):
    x = _input(shape, seed=len(gran) + shape[0])
    _check(x, "e4m3", gran)


@pytest.mark.parametrize("fmt,gran,shape,kw", [
    ("e5m2", "block:1x128", (257, 131), dict(margin=1, pow2=True)),
    ("e4m3", "block:128x128", (257, 131), dict(epsilon=1e-3)),
    ("e2m1", "mx", (33, 131), dict()),
    ("e3m2", "mx:rceil", (33, 131), dict(rounding="stochastic", seed=SEED)),
    ("e4m3fnuz", "row", (257, 131), dict(rounding="rtz", saturate=False)),
    ("e5m2", "block:3x5", (10, 23), dict(rounding="stochastic", seed=SEED, srbits=5)),
])
def test_formats_and_options(fmt, gran, shape, kw):
    """Each granularity with another format, rounding mode or scale option (ragged edges)."""
    x = _input(shape, seed=7, specials=fp8sim.get_format(fmt).has_nan)
    _check(x, fmt, gran, **kw)


def test_nd_and_strided_inputs():
    x3 = _input((2, 5, 70), seed=3, specials=False)
    _check(x3, "e4m3", "mx")
    base = torch.from_numpy(_input((40, 140), seed=4))
    view = base[:, ::2]  # non-contiguous (40, 70)
    ref = quantize_scaled(view.contiguous().numpy(), "e4m3", "block:8x32")
    codes, scale_inv, _, _ = block_quantize(view, "e4m3", "block:8x32")
    assert torch.equal(codes, torch.from_numpy(ref.codes))
    assert torch.equal(scale_inv, torch.from_numpy(ref.scale_inv))


def test_mx_nan_block_and_dequantize():
    """A block holding NaN/inf gets scale NaN (E8M0 0xFF) and NaN elements; others round-trip."""
    x = _input((3, 130), seed=5)
    codes, scale_inv, _ = get("triton").block_quantize(torch.from_numpy(x), "e4m3", "mx")
    assert torch.isnan(scale_inv[1, 0]) and torch.isnan(scale_inv[1, 1])
    assert (codes[1, :64] & 0x7F == 0x7F).all()  # e4m3 NaN code, either sign
    # elements of finite blocks dequantize to within half an e4m3 ulp of x (relative 2**-4)
    vals = fp8sim.decode(codes.numpy(), "e4m3").astype(np.float64)
    vals = vals * np.repeat(scale_inv.numpy().astype(np.float64), 32, axis=1)[:, :130]
    ok = np.isfinite(vals) & (np.abs(x) > 2.0**-100)
    rel = np.abs(vals[ok] - x[ok]) / np.abs(x[ok])
    big = np.abs(x[ok]) >= np.repeat(scale_inv.numpy(), 32, axis=1)[:, :130][ok] * 2.0**-6
    assert np.all(rel[big] <= 2.0**-4)


def test_bad_arguments():
    x = torch.ones(4, 64)
    with pytest.raises(ValueError, match="mx"):
        block_quantize(x, "e4m3", "mx", margin=1)
    with pytest.raises(ValueError, match="tensor"):
        block_quantize(x, "e4m3", "tensor")
    with pytest.raises(ValueError, match="granularity"):
        block_quantize(x, "e4m3", "block:0x4")
    with pytest.raises(ValueError, match="NaN"):
        block_quantize(torch.full((1, 32), float("nan")), "e2m1", "block:1x32")
