"""NVFP4 (fp8sim.nvfp4 through quantize_scaled / dequantize / gemm) against independent sources:
torchao 0.18 and compressed-tensors 0.20 (committed vectors, tests/vectors/make_nvfp4_vectors.py),
ml_dtypes for every E4M3 / E2M1 rounding, and cases derived by hand from Transformer Engine's
reference quantizer and NVIDIA's NVFP4 paper (arXiv 2509.25149)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fp8sim.gemm import gemm
from fp8sim.nvfp4 import (block_decode_scale, gemm_alpha, pack_e2m1, quantize_nvfp4_2d,
                          tensor_scale_for, unpack_e2m1)
from fp8sim.scaling import dequantize, parse_granularity, quantize_scaled

VECTORS = Path(__file__).parent / "vectors" / "nvfp4_reference.npz"
F32 = np.float32
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (a.view(np.uint32) == b.view(np.uint32))))


# -- torchao and compressed-tensors, bit for bit -------------------------------------------------

_DATA = np.load(VECTORS)
_CASES = sorted({k.split("/")[0] for k in _DATA.files if "/" in k})


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("lib", ["torchao", "torchao-block", "compressed-tensors"])
def test_matches_reference_library(case, lib):
    x = _DATA[f"{case}/x"]
    st = quantize_scaled(x, "e2m1", f"nvfp4:{lib}")
    ref_scales = _DATA[f"{case}/{lib}/scale_codes"]
    ref_deq = _DATA[f"{case}/{lib}/dequantized"]
    assert bits_equal(st.tensor_scale, _DATA[f"{case}/{lib}/tensor_scale"])
    if case == "zeros" and lib == "torchao":
        # torchao: P = 0, every block scale (0/6)/0 = NaN; fp8sim keeps NaN scales, codes 0
        assert np.isnan(ref_deq).all() and np.isnan(dequantize(st)).all()
        assert np.isnan(st.scale_inv).all() and (st.scale_inv_codes == 0x7F).all()
        assert (ref_scales & 0x7F == 0x7F).all()  # torchao's is the negative NaN 0xFF
        return
    np.testing.assert_array_equal(pack_e2m1(st.codes), _DATA[f"{case}/{lib}/packed"])
    np.testing.assert_array_equal(st.scale_inv_codes, ref_scales)
    assert bits_equal(dequantize(st), ref_deq)


def test_vectors_record_their_sources():
    assert "torchao 0.18" in str(_DATA["versions"]) and "compressed-tensors" in str(_DATA["versions"])


# -- Transformer Engine's rules, derived by hand -------------------------------------------------


def test_te_block_at_full_range_is_scale_448_and_plain_e2m1():
    # tensor amax 6 * 448 = 2688: S = 2688/2688 = 1, the block's E4M3 scale is 448 (code 0x7E)
    # and every element is x / 448 on the E2M1 grid, ties to even (2.5 -> 2, 5 -> 4, 0.25 -> 0)
    y = F32([6, 3, 1.5, 0, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, 0.5, 4])
    st = quantize_scaled((y * F32(448)).reshape(1, 16), "e2m1", "nvfp4")
    assert st.global_amax == 2688 and st.tensor_scale == 2688
    assert st.scale_inv_codes.tolist() == [[0x7E]] and st.scale_inv[0, 0] == 448
    want = [6, 3, 1.5, 0, -6, 0, 1, 1, 2, 2, 4, 4, -0.0, -4, 0.5, 4]
    np.testing.assert_array_equal(dequantize(st)[0] / 448, want)  # (448*2688)*(1/2688) = 448


def test_te_zero_tensor_uses_scale_one():
    st = quantize_scaled(np.zeros((2, 32), F32), "e2m1", "nvfp4")
    assert st.global_amax == 0 and (st.scale_inv == 0).all() and (st.codes == 0).all()
    assert (dequantize(st) == 0).all()


def test_tiny_block_scale_te_underflows_torchao_clamps():
    # tensor amax 2688 -> S = 1; a block of amax 2688 * 2**-20 wants scale 448 * 2**-20, under
    # half of E4M3's smallest subnormal 2**-9: TE rounds it to 0 (the block decodes to 0),
    # torchao clamps it up to E4M3's smallest normal 2**-6 (code 0x08)
    x = np.zeros((2, 16), F32)
    x[0, 0] = 2688
    x[1, :] = F32(2688 * 2.0**-20)
    te = quantize_scaled(x, "e2m1", "nvfp4")
    assert te.scale_inv[1, 0] == 0 and (dequantize(te)[1] == 0).all()
    ao = quantize_scaled(x, "e2m1", "nvfp4:torchao")
    assert ao.scale_inv_codes[1, 0] == 0x08
    # block scale 2**-6 * P, P = 1: y = x / 2**-6 = 2688 * 2**-14 = 0.164 -> 0
    assert (dequantize(ao)[1] == 0).all()


def test_te_subnormal_block_scale():
    # block amax 2688 * 3 * 2**-9 / 448 -> scale = 3 * 2**-9, an E4M3 subnormal (code 0x03)
    x = np.zeros((2, 16), F32)
    x[0, 0] = 2688
    x[1, 0] = F32(6 * 3 * 2.0**-9)
    st = quantize_scaled(x, "e2m1", "nvfp4")
    assert st.scale_inv_codes[1, 0] == 0x03
    assert dequantize(st)[1, 0] == F32(6 * 3 * 2.0**-9)


def test_te_given_global_amax_saturates():
    # a delayed amax half the true one: blocks at the top saturate at E4M3 448 and E2M1 6
    x = np.linspace(-100, 100, 32, dtype=F32).reshape(1, 32)
    st = quantize_scaled(x, "e2m1", "nvfp4", global_amax=50.0)
    assert st.global_amax == 50 and st.scale_inv.max() == 448
    assert dequantize(st).max() == pytest.approx(50, rel=1e-6)


def test_te_rounding_steps_against_ml_dtypes():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((40, 48)) * np.exp2(rng.uniform(-12, 12, (40, 1)))).astype(F32)
    p = quantize_nvfp4_2d(x, (1, 16), "te")
    amax = F32(np.abs(x).max())
    s = F32(F32(2688) / amax)
    d = np.abs(x).reshape(40, 3, 16).max(-1) * F32(s * F32(1 / 6))
    b = d.astype(ml_dtypes.float8_e4m3fn)  # RNE, and nothing reaches 464 here
    assert bits_equal(p.block_scale, b.astype(F32))
    with np.errstate(divide="ignore"):  # a block scale that rounded to 0: r = float32 max
        r = np.minimum(F32(1) / (b.astype(F32) * F32(F32(1) / s)), np.finfo(F32).max)
    y = (x.reshape(40, 3, 16) * r[..., None]).reshape(40, 48)
    e = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    np.testing.assert_array_equal(e, np.asarray(dequantize_codes(p.codes)))


def dequantize_codes(codes):
    v = E2M1_GRID[codes & 7]
    return np.where(codes & 8, -v, v).astype(F32)


def test_te_decode_is_amax_times_reciprocal_2688():
    b = F32([448, 3, 0.0625])
    got = block_decode_scale(b, F32(7.5), "te")
    want = (b * F32(7.5)).astype(F32) * F32(1 / 2688)
    assert bits_equal(got, want)
    assert tensor_scale_for(0, "compressed-tensors") == 1  # 2688 / 2**-126 overflows -> 1


# -- layouts, edges, NaN -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["te", "torchao", "compressed-tensors"])
def test_column_blocks_are_row_blocks_of_the_transpose(variant):
    x = np.random.default_rng(2).standard_normal((48, 20)).astype(F32)
    col = quantize_scaled(x, "e2m1", f"nvfp4:16x1:{variant}")
    row = quantize_scaled(np.ascontiguousarray(x.T), "e2m1", f"nvfp4:{variant}")
    np.testing.assert_array_equal(col.codes, row.codes.T)
    np.testing.assert_array_equal(col.scale_inv, row.scale_inv.T)
    assert col.scale_inv.shape == (3, 20)


def test_2d_weight_blocks_give_one_quantized_weight_both_ways():
    w = np.random.default_rng(3).standard_normal((40, 56)).astype(F32)
    a = dequantize(quantize_scaled(w, "e2m1", "nvfp4:2d"))
    b = dequantize(quantize_scaled(np.ascontiguousarray(w.T), "e2m1", "nvfp4:2d"))
    assert bits_equal(a, b.T)
    st = quantize_scaled(w, "e2m1", "nvfp4:2d")
    assert st.scale_inv.shape == (3, 4)
    np.testing.assert_array_equal(st.amax[2, 3], np.abs(w[32:, 48:]).max())


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:16x1", "nvfp4:2d", "nvfp4:torchao"])
def test_ragged_edges_equal_zero_padding(spec):
    x = np.random.default_rng(4).standard_normal((21, 37)).astype(F32)
    pad = np.zeros((32, 48), F32)
    pad[:21, :37] = x
    st, sp = quantize_scaled(x, "e2m1", spec), quantize_scaled(pad, "e2m1", spec)
    np.testing.assert_array_equal(st.codes, sp.codes[:21, :37])
    np.testing.assert_array_equal(st.scale_inv, sp.scale_inv[: st.scale_inv.shape[0], : st.scale_inv.shape[1]])
    assert bits_equal(dequantize(st), dequantize(sp)[:21, :37])


def test_nan_block_is_nan_and_others_are_untouched():
    x = np.random.default_rng(5).standard_normal((2, 48)).astype(F32)
    clean = quantize_scaled(x, "e2m1", "nvfp4")
    x[1, 20] = np.nan
    st = quantize_scaled(x, "e2m1", "nvfp4")
    assert st.nan_count == 1 and st.scale_inv_codes[1, 1] == 0x7F
    assert (st.codes[1, 16:32] == 0).all()
    d = dequantize(st)
    assert np.isnan(d[1, 16:32]).all() and not np.isnan(np.delete(d, np.s_[16:32], 1)).any()
    mask = np.ones_like(x, bool)
    mask[1, 16:32] = False
    # the NaN left the tensor amax alone: every other block is as before
    np.testing.assert_array_equal(st.codes[mask], clean.codes[mask])


def test_torch_input_and_3d_shapes():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    st = quantize_scaled(x, "e2m1", "nvfp4")
    ref = quantize_scaled(x.float().numpy(), "e2m1", "nvfp4")
    assert st.codes.shape == (2, 3, 32) and st.scale_inv.shape == (6, 2)
    np.testing.assert_array_equal(st.codes, ref.codes)


# -- stochastic rounding, packing ----------------------------------------------------------------


def test_stochastic_rounding_uses_the_emulator_stream_and_is_unbiased():
    x = np.random.default_rng(6).standard_normal((8, 64)).astype(F32)
    rne = quantize_scaled(x, "e2m1", "nvfp4")
    sr = quantize_scaled(x, "e2m1", "nvfp4", rounding="stochastic", seed=7)
    np.testing.assert_array_equal(sr.scale_inv, rne.scale_inv)  # scales always RNE
    assert 0 < (sr.codes != rne.codes).mean() < 0.6
    again = quantize_scaled(x, "e2m1", "nvfp4", rounding="stochastic", seed=7)
    np.testing.assert_array_equal(again.codes, sr.codes)
    mean = np.mean([dequantize(quantize_scaled(x, "e2m1", "nvfp4", rounding="stochastic",
                                               seed=s)) for s in range(300)], axis=0)  # fmt: skip
    step = np.repeat(rne.scale_inv, 16, axis=1) * F32(rne.global_amax / 2688) * 2  # top grid gap
    assert np.all(np.abs(mean - x) < 0.2 * step)


def test_packing_order_low_nibble_first():
    assert pack_e2m1(np.array([1, 2], np.uint8)).tolist() == [0x21]
    assert pack_e2m1(np.array([[0xF, 0x1, 0x7]], np.uint8)).tolist() == [[0x1F, 0x07]]
    c = np.random.default_rng(8).integers(0, 16, (5, 34)).astype(np.uint8)
    np.testing.assert_array_equal(unpack_e2m1(pack_e2m1(c), 34), c)
    with pytest.raises(ValueError, match="0..15"):
        pack_e2m1(np.array([16]))


# -- GEMM ------------------------------------------------------------------------------------------


def test_nvfp4_gemm_matches_te_reference_loop():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((12, 64)).astype(F32)
    w = (rng.standard_normal((64, 24)) * 3).astype(F32)
    a = quantize_scaled(x, "e2m1", "nvfp4")
    b = quantize_scaled(w, "e2m1", "nvfp4:16x1")
    got = gemm(a, b)
    # Transformer Engine's reference qgemm: per 16-block, y += outer(sx, sw) * (qx @ qw) in
    # float32, then y *= (amax_x * amax_w) / (6 * 6 * 448 * 448)
    qa, qb = dequantize_codes(a.codes), dequantize_codes(b.codes)
    y = np.zeros((12, 24), F32)
    for k in range(4):
        part = (qa[:, 16 * k : 16 * k + 16] @ qb[16 * k : 16 * k + 16]).astype(F32)
        y = (y + np.outer(a.scale_inv[:, k], b.scale_inv[k]).astype(F32) * part).astype(F32)
    alpha = F32(F32(a.global_amax * b.global_amax) / F32(7225344))
    assert alpha == gemm_alpha(a.tensor_scale, b.tensor_scale, "te")
    assert bits_equal(got, (y * alpha).astype(F32))
    ref = dequantize(a).astype(np.float64) @ dequantize(b).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("variant", ["torchao", "compressed-tensors"])
def test_nvfp4_gemm_other_variants_match_dequantized_product(variant):
    rng = np.random.default_rng(10)
    a = quantize_scaled(rng.standard_normal((8, 32)).astype(F32), "e2m1", f"nvfp4:{variant}")
    b = quantize_scaled(rng.standard_normal((32, 16)).astype(F32), "e2m1", f"nvfp4:2d:{variant}")
    ref = dequantize(a).astype(np.float64) @ dequantize(b).astype(np.float64)
    np.testing.assert_allclose(gemm(a, b), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_nvfp4_gemm_rejects_mixed_or_misaligned_operands():
    x = np.ones((16, 32), F32)
    a = quantize_scaled(x, "e2m1", "nvfp4")
    with pytest.raises(ValueError, match="along K"):
        gemm(a, quantize_scaled(np.ones((32, 16), F32), "e2m1", "nvfp4"))
    with pytest.raises(ValueError, match="one variant"):
        gemm(a, quantize_scaled(np.ones((32, 16), F32), "e2m1", "nvfp4:16x1:torchao"))


# -- API edges -------------------------------------------------------------------------------------


def test_granularity_spellings():
    assert parse_granularity("nvfp4").spec == "nvfp4"
    assert parse_granularity("NVFP4:16x16").spec == "nvfp4:2d"
    assert parse_granularity("nvfp4:16x1:ct").spec == "nvfp4:16x1:compressed-tensors"
    assert parse_granularity("nvfp4:torchao").block == (1, 16)
    for bad in ("nvfp4:8x8", "nvfp4:2d:te:x", "nvfp4:fbgemm"):
        with pytest.raises(ValueError):
            parse_granularity(bad)


def test_quantize_scaled_rejects_options_that_do_not_apply():
    x = np.ones((2, 16), F32)
    with pytest.raises(ValueError, match="e2m1"):
        quantize_scaled(x, "e4m3", "nvfp4")
    with pytest.raises(ValueError, match="global_amax"):
        quantize_scaled(x, "e4m3", "tensor", global_amax=1.0)
    with pytest.raises(ValueError, match="global_amax"):
        quantize_scaled(x, "e2m1", "nvfp4", global_amax=-1.0)
    with pytest.raises(ValueError, match="e2m1"):
        quantize_scaled(x, "e2m1", "nvfp4", pow2=True)
