"""The quantizer: one amax -> scale -> cast -> observe for every caller, against the scaling
module's reference casts and hand values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8sim import backends
from fp8sim.formats import Rounding, get_format
from fp8sim.granularity import Granularity
from fp8sim.quantizer import Quantizer, stochastic_seed
from fp8sim.recipes import CastConfig
from fp8sim.scaling import quantize_scaled, scale_from_amax
from fp8sim.scaling_config import (AutoScaleConfig, CurrentScalingConfig, DelayedScalingConfig,
                                   MSAMPScalingConfig)

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")
BE = backends.get("emulator")


def _x(seed: int = 0, shape=(8, 96), spread: float = 30.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * spread


@pytest.mark.parametrize("cast", [CastConfig(E4M3), CastConfig(E5M2, CurrentScalingConfig(pow2=True, margin=1)),
                                  CastConfig(E4M3, granularity=Granularity.blocks(1, 32)),
                                  CastConfig(E4M3, granularity=Granularity.mx("rceil")),
                                  CastConfig(E4M3, granularity=Granularity.row())],
                         ids=["tensor", "pow2-margin", "block", "mx", "row"])
def test_a_just_in_time_cast_is_the_reference_scaled_cast(cast):
    x = _x()
    q = Quantizer(cast, BE).quantize("x", x)
    c = cast.scaling
    ref = quantize_scaled(x.numpy(), cast.fmt, cast.granularity,
                          **({} if cast.granularity.kind == "mx" else {"margin": c.margin, "pow2": c.pow2}))
    assert torch.equal(q.codes, torch.from_numpy(ref.codes))
    assert torch.equal(q.scale_inv.reshape(np.shape(ref.scale_inv)), torch.from_numpy(np.asarray(ref.scale_inv)))
    assert q.amax == float(x.abs().max())


def test_delayed_scaling_takes_the_scale_from_the_history_and_the_amax_from_the_cast():
    q = Quantizer(CastConfig(E4M3, DelayedScalingConfig(history=2)), BE)
    first = q.quantize("w", torch.full((4, 4), 2.0))
    assert float(first.scale) == 1.0 and first.amax == 2.0  # nothing observed before step 1
    second = q.quantize("w", torch.full((4, 4), 8.0))
    assert float(second.scale) == 448.0 / 2.0  # from step 1's amax
    assert float(second.scale_inv) == np.float32(1) / np.float32(224)
    assert q.scale_for("w", None) == 448.0 / 8.0  # the history's max is now 8


def test_the_amax_reduction_decides_and_is_observed():
    seen = []

    def double(a: torch.Tensor) -> torch.Tensor:
        seen.append(a.clone())
        return a * 2

    q = Quantizer(CastConfig(E4M3, DelayedScalingConfig(history=4)), BE, amax_reduction=double)
    x = _x(1)
    q.quantize("t", x)
    assert len(seen) == 1 and float(seen[0]) == float(x.abs().max())
    assert q.scale_for("t", None) == float(scale_from_amax(2 * float(x.abs().max()), E4M3))
    cur = Quantizer(CastConfig(E4M3), BE, amax_reduction=double).quantize("t", x)
    assert float(cur.scale) == float(scale_from_amax(float(2 * x.abs().max()), E4M3))


def test_autoscale_is_steered_by_the_share_at_max_the_quantizer_counts():
    q = Quantizer(CastConfig(E4M3, AutoScaleConfig(mu_init=2.0)), BE)
    assert q.counts_saturation
    q.quantize("g", _x(2))  # mu 2: the top of the range saturates, so mu halves
    assert q.policy.mu("g") == 1.0 and q.policy.state_dict()["tensors"]["g"]["halvings"] == 1


def test_a_given_scale_is_used_and_nothing_is_observed():
    q = Quantizer(CastConfig(E4M3, MSAMPScalingConfig(window=4)), BE)
    x = _x(3)
    out = q.quantize("a", x, scale=0.5)
    assert float(out.scale) == 0.5 and out.amax is None and q.state_dict()["tensors"] == {}
    assert torch.equal(out.codes, torch.from_numpy(quantize_scaled(x.numpy(), E4M3, scale=0.5).codes))


def test_scale_divisor_and_rounding_seed():
    q = Quantizer(CastConfig(E4M3, CurrentScalingConfig(pow2=True)), scale_divisor=2 ** 0.5)
    s = float(scale_from_amax(3.0, E4M3, pow2=True))
    assert q.scale_for("g", 3.0) == float(np.float32(s / 2 ** 0.5))
    sr = Quantizer(CastConfig(E4M3, rounding=Rounding.STOCHASTIC), BE)
    with pytest.raises(ValueError, match="needs seed="):
        sr.quantize("x", _x())
    seed = stochastic_seed(5, "x")
    got = sr.quantize("x", _x(), seed=seed)
    ref = quantize_scaled(_x().numpy(), E4M3, rounding="stochastic", seed=seed)
    assert torch.equal(got.codes, torch.from_numpy(ref.codes))
    with pytest.raises(ValueError, match="needs a backend"):
        Quantizer(CastConfig(E4M3)).quantize("x", _x())


def test_group_scales_are_the_reference_block_rules():
    amax = np.float32([0.0, 1e-30, 3.0, 448.0, 5e4, np.inf])
    mult, sinv = Quantizer(CastConfig(E4M3, CurrentScalingConfig(pow2=True), Granularity.blocks(1, 128))).group_scales(amax)
    assert np.array_equal(mult, scale_from_amax(amax, E4M3, pow2=True))
    nan = np.array([False, False, True, False, False, False])
    mult, sinv = Quantizer(CastConfig(E4M3, granularity=Granularity.mx())).group_scales(amax, nan)
    assert np.isnan(sinv[2]) and np.isnan(sinv[5]) and sinv[3] == 2.0 ** (8 - 8) and mult[3] == 1.0
