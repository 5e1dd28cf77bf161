"""The two engines of the trace statistics (numba on host arrays, torch ops on any device) give
bit-identical results: histogram bins and counts, zero/NaN/inf, overflow/underflow and amax,
for float32, bfloat16, float16 and float64 inputs, edge values included."""

import math

import numpy as np
import pytest
import torch

from fp8sim.formats import get_format
from fp8sim.trace import cast_thresholds
from fp8sim.trace.histogram import bin_id, num_bins
from fp8sim.trace.statistics import device_statistics, histogram_and_counts, unpack_statistics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros of both signs, NaN, +-inf, the dtype's max, smallest normal and subnormal (and
    their neighbours), bin edges ``2**e (1 + m/32)`` with the values just beside them, and the
    scaled over/underflow thresholds of E4M3 and E5M2 under the scales the tests use."""
    fi = torch.finfo(dtype)
    v = [0.0, -0.0, math.nan, math.inf, -math.inf, fi.max, -fi.max, fi.tiny, fi.smallest_normal,
         fi.tiny * 2**-3 if dtype != torch.bfloat16 else fi.tiny * 2**-7]
    if dtype == torch.float64:  # values float32 cannot hold: 0 and inf after rounding
        v += [1e-300, 2.0**-150, 2.0**-149 * 0.75, 1e300, 3.5e38]
    for e in (-20, -9, -1, 0, 1, 8, 15):
        for m in (0, 1, 7, 31):
            v.append(2.0**e * (1 + m / 32))
    for fmt in ("e4m3", "e5m2"):
        for rounding in ("rne", "rna", "rtz"):
            thr = cast_thresholds(fmt, rounding)
            for s in (1.0, 0.5, 3.0):
                v += [thr.overflow_at / s, thr.underflow_at / s]
    t = torch.tensor(v, dtype=torch.float64).to(dtype)
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    down = torch.nextafter(t, torch.full_like(t, -math.inf))
    return torch.cat([t, up, down, -t])


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(5000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-40, 20, (5000,), generator=g).double())
    return [_edge_values(dtype), wide.to(dtype), torch.empty(0, dtype=dtype)]


def _same(a, b) -> None:
    np.testing.assert_array_equal(a.bins, b.bins)
    np.testing.assert_array_equal(a.counts, b.counts)
    for f in ("numel", "zero", "nan", "inf", "overflow", "underflow"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.amax == b.amax  # exact: max finite |x| in the input's precision


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,rounding,scale", [("e4m3", "rne", 1.0), ("e4m3", "rna", 0.5),
                                                ("e5m2", "rtz", 3.0), ("e5m2", "rne", 2.0**-20),
                                                ("e3m4", "rne", 1.7)])
def test_engines_agree_bit_for_bit(dtype, fmt, rounding, scale):
    for x in _inputs(dtype):
        a = histogram_and_counts(x, get_format(fmt), scale, rounding, 5, engine="numba")
        b = histogram_and_counts(x, get_format(fmt), scale, rounding, 5, engine="torch")
        _same(a, b)


@pytest.mark.parametrize("k", [0, 3, 10])
def test_engines_agree_for_every_mantissa_width(k):
    x = _inputs(torch.float32)[1]
    _same(histogram_and_counts(x, get_format("e4m3"), 1.0, "rne", k, engine="numba"),
          histogram_and_counts(x, get_format("e4m3"), 1.0, "rne", k, engine="torch"))


def test_edge_values_land_where_the_bins_say():
    """Independent of both engines: 2**e (1 + m/32) lands in the exact bin (e, m, 0), the float32
    just above it in the open bin (e, m, 1); values float32 cannot hold in the sentinels."""
    x = torch.tensor([2.0**-3 * (1 + 5 / 32), 1e-300, 1e300], dtype=torch.float64)
    x = torch.cat([x, torch.nextafter(x[:1].float(), torch.tensor(1.0)).double()])
    r = histogram_and_counts(x, get_format("e4m3"), 1.0, "rne", 5, engine="torch")
    want = sorted([bin_id(-3, 5, 0, 5), bin_id(-150, 0, 1, 5), bin_id(128, 0, 1, 5), bin_id(-3, 5, 1, 5)])
    assert r.bins.tolist() == want and r.counts.tolist() == [1, 1, 1, 1]
    assert max(want) < num_bins(5)


def test_device_statistics_is_one_small_tensor_on_the_device():
    x = torch.randn(300, 7)
    row = device_statistics(x, get_format("e4m3"), 1.0, "rne", 5)
    assert row.dtype == torch.int64 and row.shape == (num_bins(5) + 6,) and row.device == x.device
    r = unpack_statistics(row.numpy(), x.numel(), 5)
    _same(r, histogram_and_counts(x, get_format("e4m3"), 1.0, "rne", 5, engine="numba"))


def test_engine_is_checked():
    with pytest.raises(ValueError, match="engine"):
        histogram_and_counts(torch.ones(3), get_format("e4m3"), 1.0, "rne", 5, engine="cuda")


@pytest.mark.parametrize("scale", [1.0, 2.0**30, 1e-30, 2.0**-126, 3.0e38])
def test_float32_bit_patterns_agree_at_extreme_scales(scale):
    """Float32 input is counted from its bits (exponent and mantissa fields; over/underflow as
    bounds on |x|'s bits found once per call): random bit patterns of every exponent, subnormals
    included, give the torch engine's figures, also where every value or none overflows."""
    g = np.random.default_rng(3)
    bits = g.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    bits[:64] = np.arange(64, dtype=np.uint32)  # the smallest subnormals
    x = torch.from_numpy(bits.view(np.float32).copy())
    for fmt, rounding in (("e4m3", "rne"), ("e5m2", "rna"), ("e2m1", "rtz")):
        _same(histogram_and_counts(x, get_format(fmt), scale, rounding, 5, engine="numba"),
              histogram_and_counts(x, get_format(fmt), scale, rounding, 5, engine="torch"))
