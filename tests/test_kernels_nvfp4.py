"""kernels.nvfp4_quantize and kernels.rht against the emulator (fp8sim.nvfp4, fp8sim.hadamard).

Bitwise: E2M1 codes (packed and one per byte), E4M3 block-scale codes and values, block amaxes,
the tensor scale and the tensor amax; the RHT's float32 output bits (NaN positions for NaN).
Inputs mix many binades with the cases where the variants' rules branch: a NaN and an inf in a
block, an all-zero block, tiny blocks (E4M3 subnormal or zero block scales), a given tensor amax
below the data (saturated scales and elements), 0, inf and float32's extremes; ragged edges on
both axes, 0-d, 1-D, 3-D, strided and narrow-dtype inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8sim.backends import get
from fp8sim.backends.cases import nvfp4_boundary_tiles, random_values
from fp8sim.hadamard import rht as rht_ref
from fp8sim.kernels.nvfp4_quantize import nvfp4_quantize
from fp8sim.kernels.rht import rht
from fp8sim.nvfp4 import NVFP4_VARIANTS, pack_e2m1, quantize_nvfp4_2d
from fp8sim.scaling import quantize_scaled

# the interpreter runs on numpy: inf * 0 and overflowing products warn there (values are right)
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]
LAYOUTS = ("1x16", "16x1", "16x16")


def _input(shape=(37, 70), seed=0):
    """Random values over 40 binades with NaN, +-inf, a zero block and tiny blocks (shape at
    least (36, 52))."""
    x = random_values(int(np.prod(shape)), seed=seed, spread=20.0).reshape(shape)
    x[3, 5] = np.nan
    x[5, 20] = np.inf
    x[21, 50] = -np.inf
    x[16:32, 16:32] = 0.0  # a zero block in every layout
    x[33, 32:48] = np.float32(2.0**-140) * np.arange(16)  # float32 subnormals
    x[34, 0:16] = np.float32(1e-30)  # a tiny block: E4M3 subnormal / zero scale under te
    x[35, 0:16] = np.float32(-3e-27)
    return x


def _bits(a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)  # one NaN pattern


def _check(x: np.ndarray, layout: str, variant: str, **kw) -> None:
    """The kernel (packed and unpacked) == quantize_nvfp4_2d on the 2-D view, bit for bit."""
    m = x.shape[-1] if x.ndim else 1
    ref = quantize_nvfp4_2d(x.reshape(-1, m), layout, variant, **kw)
    xt = torch.from_numpy(x)
    packed = nvfp4_quantize(xt, layout, variant, **kw)
    flat = nvfp4_quantize(xt, layout, variant, pack=False, **kw)
    want_codes = ref.codes.reshape(x.shape)
    assert torch.equal(flat.codes, torch.from_numpy(want_codes)), (layout, variant)
    assert torch.equal(packed.codes, torch.from_numpy(pack_e2m1(want_codes))), (layout, variant)
    for got in (packed, flat):
        assert torch.equal(got.block_codes, torch.from_numpy(ref.block_codes))
        assert np.array_equal(_bits(got.block_scale), _bits(ref.block_scale))
        assert np.array_equal(_bits(got.block_amax), _bits(ref.block_amax))
        assert _bits(got.tensor_scale) == _bits(ref.tensor_scale), (got.tensor_scale, ref.tensor_scale)
        assert _bits(got.global_amax) == _bits(ref.global_amax)


@pytest.mark.parametrize("variant", NVFP4_VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_emulator(layout, variant):
    x = _input(seed=len(layout) + len(variant))
    _check(x, layout, variant)
    _check(x, layout, variant, rounding="stochastic", seed=1234)
    _check(nvfp4_boundary_tiles(layout, variant, seed=len(variant)), layout, variant)


@pytest.mark.parametrize("variant", NVFP4_VARIANTS)
def test_given_tensor_amax(variant):
    """A below the data (block scales saturate at 448, elements at 6), 0, inf, float32 max and
    the smallest subnormal (te's S = 2688 / A overflows to inf -> float32 max)."""
    x = _input((36, 52), seed=3)
    for ga in (1.0, 0.0, np.inf, 3.4e38, 1e-45, 2.0**-126):
        _check(x, "1x16", variant, global_amax=ga)
    _check(x, "16x16", variant, global_amax=torch.tensor(7.5))


def test_all_zero_and_tiny_tensors():
    """te: S = 1 and zero scales; torchao: P = 0 makes every block scale NaN (codes 0); a tensor
    of float32 subnormals only; and a single element."""
    for variant in NVFP4_VARIANTS:
        _check(np.zeros((3, 40), np.float32), "1x16", variant)
        _check(np.full((17, 3), -2.0**-149, np.float32), "16x1", variant)
        _check(np.float32([[np.nan, 1.0, -0.0]]), "1x16", variant)
    _check(np.full((2, 20), np.nan, np.float32), "1x16", "te")  # A over no values: 0
    q = nvfp4_quantize(torch.zeros(3, 40), "1x16", "torchao")
    assert torch.isnan(q.block_scale).all() and (q.block_codes == 0x7F).all()
    # bfloat16 subnormals (the interpreter's own bfloat16 -> float32 conversion mangles them)
    bits = np.arange(1, 49, dtype=np.uint16)
    xb = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(3, 16)
    ref = quantize_nvfp4_2d((bits.astype(np.uint32) << 16).view(np.float32).reshape(3, 16))
    got = nvfp4_quantize(xb, pack=False)
    assert torch.equal(got.codes, torch.from_numpy(ref.codes))
    assert torch.equal(got.block_codes, torch.from_numpy(ref.block_codes))


def test_hand_example():
    """docs/numerics.md: A = 2688 gives S = 1, block scale 448; 1120 / 448 = 2.5 ties to 2.0;
    packed byte 0x57 = 3.0 (code 5) high, 6.0 (code 7) low."""
    x = torch.tensor([[2688.0, 1344.0, 1120.0, 0.0] + [0.0] * 12])
    q = nvfp4_quantize(x, "1x16", "te")
    assert q.block_scale.tolist() == [[448.0]] and q.block_codes.tolist() == [[0x7E]]
    assert q.codes[0, :2].tolist() == [0x57, 0x04]  # 2688 -> 6 (7), 1344 -> 3 (5); 2.0 (4), 0
    assert float(q.tensor_scale) == 2688.0


@pytest.mark.parametrize("shape,layout", [((), "1x16"), ((33,), "1x16"), ((2, 17, 35), "16x1"),
                                          ((2, 3, 31), "16x16"), ((0, 16), "1x16")])
def test_shapes(shape, layout):
    x = random_values(int(np.prod(shape)), seed=5).reshape(shape)
    _check(x, layout, "te", rounding="stochastic", seed=9)


def test_strided_dtypes_and_roundings():
    base = torch.from_numpy(_input((40, 140), seed=6))
    view = base[:, 1::2]  # non-contiguous (40, 70)
    ref = quantize_nvfp4_2d(view.contiguous().numpy(), "16x16", "te")
    assert torch.equal(nvfp4_quantize(view, "16x16", pack=False).codes, torch.from_numpy(ref.codes))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        xd = base[:20, :45].to(dtype)
        ref = quantize_nvfp4_2d(xd.to(torch.float32).numpy(), "1x16", "te")
        got = nvfp4_quantize(xd, "1x16", pack=False)
        assert torch.equal(got.codes, torch.from_numpy(ref.codes)), dtype
        assert torch.equal(got.block_codes, torch.from_numpy(ref.block_codes)), dtype
    x = _input((36, 52), seed=8)
    _check(x, "1x16", "te", rounding="stochastic", seed=3, srbits=4)
    _check(x, "16x1", "torchao", rounding="rtz")


def test_backend_block_quantize_matches_emulator():
    """An nvfp4 granularity runs on the triton backend and answers as the emulator backend."""
    x = torch.from_numpy(_input((36, 52), seed=10))
    for gran in ("nvfp4", "nvfp4:16x1:torchao", "nvfp4:2d", "nvfp4:ct"):
        kw = dict(rounding="stochastic", seed=77) if gran == "nvfp4:2d" else {}
        got = get("triton").block_quantize(x, "e2m1", gran, **kw)
        want = get("emulator").block_quantize(x, "e2m1", gran, **kw)
        assert torch.equal(got[0], want[0]), gran
        for a, b in zip(got[1:], want[1:]):
            assert np.array_equal(_bits(a), _bits(b)), gran
    st = quantize_scaled(x.numpy(), "e2m1", "nvfp4:2d")
    q = nvfp4_quantize(x, "16x16")
    assert torch.equal(q.codes, torch.from_numpy(pack_e2m1(st.codes)))
    assert _bits(q.tensor_scale) == _bits(st.tensor_scale)
    with pytest.raises(ValueError, match="e2m1"):
        get("triton").block_quantize(x, "e4m3", "nvfp4")
    with pytest.raises(ValueError, match="margin"):
        get("triton").block_quantize(x, "e2m1", "nvfp4", margin=1)
    codes, bscale, tscale, gamax = get("triton").nvfp4_quantize(x, "16x16")  # the backend interface
    assert torch.equal(codes, torch.from_numpy(st.codes)) and _bits(tscale) == _bits(st.tensor_scale)
    with pytest.raises(ValueError, match="layout"):
        get("triton").nvfp4_quantize(x, "mx")


def test_bad_arguments():
    x = torch.ones(4, 32)
    with pytest.raises(ValueError, match="layout"):
        nvfp4_quantize(x, "1x32")
    with pytest.raises(ValueError, match="variant"):
        nvfp4_quantize(x, "1x16", "mxfp4")
    with pytest.raises(ValueError, match="global_amax"):
        nvfp4_quantize(x, global_amax=float("nan"))
    with pytest.raises(ValueError, match="global_amax"):
        nvfp4_quantize(x, global_amax=torch.tensor(-1.0))
    with pytest.raises(ValueError, match="seed"):
        nvfp4_quantize(x, rounding="stochastic")
    with pytest.raises(ValueError, match="block"):
        nvfp4_quantize(x, "16x1", block=(8, 64))


# -- RHT ---------------------------------------------------------------------------------------


def _same_f32(got: torch.Tensor, want: np.ndarray) -> bool:
    g = got.numpy()
    return g.shape == want.shape and g.dtype == np.float32 and np.array_equal(_bits(g), _bits(want))


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("signs", ["te", 7, "ones"])
def test_rht_matches_emulator(signs, inverse):
    s = np.ones(16, np.float32) if signs == "ones" else signs
    x = random_values(48 * 35, seed=2, spread=60.0).reshape(48, 35)  # 2**+-60: overflow, subnormals
    x[0, 0], x[17, 3], x[33, 4], x[40, 5] = np.nan, np.inf, -np.inf, np.float32(1e-44)
    x[16:32, 6] = np.float32(3e38)  # sums overflow to inf
    for axis in (0, -2):
        assert _same_f32(rht(torch.from_numpy(x), axis, s, inverse=inverse),
                         rht_ref(x, axis, s, inverse=inverse))
    xt = np.ascontiguousarray(x.T)
    assert _same_f32(rht(torch.from_numpy(xt), 1, s, inverse=inverse), rht_ref(xt, 1, s, inverse=inverse))


def test_rht_shapes_strides_dtypes():
    y = random_values(3 * 32 * 5, seed=3, spread=30.0).reshape(3, 32, 5)
    assert _same_f32(rht(torch.from_numpy(y), 1, 3), rht_ref(y, 1, 3))
    z = random_values(2 * 7 * 48, seed=4).reshape(2, 7, 48)
    assert _same_f32(rht(torch.from_numpy(z), -1, 5), rht_ref(z, -1, 5))
    assert _same_f32(rht(torch.from_numpy(z[0, 0]), 0, "te"), rht_ref(z[0, 0], 0, "te"))
    w = torch.from_numpy(random_values(64 * 40, seed=5).reshape(40, 64)).t()  # (64, 40) strided
    assert _same_f32(rht(w, 0, "te"), rht_ref(w.contiguous().numpy(), 0, "te"))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        v = torch.from_numpy(random_values(3 * 64, seed=6).reshape(3, 64)).to(dtype)
        assert _same_f32(rht(v, -1, 1), rht_ref(v.to(torch.float32).numpy(), -1, 1)), dtype
    assert rht(torch.zeros(0, 16), -1).shape == (0, 16)
    # through the backend, and the round trip of the orthonormal transform (exact for these)
    x = torch.from_numpy(np.arange(-32, 32, dtype=np.float32).reshape(4, 16))
    tb = get("triton")
    assert torch.equal(tb.rht(tb.rht(x, -1, 11), -1, 11, inverse=True), x)


def test_rht_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 16"):
        rht(torch.ones(4, 24), -1)
    with pytest.raises(ValueError, match="out of range"):
        rht(torch.ones(4, 16), 2)
    with pytest.raises(ValueError, match="signs"):
        rht(torch.ones(4, 16), -1, [1.0] * 15)
    with pytest.raises(TypeError, match="float"):
        rht(torch.ones(4, 16, dtype=torch.int32), -1)
