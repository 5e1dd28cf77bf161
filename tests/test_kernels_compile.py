"""The kernels compile for sm_90 (H100/H200) and sm_100 (B200) without a GPU, with the
instructions we rely on.

The interpreter cannot show what the GPU compiler does; ``fp8sim.kernels.aot`` compiles for a target
with the ptxas Triton ships. Checked in the PTX: the Adam step uses IEEE ``div.rn``/``sqrt.rn``
and no contracted ``fma`` (bit-exact to the emulator's one-rounding-per-operation recipe), the
native quantize uses ``cvt.rn.satfinite`` (round to nearest even, saturating -- the semantics it
is allowed for), and nothing flushes subnormals (``.ftz``). The NVFP4 quantize and RHT kernels
compile for both targets with IEEE ``div.rn``, no ``fma`` (sm_100 emits paired ``.f32x2``
arithmetic, counted too) and no ``.ftz``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

VARIANTS = ["quantize_e4m3_native", "quantize_e5m2_stochastic", "block_quantize_128x128",
            "adam_e4m3_stochastic", "scaled_mm_e4m3_native", "nvfp4_16x1_te_stochastic", "rht"]
VARIANTS_SM100 = ["nvfp4_1x16_te_rne", "rht_inverse"]


def _compile(arch: int, names: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "fp8sim.kernels.aot", "--arch", str(arch), "--json", "--only", *names],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def facts():
    return _compile(90, VARIANTS)


@pytest.fixture(scope="module")
def facts_sm100():
    return _compile(100, VARIANTS_SM100)


def test_adam_is_ieee_without_contraction(facts):
    f = facts["adam_e4m3_stochastic"]
    assert f["fma_f32"] == 0
    assert f["div_rn_f32"] > 0 and f["div_approx_f32"] == 0
    assert f["sqrt_rn_f32"] > 0 and f["sqrt_approx_f32"] == 0


def test_native_cast_is_rne_saturating(facts):
    assert facts["quantize_e4m3_native"]["cvt_e4m3"] > 0
    assert facts["quantize_e5m2_stochastic"]["cvt_e5m2"] == 0  # software cast: no hardware cvt


def test_native_gemm_adds_each_k_slice_in_float32(facts):
    # Triton's sm_90 default lets the fp8 MMA accumulate all of K with its ~14-bit adds; the
    # kernel asks for a float32 add of each BLOCK_K slice (max_num_imprecise_acc=BLOCK_K):
    # one add.f32 per accumulator element and slice, 128x128 / 256 threads = 64 per thread
    f = facts["scaled_mm_e4m3_native"]
    assert f["wgmma_e4m3"] > 0
    assert f["add_f32"] >= 64


def test_block_scale_division_is_ieee(facts):
    f = facts["block_quantize_128x128"]
    assert f["div_rn_f32"] > 0 and f["div_approx_f32"] == 0


def test_nothing_flushes_subnormals(facts):
    assert all(f["ftz"] == 0 for f in facts.values()), {k: f["ftz"] for k, f in facts.items()}


def test_nvfp4_and_rht_compile_for_hopper_and_blackwell(facts, facts_sm100):
    nvfp4 = [facts["nvfp4_16x1_te_stochastic"], facts_sm100["nvfp4_1x16_te_rne"]]
    rht = [facts["rht"], facts_sm100["rht_inverse"]]
    for f in nvfp4 + rht:
        assert f["fma_f32"] == 0 and f["ftz"] == 0 and f["div_approx_f32"] == 0, f
    assert all(f["div_rn_f32"] > 0 for f in nvfp4)  # the block scale's reciprocal, IEEE
    assert all(f["add_f32"] > 0 and f["sub_f32"] > 0 for f in rht)  # the butterflies
