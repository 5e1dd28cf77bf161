"""Transformer Engine's Float8BlockScaling through quantize_scaled: 1x128 (activations, gradients;
128x1 for their column-wise copies) and 128x128 (weights) blocks, the scale rule of TE's
``compute_scale_from_amax`` (common/recipe/recipe_common.cuh) derived here by hand: amax below
epsilon -> epsilon; amax 0, inf or NaN -> scale 1; scale = max / amax rounded once; an inf scale ->
float32 max; ``force_pow_2_scales`` (TE's default) keeps only the sign and exponent bits."""

from __future__ import annotations

import numpy as np
import pytest

from fp8sim.scaling import dequantize, quantize_scaled

F32 = np.float32


def block_row(values, n=128):
    x = np.zeros((1, n), F32)
    x[0, : len(values)] = values
    return x


def test_pow2_scale_drops_the_mantissa():
    st = quantize_scaled(block_row([3.0, -1.5]), "e4m3", "block:1x128", pow2=True)
    assert st.scale_inv[0, 0] == F32(1 / 128)  # 448 / 3 = 149.3 -> 128
    np.testing.assert_array_equal(dequantize(st)[0, :2], [3.0, -1.5])  # 384 and 192 are E4M3


def test_fp32_scale_is_one_division():
    st = quantize_scaled(block_row([3.0]), "e4m3", "block:1x128")
    assert st.scale_inv[0, 0] == F32(1) / (F32(448) / F32(3))


@pytest.mark.parametrize("amax, scale", [(0.0, 1.0), (np.inf, 1.0)])
def test_zero_and_inf_blocks_get_scale_one(amax, scale):
    st = quantize_scaled(block_row([amax]), "e4m3", "block:1x128", pow2=True)
    assert st.scale_inv[0, 0] == F32(1 / scale)


def test_epsilon_floors_the_amax_and_tiny_amax_saturates_the_scale():
    st = quantize_scaled(block_row([1e-10]), "e4m3", "block:1x128", epsilon=1e-4)
    assert st.scale_inv[0, 0] == F32(1) / (F32(448) / F32(1e-4))
    st = quantize_scaled(block_row([1e-39]), "e4m3", "block:1x128", pow2=True)  # 448/1e-39: inf
    assert st.scale_inv[0, 0] == F32(2.0**-127)  # float32 max, its mantissa dropped
    st = quantize_scaled(block_row([1e-39]), "e4m3", "block:1x128")
    assert st.scale_inv[0, 0] == F32(1) / np.finfo(F32).max


def test_e5m2_gradient_block():
    st = quantize_scaled(block_row([57344.0 * 3, 1.0]), "e5m2", "block:1x128", pow2=True)
    assert st.scale_inv[0, 0] == F32(4)  # 57344 / 172032 = 1/3 -> 0.25
    # 172032 * 0.25 = 43008 = 1.3125 * 2**15 -> E5M2 1.25 * 2**15 = 40960, times 4
    assert dequantize(st)[0, 0] == 163840


def test_layouts():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((200, 300)) * np.exp2(rng.integers(-10, 10, (200, 1)))).astype(F32)
    col = quantize_scaled(x, "e4m3", "block:128x1", pow2=True)
    row_t = quantize_scaled(np.ascontiguousarray(x.T), "e4m3", "block:1x128", pow2=True)
    np.testing.assert_array_equal(col.codes, row_t.codes.T)
    w = quantize_scaled(x, "e4m3", "block:128x128", pow2=True)
    w_t = quantize_scaled(np.ascontiguousarray(x.T), "e4m3", "block:128x128", pow2=True)
    np.testing.assert_array_equal(dequantize(w), dequantize(w_t).T)  # one weight, both ways
    assert w.scale_inv.shape == (2, 3)
    np.testing.assert_array_equal(w.amax[1, 2], np.abs(x[128:, 256:]).max())
