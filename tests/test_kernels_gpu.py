"""GPU-only checks of the Triton kernels against the emulator (skipped without a CUDA GPU).

Run on a GPU with the interpreter off: ``TRITON_INTERPRET=0 pytest tests/test_kernels_gpu.py``.
The same kernels run bit-exact in the interpreter (tests/test_backends.py); here the compiled
GPU code is held to the emulator, including the native hardware paths the interpreter cannot
run: the ``.to(tl.float8e4nv / float8e5)`` cast and the fp8 tensor-core dot.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.backends.cases import edge_values, random_values
from fp8sim.emulator import ROUNDING_MODES, decode_table

try:
    from fp8sim.kernels.cast import is_interpreter
except ImportError:  # no triton at all
    is_interpreter = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or is_interpreter is None or is_interpreter(),
        reason="needs a CUDA GPU and TRITON_INTERPRET=0",
    ),
]
SEED = 4242


@pytest.fixture(scope="module")
def tb():
    from fp8sim.backends.triton_backend import TritonBackend

    return TritonBackend(native=False), TritonBackend(native=True)


def _inputs(fmt: str, n: int = 1 << 20) -> torch.Tensor:
    x = np.concatenate([edge_values(fmt), random_values(n, seed=1, spread=30.0)])
    return torch.from_numpy(x)


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("rounding", ROUNDING_MODES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "e3m4", "fp16", "bf16"])
def test_software_cast_on_gpu(tb, fmt, rounding, saturate):
    x = _inputs(fmt)
    seed = SEED if rounding == "stochastic" else None
    codes, _, amax = tb[0].quantize_with_amax(x.cuda(), fmt, 1.0, rounding=rounding,
                                              saturate=saturate, seed=seed)
    want = fp8sim.encode(x.numpy(), fmt, rounding=rounding, saturate=saturate, seed=seed)
    assert torch.equal(codes.cpu(), torch.from_numpy(want))
    assert torch.isnan(amax)  # edge values hold NaN


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_native_cast_equals_emulator(tb, fmt):
    x = _inputs(fmt, 1 << 22)
    for scale in (1.0, 3.0e-3, 1024.0):
        codes, _ = tb[1].quantize(x.cuda(), fmt, scale)
        with np.errstate(over="ignore"):  # beyond float32: inf, as the GPU's product
            want = fp8sim.encode(x.numpy() * np.float32(scale), fmt)
        assert torch.equal(codes.cpu(), torch.from_numpy(want)), scale


_SPECIAL_BITS = {  # +-NaN (quiet, then signalling), +-0, +-inf, +-1.5 in each input dtype
    torch.float16: (np.uint16, [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0, 0x8000, 0x7C00, 0xFC00,
                                0x3E00, 0xBE00]),
    torch.bfloat16: (np.uint16, [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0, 0x8000, 0x7F80, 0xFF80,
                                 0x3FC0, 0xBFC0]),
    torch.float32: (np.uint32, [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0, 0x80000000,
                                0x7F800000, 0xFF800000, 0x3FC00000, 0xBFC00000]),
    torch.float64: (np.uint64, [0x7FF8 << 48, 0xFFF8 << 48, (0x7FF0 << 48) | 1,
                                (0xFFF0 << 48) | 1, 0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48,
                                0x3FF8 << 48, 0xBFF8 << 48]),
}


def _signed_specials(dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """(x in ``dtype`` from bit patterns, its float32 values widened by numpy / bit shifts)."""
    uint, bits = _SPECIAL_BITS[dtype]
    raw = np.array(bits, dtype=uint)
    if dtype == torch.bfloat16:
        x = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
        xf = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        fdt = {np.uint16: np.float16, np.uint32: np.float32, np.uint64: np.float64}[uint]
        x = torch.from_numpy(raw.view(fdt).copy())
        with np.errstate(invalid="ignore"):  # float64 NaNs to float32
            xf = raw.view(fdt).astype(np.float32)
    assert np.array_equal(np.signbit(xf), raw >> (8 * raw.itemsize - 1) == 1)
    return x, xf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_signed_nan_and_zero_on_gpu(tb, dtype):
    # The GPU's multiply returns the canonical NaN 0x7FFFFFFF and -x compiles to 0 - x, so a
    # NaN's sign and -0 survive only where the kernels set sign bits with integers.
    x, xf = _signed_specials(dtype)
    for fmt, be in (("e4m3", tb[0]), ("e4m3", tb[1]), ("e5m2", tb[1]), ("fp16", tb[0])):
        for scale in (1.0, 3.0e-3):
            codes, _ = be.quantize(x.cuda(), fmt, scale)
            with np.errstate(invalid="ignore"):  # NaN inputs
                want = fp8sim.encode(xf * np.float32(scale), fmt)
            assert torch.equal(codes.cpu(), torch.from_numpy(want)), (fmt, scale, codes.cpu(), want)
    c, ct, _ = tb[0].cast_transpose(x.reshape(2, 5).cuda(), "e4m3", 2.0)
    with np.errstate(invalid="ignore"):
        want = fp8sim.encode(xf.reshape(2, 5) * np.float32(2.0), "e4m3")
    assert torch.equal(c.cpu(), torch.from_numpy(want)) and torch.equal(ct.cpu(), torch.from_numpy(want.T))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_keeps_signs_on_gpu(tb, out_dtype):
    codes = torch.tensor([0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81, 0x7E, 0xFE], dtype=torch.uint8)
    got = tb[0].dequantize(codes.cuda(), "e4m3", 0.5, out_dtype=out_dtype).cpu()
    ref = fp8sim.decode(codes.numpy(), "e4m3") * np.float32(0.5)
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(out_dtype)
    if np_dtype is None:  # bfloat16: round to nearest even on the float32 bits, NaN quieted
        b = ref.view(np.uint32).astype(np.uint64)
        want = np.where(np.isnan(ref), (b >> 16) | 0x40, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
        assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), want.astype(np.uint16))
    else:
        assert torch.equal(torch.signbit(got), torch.from_numpy(np.signbit(ref)))
        same = np.isnan(ref) | (got.numpy() == ref.astype(np_dtype))
        assert same.all(), (got, ref)


def test_cast_transpose_dequantize_block_on_gpu(tb):
    from fp8sim.scaling import quantize_scaled

    x = torch.from_numpy(random_values(1000 * 600, seed=3, spread=10.0)).reshape(1000, 600)
    codes, codes_t, _ = tb[0].cast_transpose(x.cuda(), "e4m3", 2.0, rounding="stochastic", seed=SEED)
    want = torch.from_numpy(fp8sim.encode(x.numpy() * np.float32(2.0), "e4m3", rounding="stochastic", seed=SEED))
    assert torch.equal(codes.cpu(), want) and torch.equal(codes_t.cpu(), want.t())
    vals = tb[0].dequantize(codes, "e4m3", 0.5, out_dtype=torch.bfloat16).cpu()
    ref = torch.from_numpy(fp8sim.decode(want.numpy(), "e4m3") * np.float32(0.5)).to(torch.bfloat16)
    assert torch.equal(vals.view(torch.int16), ref.view(torch.int16))
    for gran in ("block:1x128", "block:128x128", "mx", "mx:rceil", "col"):
        c, s, _ = tb[0].block_quantize(x.cuda(), "e4m3", gran)
        st = quantize_scaled(x.numpy(), "e4m3", gran)
        assert torch.equal(c.cpu(), torch.from_numpy(st.codes)), gran
        assert torch.equal(s.cpu(), torch.from_numpy(st.scale_inv)), gran


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e3m4", "e4m3fnuz")])
@pytest.mark.parametrize("native", [False, True])
def test_scaled_mm_on_gpu(tb, fmts, native):
    m, k, n = 257, 4096, 129
    rng = np.random.default_rng(5)
    def codes(fmt, shape):
        ok = np.flatnonzero(np.isfinite(decode_table(fmt, np.float64))).astype(np.uint8)
        return torch.from_numpy(ok[rng.integers(0, ok.size, shape)])
    a, b = codes(fmts[0], (m, k)), codes(fmts[1], (n, k)).t()
    sa = torch.from_numpy(rng.uniform(0.5, 2, (m, 1)).astype(np.float32))
    out = tb[int(native)].scaled_mm(a.cuda(), fmts[0], sa.cuda(), b.cuda(), fmts[1], 0.25).cpu()
    av = decode_table(fmts[0], np.float64)[a.numpy()]
    bv = decode_table(fmts[1], np.float64)[b.numpy()]
    ref = (av @ bv) * sa.numpy() * 0.25
    mag = (np.abs(av) @ np.abs(bv)) * sa.numpy() * 0.25
    # fp8 tensor cores add products with fewer than float32's bits (~14); the kernel adds each
    # 128-wide K slice in float32. Measured on an H200 at K = 4096: 2**-13.3 of sum |a||b| that
    # way, 2**-10.2 with fast_accum (all of K in the MMA). Float32 accumulation is (K+2)u.
    rel = 2.0**-12 if native and fmts[0] in ("e4m3", "e5m2") else (k + 2) * 2.0**-24
    assert np.all(np.abs(out.double().numpy() - ref) <= rel * mag + 2.0**-24 * np.abs(ref))
    if native and fmts[0] in ("e4m3", "e5m2"):  # fast_accum: the MMA's own adds, looser
        from fp8sim.kernels.scaled_mm import scaled_mm

        fast = scaled_mm(a.cuda(), fmts[0], sa.cuda(), b.cuda(), fmts[1], torch.tensor(0.25).cuda(),
                         fast_accum=True).cpu()
        assert np.all(np.abs(fast.double().numpy() - ref) <= 2.0**-9 * mag + 2.0**-24 * np.abs(ref))


def test_adam_on_gpu(tb):
    from fp8sim.backends import get

    rng = np.random.default_rng(9)
    shape = (513, 257)
    w = torch.from_numpy((rng.standard_normal(shape) * 20).astype(np.float16))
    g = torch.from_numpy((rng.standard_normal(shape) * 1e-3).astype(np.float32))
    m = torch.from_numpy(rng.integers(0, 0x7E, shape, dtype=np.uint8))
    v = torch.from_numpy((rng.random(shape) * 1e-2).astype(np.float16))
    for rounding in ("rne", "stochastic"):
        kw = dict(step=5, lr=1e-3, weight_decay=0.1, rounding=rounding,
                  seed=SEED if rounding == "stochastic" else None)
        gpu = [t.cuda() for t in (w, m, v)]
        cpu = [t.clone() for t in (w, m, v)]
        r1 = tb[0].adam_step(gpu[0], 1 / 1024, g.cuda(), gpu[1], 1 / 64, gpu[2], 1.0, **kw)
        r2 = get("emulator").adam_step(cpu[0], 1 / 1024, g, cpu[1], 1 / 64, cpu[2], 1.0, **kw)
        for a, b in zip(gpu, cpu):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), rounding
        for a, b in zip(r1, r2):
            assert torch.equal(a.cpu(), b), rounding


# -- NVFP4 quantize and the RHT --------------------------------------------------------------


def _bits32(a) -> np.ndarray:
    """float32 bits with every NaN as one pattern (a NaN's sign and payload are the device's)."""
    a = np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a, dtype=np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)


def _nvfp4_input(seed: int = 0) -> np.ndarray:
    from fp8sim.backends.cases import nvfp4_boundary_tiles

    x = random_values(1000 * 613, seed=seed, spread=30.0).reshape(1000, 613)  # ragged, odd
    x[1, 5], x[2, 40], x[3, 17], x[4, 3] = np.nan, np.inf, -np.inf, -0.0
    x[16:32, 16:32] = 0.0
    x[33, 0:16] = np.float32(1e-30)
    x[34, 0:16] = np.float32(2.0**-140) * np.arange(16)
    x[-32:, :96] = nvfp4_boundary_tiles("16x16", "te", grid=(2, 6), seed=seed)
    x[-48:-32, :96] = nvfp4_boundary_tiles("1x16", "torchao", grid=(16, 6), seed=seed)
    return x


@pytest.mark.parametrize("variant", ["te", "torchao", "torchao-block", "compressed-tensors"])
@pytest.mark.parametrize("layout", ["1x16", "16x1", "16x16"])
def test_nvfp4_quantize_on_gpu(layout, variant):
    from fp8sim.kernels.nvfp4_quantize import nvfp4_quantize
    from fp8sim.nvfp4 import pack_e2m1, quantize_nvfp4_2d

    x = _nvfp4_input(seed=len(layout))
    cases = [("rne", None, None), ("stochastic", SEED, None)]
    if variant == "te":
        cases.append(("rne", None, 2.5))  # a tensor amax below the data: saturation
    for rounding, seed, ga in cases:
        ref = quantize_nvfp4_2d(x, layout, variant, rounding=rounding, seed=seed, global_amax=ga)
        q = nvfp4_quantize(torch.from_numpy(x).cuda(), layout, variant, rounding=rounding,
                           seed=seed, global_amax=ga)
        assert torch.equal(q.codes.cpu(), torch.from_numpy(pack_e2m1(ref.codes))), rounding
        assert torch.equal(q.block_codes.cpu(), torch.from_numpy(ref.block_codes)), rounding
        assert np.array_equal(_bits32(q.block_scale), _bits32(ref.block_scale))
        assert np.array_equal(_bits32(q.block_amax), _bits32(ref.block_amax))
        assert _bits32(q.tensor_scale) == _bits32(ref.tensor_scale)
        assert _bits32(q.global_amax) == _bits32(ref.global_amax)


def test_nvfp4_dtypes_and_backend_on_gpu(tb):
    from fp8sim.backends import get
    from fp8sim.kernels.nvfp4_quantize import nvfp4_quantize
    from fp8sim.nvfp4 import quantize_nvfp4_2d

    x = torch.from_numpy(_nvfp4_input(seed=7))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        xd = x.to(dtype)
        ref = quantize_nvfp4_2d(xd.to(torch.float32).numpy(), "1x16", "te")
        q = nvfp4_quantize(xd.cuda(), "1x16", pack=False)
        assert torch.equal(q.codes.cpu(), torch.from_numpy(ref.codes)), dtype
        assert torch.equal(q.block_codes.cpu(), torch.from_numpy(ref.block_codes)), dtype
    for gran in ("nvfp4", "nvfp4:16x1", "nvfp4:2d:ct"):
        got = tb[0].block_quantize(x.cuda(), "e2m1", gran)
        want = get("emulator").block_quantize(x, "e2m1", gran)
        assert torch.equal(got[0].cpu(), want[0]), gran
        for a, b in zip(got[1:], want[1:]):
            assert np.array_equal(_bits32(a), _bits32(b)), gran


@pytest.mark.parametrize("inverse", [False, True])
def test_rht_on_gpu(tb, inverse):
    from fp8sim.hadamard import rht as rht_ref

    x = random_values(1024 * 528, seed=8, spread=60.0).reshape(1024, 528)  # overflow, subnormals
    x[0, 0], x[17, 3], x[33, 4], x[40, 5] = np.nan, np.inf, -np.inf, np.float32(1e-44)
    x[64:80, 6] = np.float32(3e38)
    xd = torch.from_numpy(x).cuda()
    for axis, signs in ((-1, "te"), (0, 99), (1, [1.0, -1.0] * 8)):
        got = tb[0].rht(xd, axis, signs, inverse=inverse)
        assert np.array_equal(_bits32(got), _bits32(rht_ref(x, axis, signs, inverse=inverse))), axis
    y = np.ascontiguousarray(x[:, :512]).reshape(4, 256, 512)
    got = tb[0].rht(torch.from_numpy(y).to(torch.bfloat16).cuda(), 1, 5, inverse=inverse)
    want = rht_ref(torch.from_numpy(y).to(torch.bfloat16).to(torch.float32).numpy(), 1, 5, inverse=inverse)
    assert np.array_equal(_bits32(got), _bits32(want))
