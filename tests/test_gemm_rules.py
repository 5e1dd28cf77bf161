"""The GEMM rules of the training path (``Backend.gemm`` on quantized operands): ``accumulator``
is :mod:`fp8sim.gemm`'s model on the oracle's own casts, ``exact`` agrees across backends, and a
rule a backend cannot run is refused before a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from fp8sim import backends
from fp8sim.formats import get_format
from fp8sim.gemm import HOPPER_FP8, gemm
from fp8sim.granularity import Granularity
from fp8sim.quantizer import Quantizer
from fp8sim.recipes import CastConfig, CustomRecipe, GemmRule, LinearRecipe, get_recipe
from fp8sim.scaling import quantize_scaled
from fp8sim.scaling_config import CurrentScalingConfig

E4M3, E2M1 = get_format("e4m3"), get_format("e2m1")
M, N, K = 24, 40, 320  # K spans several 128-element promotion chunks and a ragged MX block


def _pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)  # columns over six decades
    return a, torch.randn(N, K, generator=g)


CASES = {  # (a's cast, b's cast, the oracle's granularity of b's (K, N) view)
    "tensor": (CastConfig(E4M3), CastConfig(E4M3), "tensor"),
    "row": (CastConfig(E4M3, granularity=Granularity.row()), CastConfig(E4M3, granularity=Granularity.row()), "col"),
    "block": (CastConfig(E4M3, CurrentScalingConfig(pow2=True), Granularity.blocks(1, 128)),
              CastConfig(E4M3, CurrentScalingConfig(pow2=True), Granularity.blocks(128, 128)), "block:128x128"),
    "mx": (CastConfig(E4M3, granularity=Granularity.mx("rceil")), CastConfig(E4M3, granularity=Granularity.mx("rceil")),
           "block:32x1"),
    "nvfp4": (CastConfig(E2M1, granularity=Granularity.nvfp4("1x16")), CastConfig(E2M1, granularity=Granularity.nvfp4("2d")),
              "nvfp4:2d"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_accumulator_rule_is_fp8sim_gemms_hopper_model_on_the_oracles_casts(case):
    ca, cb, b_view = CASES[case]
    a, b = _pair(1)
    be = backends.get("emulator")
    qa, qb = Quantizer(ca, be).quantize("a", a, observe=False), Quantizer(cb, be).quantize("b", b, observe=False)
    got = be.gemm(qa, qb, GemmRule.ACCUMULATOR)
    # the oracle: numpy casts of A (M, K) and of B^T (K, N), fp8sim.gemm's model of the product
    rule = {"pow2": True} if case == "block" else {}
    sa = quantize_scaled(a.numpy(), ca.fmt, ca.granularity, **rule)
    if case == "nvfp4":
        sb = quantize_scaled(b.numpy().T.copy(), cb.fmt, "nvfp4:2d")  # square tiles: the transposed cast
    else:
        st = quantize_scaled(b.numpy(), cb.fmt, cb.granularity, **rule)
        from fp8sim.scaling import ScaledTensor

        sinv = st.scale_inv if np.ndim(st.scale_inv) == 0 else st.scale_inv.T.copy()
        sb = ScaledTensor(st.codes.T.copy(), sinv, st.fmt, b_view, (K, N))
    want = gemm(sa, sb, **HOPPER_FP8)
    assert torch.equal(got, torch.from_numpy(want))
    # 14 significant bits, truncated: not the float32 GEMM, but close to it
    exact = be.gemm(qa, qb, GemmRule.EXACT)
    assert not torch.equal(got, exact)
    assert torch.allclose(got, exact, rtol=2e-3, atol=1e-3 * float(exact.abs().max()))


@pytest.mark.parametrize("case", ["tensor", "row", "block", "mx"])
def test_exact_rule_is_the_same_on_the_emulator_and_torch_backends(case):
    ca, cb, _ = CASES[case]
    a, b = _pair(2)
    out = []
    for name in ("emulator", "torch"):
        be = backends.get(name)
        qa, qb = Quantizer(ca, be).quantize("a", a, observe=False), Quantizer(cb, be).quantize("b", b, observe=False)
        out.append(be.gemm(qa, qb, GemmRule.EXACT, accumulate="float32"))
    assert torch.equal(out[0], out[1])


def test_a_recipe_with_the_accumulator_rule_trains_on_the_emulator_and_is_refused_elsewhere():
    from fp8sim.training import convert_to_fp8

    lin = get_recipe("te-current").linear
    recipe = CustomRecipe("hopper", linear=LinearRecipe(lin.input, lin.weight, lin.grad_output,
                                                        gemm_rule=GemmRule.ACCUMULATOR))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 8))
    ref = nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 8))
    ref.load_state_dict(model.state_dict())
    convert_to_fp8(model, recipe, "emulator", module_filter_fn=lambda m, n: True)
    convert_to_fp8(ref, "te-current", "emulator", module_filter_fn=lambda m, n: True)
    x = torch.randn(16, 64)
    y, y_ref = model(x), ref(x)
    y.square().sum().backward()
    assert torch.isfinite(model[0].weight.grad).all() and not torch.equal(y, y_ref)
    assert torch.allclose(y, y_ref, rtol=0, atol=3e-2 * float(y_ref.detach().abs().max()))  # 14-bit sums, two layers
    with pytest.raises(NotImplementedError, match="accumulator.*emulator backend, not torch"):
        convert_to_fp8(nn.Sequential(nn.Linear(64, 8)), recipe, "torch", module_filter_fn=lambda m, n: True)
