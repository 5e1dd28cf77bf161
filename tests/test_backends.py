"""Conformance of every backend against the emulator (codes compared with torch.equal).

One suite, parametrized over the backends. The expected codes come from ``fp8sim.encode`` called
here on ``float32(x) * float32(scale)``; GEMMs are checked against a float64 numpy product within
the float32 accumulation bound; the Adam step bit for bit against the emulator backend and, for
its meaning, against ``torch.optim.AdamW`` in float64. A backend that lacks a capability must
raise NotImplementedError (asserted, not skipped).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fp8sim
from fp8sim import backends
from fp8sim.backends.base import CastSpec
from fp8sim.backends.cases import edge_values, random_values
from fp8sim.backends.torch_backend import TORCH_DTYPES
from fp8sim.emulator import ROUNDING_MODES, decode_table

BACKEND_NAMES = ["emulator", "torch", "triton"]
FORMATS = ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e3m4", "e2m1", "e8m0", "fp16", "bf16"]
SEED = 20261202


def torch_supports(fmt: str, rounding: str, saturate: bool) -> bool:
    """What the torch backend promises (its module docstring)."""
    return fmt in TORCH_DTYPES and rounding == "rne" and (saturate or fmt != "e4m3")


def expect_codes(x: torch.Tensor, fmt, scale, **kw) -> torch.Tensor:
    """The oracle: ``encode(float32(x) * float32(scale))``, computed here with numpy."""
    xs = x.detach().float().numpy()
    s = scale.float().numpy() if isinstance(scale, torch.Tensor) else np.float32(scale)
    return torch.from_numpy(fp8sim.encode(xs * s, fmt, **kw))


def quantize_or_raise(be, x, fmt, scale, rounding, saturate, seed=None):
    """Run ``be.quantize``; returns codes, or None when the backend must not support it."""
    kw = dict(rounding=rounding, saturate=saturate, seed=seed)
    if be.name == "torch" and not torch_supports(fmt, rounding, saturate):
        with pytest.raises(NotImplementedError, match="torch backend"):
            be.quantize(x, fmt, scale, **kw)
        return None
    codes, scale_inv = be.quantize(x, fmt, scale, **kw)
    s32 = np.float32(scale)
    with np.errstate(divide="ignore"):  # scale 0: scale_inv inf
        assert scale_inv.dtype == torch.float32 and float(scale_inv) == float(np.float32(1) / s32)
    return codes


def _backend(name: str):
    if name == "triton":
        pytest.importorskip("triton")
        from fp8sim.kernels.cast import is_interpreter

        if not is_interpreter():  # CPU tensors need the interpreter; GPU: test_kernels_gpu.py
            pytest.skip("triton on CPU tensors needs TRITON_INTERPRET=1")
    return backends.get(name)


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def be(request):
    return _backend(request.param)


@pytest.fixture(scope="module", params=[n for n in BACKEND_NAMES if n != "emulator"])
def other_be(request):
    """A backend other than the emulator's, for tests whose expected value comes from the very
    code the emulator backend runs (it would be compared with itself)."""
    return _backend(request.param)


# -- quantize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("rounding", ROUNDING_MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_edge_values(be, fmt, rounding, saturate):
    """Every edge value of the format, every rounding mode, both overflow rules."""
    x = torch.from_numpy(edge_values(fmt))
    seed = SEED if rounding == "stochastic" else None
    f = fp8sim.get_format(fmt)
    if f.nan == "none":  # no NaN/inf codes: NaN (and overflow unless saturating) must raise
        kw = dict(rounding=rounding, saturate=saturate, seed=seed)
        if not (be.name == "torch"):
            with pytest.raises(ValueError, match="NaN"):
                be.quantize(x, fmt, 1.0, **kw)
        x = x[~torch.isnan(x)]
        if not saturate:
            x = x[x.abs() <= f.max]
    codes = quantize_or_raise(be, x, fmt, 1.0, rounding, saturate, seed)
    if codes is None:
        return
    want = expect_codes(x, fmt, 1.0, rounding=rounding, saturate=saturate, seed=seed)
    assert codes.dtype == want.dtype
    bad = codes != want
    assert torch.equal(codes, want), (x[bad][:8].tolist(), codes[bad][:8], want[bad][:8])


@pytest.mark.parametrize("fmt", ["e2m3", "e2m1"])
def test_quantize_overflow_without_inf_or_nan_raises(be, fmt):
    x = torch.tensor([1.0, 100.0, -3.0])
    if be.name == "torch":
        with pytest.raises(NotImplementedError):
            be.quantize(x, fmt, 1.0, saturate=False)
        return
    with pytest.raises(ValueError, match="overflow"):
        be.quantize(x, fmt, 1.0, saturate=False)
    codes, _ = be.quantize(x, fmt, 1.0, saturate=True)
    f = fp8sim.get_format(fmt)
    assert int(codes[1]) == f.max_code  # saturated to max


def _views():
    """(name, tensor) pairs: the shapes of the issue, plus non-contiguous views."""
    base = torch.from_numpy(random_values(257 * 31 * 2, seed=3, spread=6.0)).reshape(257, 62)
    return [
        ("1x1", base[:1, :1].contiguous()),
        ("3x130", base.reshape(-1)[: 3 * 130].reshape(3, 130).clone()),
        ("257x31", base[:, :31].contiguous()),
        ("257x31 strided", base[:, ::2]),
        ("31x257 transposed", base[:, 1::2].t()),
    ]


@pytest.mark.parametrize("view", range(5), ids=[n for n, _ in _views()])
@pytest.mark.parametrize("fmt,rounding", [("e4m3", "rne"), ("e5m2", "stochastic"), ("e4m3fnuz", "up")])
def test_quantize_shapes_and_views(be, view, fmt, rounding):
    x = _views()[view][1]
    seed = SEED if rounding == "stochastic" else None
    scale = 3.5
    codes = quantize_or_raise(be, x, fmt, scale, rounding, True, seed)
    if codes is None:
        return
    assert codes.shape == x.shape and codes.is_contiguous()
    assert torch.equal(codes, expect_codes(x, fmt, scale, rounding=rounding, seed=seed))


@pytest.mark.parametrize("kind", ["tensor0d", "row", "col"])
def test_quantize_scale_shapes(be, kind):
    x = torch.from_numpy(random_values(3 * 130, seed=5, spread=4.0)).reshape(3, 130)
    rng = np.random.default_rng(1)
    shape = {"tensor0d": (), "row": (3, 1), "col": (1, 130)}[kind]
    scale = torch.from_numpy(np.asarray(np.exp2(rng.integers(-3, 4, shape)) * 1.3, np.float32))
    codes, scale_inv = be.quantize(x, "e4m3", scale)
    assert scale_inv.shape == scale.shape
    assert torch.equal(scale_inv, 1 / scale)
    assert torch.equal(codes, expect_codes(x, "e4m3", scale))
    with pytest.raises(ValueError, match="shape"):
        be.quantize(x, "e4m3", torch.ones(130, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_quantize_input_dtypes(be, dtype):
    """x is cast to float32 first (exact for fp16/bf16, RNE for float64), then scaled."""
    x = torch.from_numpy(random_values(600, seed=7, spread=5.0)).to(dtype)
    codes, _ = be.quantize(x, "e5m2", 0.75)
    want = torch.from_numpy(fp8sim.encode(x.float().numpy() * np.float32(0.75), "e5m2"))
    assert torch.equal(codes, want)


def test_quantize_with_amax(be):
    x = torch.from_numpy(random_values(3 * 130, seed=11)).reshape(3, 130)
    x[1, 7] = -1e30
    codes, _, amax = be.quantize_with_amax(x, "e4m3", 2.0)
    assert amax.dtype == torch.float32 and amax.dim() == 0
    assert float(amax) == float(np.float32(1e30))
    assert torch.equal(codes, expect_codes(x, "e4m3", 2.0))


def test_bad_arguments(be):
    x = torch.ones(4)
    with pytest.raises(ValueError, match="rounding"):
        be.quantize(x, "e4m3", 1.0, rounding="nearest")
    with pytest.raises(ValueError, match="seed"):
        be.quantize(x, "e4m3", 1.0, rounding="stochastic")
    with pytest.raises(ValueError, match="unknown format"):
        be.quantize(x, "e9m9x", 1.0)
    with pytest.raises(TypeError):
        be.quantize(torch.ones(4, dtype=torch.int32), "e4m3", 1.0)


# -- amax -------------------------------------------------------------------------------------


def test_amax(be):
    x = torch.from_numpy(random_values(257 * 31, seed=2)).reshape(257, 31)
    assert float(be.amax(x)) == float(np.abs(x.numpy()).max())
    assert float(be.amax(x[:, ::3])) == float(np.abs(x.numpy()[:, ::3]).max())
    y = x.clone()
    y[100, 3] = float("-inf")
    assert float(be.amax(y)) == float("inf")
    y[5, 5] = float("nan")
    assert torch.isnan(be.amax(y))
    assert float(be.amax(torch.zeros(0))) == 0.0
    assert float(be.amax(-torch.zeros(3, 3))) == 0.0
    for i in (0, 1000, x.numel() - 1):  # one NaN anywhere (vector body or tail) poisons amax
        z = x.clone().reshape(-1)
        z[i] = float("nan")
        assert torch.isnan(be.amax(z))
    assert float(be.amax(-torch.full((70,), 3.0, dtype=torch.bfloat16))) == 3.0


# -- dequantize -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # e8m0 -> float16: inf
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "e3m4", "e2m1", "e8m0"])
def test_dequantize_every_code(be, fmt, out_dtype):
    f = fp8sim.get_format(fmt)
    codes = torch.arange(f.num_codes, dtype=torch.int32).to(torch.uint8).reshape(1, -1)
    scale_inv = np.float32(0.3)
    want = torch.from_numpy(decode_table(f, np.float32) * scale_inv).to(out_dtype).reshape(1, -1)
    got = be.dequantize(codes, fmt, float(scale_inv), out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == codes.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "e3m4"])
def test_decode_every_code_in_memory_order(be, fmt):
    """``decode``: exact float32 values (-0.0 included; NaN where the table has NaN); a
    transposed view of contiguous codes comes back as the transposed view of the values."""
    f = fp8sim.get_format(fmt)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    want = torch.from_numpy(decode_table(f, np.float32)[codes.numpy().astype(np.int64)])
    for c, w in ((codes, want), (codes.t(), want.t())):
        got = be.decode(c, fmt)
        assert got.dtype == torch.float32 and got.stride() == c.stride()
        nan = torch.isnan(w)
        assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], w[~nan])
        assert torch.equal(torch.signbit(got[~nan]), torch.signbit(w[~nan]))


def test_dequantize_strided_and_rowwise(be):
    rng = np.random.default_rng(4)
    codes = torch.from_numpy(rng.integers(0, 0x7E, (257, 62), dtype=np.uint8))
    view = codes[:, ::2]
    sinv = torch.from_numpy(rng.uniform(0.5, 2, (257, 1)).astype(np.float32))
    got = be.dequantize(view, "e4m3", sinv)
    want = fp8sim.decode(view.contiguous().numpy(), "e4m3") * sinv.numpy()
    assert torch.equal(got, torch.from_numpy(want))


# -- cast-transpose ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (257, 31)])
def test_cast_transpose(be, shape):
    x = torch.from_numpy(random_values(shape[0] * shape[1], seed=9, spread=8)).reshape(shape)
    rounding = "rne" if be.name == "torch" else "stochastic"
    seed = None if be.name == "torch" else SEED
    codes, codes_t, scale_inv = be.cast_transpose(x, "e4m3", 1.25, rounding=rounding, seed=seed)
    want = expect_codes(x, "e4m3", 1.25, rounding=rounding, seed=seed)
    assert torch.equal(codes, want)
    assert codes_t.is_contiguous() and torch.equal(codes_t, want.t())
    assert float(scale_inv) == float(np.float32(1) / np.float32(1.25))


# -- block / MX scaling ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter numpy
@pytest.mark.parametrize("gran,rounding", [("block:1x32", "rne"), ("block:16x16", "up"), ("mx", "rne"),
                                           ("mx:rceil", "rne"), ("mx:rceil", "stochastic"), ("row", "rne"),
                                           ("col", "rne")])
def test_block_quantize(other_be, gran, rounding):
    """Against ``fp8sim.scaling.quantize_scaled`` (the emulator backend's own implementation,
    tested against a blockwise reference in test_scaling.py)."""
    from fp8sim.scaling import quantize_scaled

    be = other_be
    x = torch.from_numpy(random_values(3 * 130, seed=12, spread=10)).reshape(3, 130)
    x[1, 5] = float("nan")
    seed = SEED if rounding == "stochastic" else None
    if be.name == "torch" and rounding != "rne":
        with pytest.raises(NotImplementedError, match="torch backend"):  # a rounding torch lacks
            be.block_quantize(x, "e4m3", gran, rounding=rounding, seed=seed)
        return
    codes, scale_inv, amax = be.block_quantize(x, "e4m3", gran, rounding=rounding, seed=seed)
    st = quantize_scaled(x.numpy(), "e4m3", gran, rounding=rounding, seed=seed)
    assert torch.equal(codes, torch.from_numpy(st.codes))
    want = torch.from_numpy(st.scale_inv)
    assert torch.equal(torch.isnan(scale_inv), torch.isnan(want))
    assert torch.equal(scale_inv.nan_to_num(-1.0), want.nan_to_num(-1.0))
    assert torch.equal(amax.nan_to_num(-1.0), torch.from_numpy(st.amax).nan_to_num(-1.0))


@pytest.mark.parametrize("gran", ["block:1x128", "block:128x128", "block:3x5", "row", "mx", "mx:rceil"])
@pytest.mark.parametrize("fmt,pow2,epsilon", [("e4m3", True, 0.0), ("e5m2", False, 0.0), ("e4m3", False, 1e-3)])
def test_torch_block_quantize_matches_scaling(gran, fmt, pow2, epsilon):
    """Transformer Engine's Float8BlockScaling grid (pow2 scales, epsilon) on ragged shapes with
    NaN, inf and an all-zero block, against ``fp8sim.scaling.quantize_scaled``."""
    from fp8sim.backends.torch_backend import TorchBackend
    from fp8sim.scaling import quantize_scaled

    x = torch.from_numpy(random_values(150 * 200, seed=21, spread=12)).reshape(150, 200)
    x[3, 7], x[140, 190], x[0, :] = float("nan"), float("inf"), 0.0
    rule = {} if gran.startswith("mx") else {"pow2": pow2, "epsilon": epsilon}
    codes, scale_inv, amax = TorchBackend().block_quantize(x, fmt, gran, **rule)
    st = quantize_scaled(x.numpy(), fmt, gran, **rule)
    assert torch.equal(codes, torch.from_numpy(st.codes))
    assert torch.equal(scale_inv.nan_to_num(-1.0), torch.from_numpy(st.scale_inv).nan_to_num(-1.0))
    assert torch.equal(amax.nan_to_num(-1.0), torch.from_numpy(st.amax).nan_to_num(-1.0))
    with pytest.raises(NotImplementedError, match="torch backend"):
        TorchBackend().block_quantize(x, "e2m3", gran)


def test_nvfp4_quantize_and_rht_through_the_backends():
    from fp8sim.backends.emulator import EmulatorBackend
    from fp8sim.backends.torch_backend import TorchBackend
    from fp8sim.hadamard import rht
    from fp8sim.nvfp4 import quantize_nvfp4_2d

    x = torch.from_numpy(random_values(24 * 40, seed=23, spread=6)).reshape(24, 40)
    x[5, 5] = float("nan")
    be = EmulatorBackend()
    for layout, rounding, seed in (("1x16", "rne", None), ("16x16", "stochastic", 9), ("16x1", "rne", None)):
        codes, bscale, tscale, gamax = be.nvfp4_quantize(x, layout, rounding=rounding, seed=seed)
        p = quantize_nvfp4_2d(x.numpy(), layout, rounding=rounding, seed=seed)
        assert torch.equal(codes, torch.from_numpy(p.codes))
        assert torch.equal(bscale.nan_to_num(-1.0), torch.from_numpy(p.block_scale).nan_to_num(-1.0))
        assert float(tscale) == float(p.tensor_scale) and float(gamax) == float(p.global_amax)
    y = torch.from_numpy(random_values(3 * 32, seed=24, spread=6)).reshape(3, 32)
    assert torch.equal(be.rht(y), torch.from_numpy(rht(y.numpy(), -1, "te")))
    with pytest.raises(ValueError, match="multiple of 16"):
        be.rht(x[:, :20])
    with pytest.raises(NotImplementedError, match="torch backend: NVFP4"):
        TorchBackend().nvfp4_quantize(x)
    with pytest.raises(NotImplementedError, match="torch backend"):
        TorchBackend().rht(y)
    assert be.has_nvfp4 and not TorchBackend().has_nvfp4


# -- scaled GEMM ------------------------------------------------------------------------------


def finite_codes(fmt: str, shape, rng) -> torch.Tensor:
    """Random codes of finite values (no NaN/inf codes)."""
    table = decode_table(fmt, np.float64)
    ok = np.flatnonzero(np.isfinite(table)).astype(np.uint8)
    return torch.from_numpy(ok[rng.integers(0, ok.size, shape)])


def gemm_reference(a, a_fmt, sa, b, b_fmt, sb):
    """float64 reference and the float32 accumulation error bound for each output element."""
    av = decode_table(a_fmt, np.float64)[a.numpy().astype(np.int64)]
    bv = decode_table(b_fmt, np.float64)[b.numpy().astype(np.int64)]
    sa, sb = np.asarray(sa, np.float64), np.asarray(sb, np.float64)
    ref = (av @ bv) * sa * sb
    k = a.shape[1]
    u = 2.0**-24
    bound = (k + 2) * u * (np.abs(av) @ np.abs(bv)) * np.abs(sa * sb) + 2.0**-149
    return ref, bound


@pytest.mark.parametrize("scales", ["tensor", "rowcol"])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (3, 130, 31), (33, 64, 17)])
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e3m4")])
def test_scaled_mm(be, mkn, fmts, scales):
    m, k, n = mkn
    rng = np.random.default_rng(m * 1000 + k + n)
    a = finite_codes(fmts[0], (m, k), rng)
    b_nk = finite_codes(fmts[1], (n, k), rng)
    b = b_nk.t()  # non-contiguous (K, N) view, as a linear layer passes W^T
    if scales == "tensor":
        sa, sb = torch.tensor(0.37), torch.tensor(2.5)
    else:
        sa = torch.from_numpy(rng.uniform(0.1, 4, (m, 1)).astype(np.float32))
        sb = torch.from_numpy(rng.uniform(0.1, 4, (1, n)).astype(np.float32))
    ref, bound = gemm_reference(a, fmts[0], sa.numpy(), b, fmts[1], sb.numpy())
    got = be.scaled_mm(a, fmts[0], sa, b, fmts[1], sb)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    err = np.abs(got.double().numpy() - ref)
    assert np.all(err <= bound + 2.0**-24 * np.abs(ref)), float((err - bound).max())


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_scaled_mm_accumulate_modes(fmts):
    """float64: exact products summed exactly (E4M3 x E4M3 sums fit 53 bits for K <= 2**17;
    E5M2 codes kept within 2**-6..2**6 so they do too), scaled in float64, rounded once.
    float32: ``torch.mm`` of the exactly decoded float32 operands (in the codes' memory order)
    times ``float32(sa * sb)``. Both bit for bit, and the same in both backends."""
    rng = np.random.default_rng(11)
    m, k, n = 37, 200, 29
    a = finite_codes(fmts[0], (m, k), rng)
    if fmts[0] == "e5m2":
        a = torch.where(((a & 0x7F) < 0x24) | ((a & 0x7F) > 0x54), a & 0x80 | 0x3C, a)
    b = finite_codes(fmts[1], (n, k), rng).t()  # W^T: a transposed view
    sa = torch.from_numpy(rng.uniform(0.1, 4, (m, 1)).astype(np.float32))
    sb = torch.tensor(0.37)
    av = decode_table(fmts[0], np.float64)[a.numpy().astype(np.int64)]
    bv = decode_table(fmts[1], np.float64)[b.numpy().astype(np.int64)]
    want64 = torch.from_numpy(((av @ bv) * sa.double().numpy() * float(sb)).astype(np.float32))
    # torch.mm sees the codes' layout: a row-major, b the transpose of a row-major (n, k)
    a32, b32 = torch.from_numpy(av.astype(np.float32)), torch.from_numpy(bv.T.astype(np.float32).copy()).t()
    want32 = torch.mm(a32, b32) * (sa * sb)
    assert not torch.equal(want32, want64)  # the two arithmetics do differ on this data
    for name in ("emulator", "torch"):
        be = backends.get(name)
        assert be.gemm_accumulations == ("float64", "float32")
        assert torch.equal(be.scaled_mm(a, fmts[0], sa, b, fmts[1], sb), want64)
        assert torch.equal(be.scaled_mm(a, fmts[0], sa, b, fmts[1], sb, accumulate="float64"), want64)
        assert torch.equal(be.scaled_mm(a, fmts[0], sa, b, fmts[1], sb, accumulate="float32"), want32)
        with pytest.raises(ValueError, match="accumulate"):
            be.scaled_mm(a, fmts[0], sa, b, fmts[1], sb, accumulate="float16")


def test_scaled_mm_out_dtype_and_errors(be):
    rng = np.random.default_rng(8)
    a, b = finite_codes("e4m3", (16, 32), rng), finite_codes("e4m3", (32, 16), rng)
    ref, bound = gemm_reference(a, "e4m3", 0.5, b, "e4m3", 0.25)
    got = be.scaled_mm(a, "e4m3", 0.5, b, "e4m3", 0.25, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    err = np.abs(got.double().numpy() - ref)
    assert np.all(err <= bound + 2.0**-8 * np.abs(ref))
    with pytest.raises(ValueError, match="scaled_mm"):
        be.scaled_mm(a, "e4m3", 1.0, a, "e4m3", 1.0)
    with pytest.raises(ValueError, match="b_scale_inv"):
        be.scaled_mm(a, "e4m3", 1.0, b, "e4m3", torch.ones(16, 1))


# -- fused FP8-LM Adam ------------------------------------------------------------------------


def adam_state(shape, seed):
    """(param fp16, grad, exp_avg codes, exp_avg_sq fp16) and their scale_invs."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    g = (rng.standard_normal(shape) * 1e-3).astype(np.float32)
    m = (rng.standard_normal(shape) * 1e-3).astype(np.float32)
    v = (rng.standard_normal(shape) * 1e-3).astype(np.float32) ** 2
    ws, ms, vs = np.float32(1024.0), np.float32(2.0**14), np.float32(2.0**20)
    param = torch.from_numpy(fp8sim.encode(w * ws, "fp16").view(np.float16))
    exp_avg = torch.from_numpy(fp8sim.encode(m * ms, "e4m3"))
    exp_avg_sq = torch.from_numpy(fp8sim.encode(v * vs, "fp16").view(np.float16))
    return torch.from_numpy(g), param, exp_avg, exp_avg_sq, (1 / ws, 1 / ms, 1 / vs)


@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (257, 31)])
def test_adam_step_matches_emulator(other_be, shape, rounding):
    """Against the emulator backend (itself checked against torch's AdamW below)."""
    be = other_be
    grad, param, exp_avg, exp_avg_sq, (wsi, msi, vsi) = adam_state(shape, 3)
    ref_state = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    kw = dict(step=3, lr=1e-3, weight_decay=0.1, exp_avg_scale=2.0**13, param_scale=512.0,
              rounding=rounding, seed=SEED if rounding == "stochastic" else None)
    if be.name == "torch" and rounding != "rne":
        with pytest.raises(NotImplementedError):
            be.adam_step(param, wsi, grad, exp_avg, msi, exp_avg_sq, vsi, **kw)
        return
    res = be.adam_step(param, wsi, grad, exp_avg, msi, exp_avg_sq, vsi, **kw)
    want = backends.get("emulator").adam_step(ref_state[0], wsi, grad, ref_state[1], msi,
                                              ref_state[2], vsi, **kw)
    assert torch.equal(param.view(torch.int16), ref_state[0].view(torch.int16))
    assert torch.equal(exp_avg, ref_state[1])
    assert torch.equal(exp_avg_sq.view(torch.int16), ref_state[2].view(torch.int16))
    for got, exp in zip(res, want):
        assert got.dtype == torch.float32 and torch.equal(got.cpu(), exp.cpu())
    assert float(res.exp_avg_scale_inv) == 2.0**-13 and float(res.param_scale_inv) == 2.0**-9
    assert float(res.exp_avg_sq_scale_inv) == float(vsi)  # default: keep the scale


def test_adam_step_agrees_with_torch_adamw():
    """Meaning check: from zero moments, the FP8-LM step equals AdamW up to the storage rounding."""
    shape = (64, 32)
    grad, param, exp_avg, exp_avg_sq, (wsi, msi, vsi) = adam_state(shape, 5)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    w0 = param.double() * float(wsi)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    p.grad = grad.double()
    opt.step()
    res = backends.get("emulator").adam_step(
        param, wsi, grad, exp_avg, msi, exp_avg_sq, vsi, step=1, lr=1e-3, weight_decay=0.1
    )
    w1 = param.double() * float(wsi)
    # fp16 storage of w * 1024 (|w| < 0.2): half an fp16 ulp of 2^7..2^8 is 2^-4, i.e. 2^-14 in w
    assert torch.allclose(w1, p.detach(), rtol=0, atol=2.0**-13)
    m = torch.from_numpy(fp8sim.decode(exp_avg.numpy(), "e4m3")).double() * float(msi)
    assert torch.allclose(m, opt.state[p]["exp_avg"], rtol=2.0**-4, atol=2.0**-9 * float(msi))
    assert float(res.param_amax) == pytest.approx(float(p.detach().abs().max()), abs=2.0**-13)


# -- registry ---------------------------------------------------------------------------------


def test_get():
    assert backends.get("emulator") is backends.get(" Emulator ")
    with pytest.raises(ValueError, match="valid: emulator, torch, triton"):
        backends.get("cuda")
    with pytest.raises(TypeError):
        backends.get(3)


@pytest.mark.parametrize("scale", [0.0, float("inf")])
@pytest.mark.parametrize("fmt", ["e5m2", "bf16", "e4m3"])
def test_nan_made_by_the_scale_is_canonical(be, fmt, scale):
    """x * scale can be NaN although x is not (inf * 0, 0 * inf): the codes must
    still be the format's canonical NaN, as the emulator writes them."""
    x = torch.tensor([float("inf"), float("-inf"), 1.0, 0.0, -2.0])
    codes = quantize_or_raise(be, x, fmt, scale, "rne", True) if be.name != "torch" or \
        torch_supports(fmt, "rne", True) else None
    if codes is None:
        return
    with np.errstate(invalid="ignore"):
        want = expect_codes(x, fmt, scale)
    assert torch.equal(codes, want)


def test_cast_spec_checks_once():
    """One record holds a cast's arguments; the checks every backend relies on live in it."""
    spec = CastSpec("e4m3", "stochastic", True, seed=5, srbits=12)
    assert spec.fmt == fp8sim.get_format("e4m3") and spec.encode_kwargs() == dict(
        rounding="stochastic", saturate=True, seed=5, srbits=12)
    with pytest.raises(ValueError, match="unknown rounding"):
        CastSpec("e4m3", "nearest")
    with pytest.raises(ValueError, match="needs seed"):
        CastSpec("e4m3", "stochastic")
    with pytest.raises(ValueError, match="seed= is for"):
        CastSpec("e4m3", "rne", seed=1)
    with pytest.raises(ValueError, match="srbits= is for"):
        CastSpec("e4m3", "rne", srbits=8)
    for bad in (0, 33, True, 2.0):
        with pytest.raises(ValueError, match="srbits must be"):
            CastSpec("e4m3", "stochastic", seed=1, srbits=bad)
    with pytest.raises(TypeError, match="saturate"):
        CastSpec("e4m3", saturate="yes")
    with pytest.raises(ValueError):
        CastSpec("e9m9x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 6


def test_backends_reject_what_cast_spec_rejects(be):
    x = torch.ones(4, 4)
    for call in (be.quantize, be.cast_transpose):
        with pytest.raises(ValueError, match="srbits= is for"):
            call(x, "e4m3", 1.0, srbits=8)
    with pytest.raises(ValueError, match="srbits must be"):
        be.block_quantize(x, "e4m3", "block:1x4", rounding="stochastic", seed=1, srbits=40)
