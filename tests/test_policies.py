"""fp8sim.policies: Transformer Engine delayed-scaling scenarios, hand-computed sequences, MS-AMP
windows, FP8-LM AutoScale's mu trajectory, state round trips, spec parsing and the CLI command.

Expected values are computed by hand in the comments (E4M3 max 448, E5M2 max 57344).
"""

import argparse
import json
import math

import numpy as np
import pytest

from fp8sim.commands import policies as policies_cmd
from fp8sim.policies import (
    POLICY_SPECS,
    AutoScale,
    DelayedScaling,
    MSAMPScaling,
    ScalingPolicy,
    parse_policy,
)
from fp8sim.scaling import scale_from_amax

_LEGACY = pytest.mark.filterwarnings("ignore:ScalingPolicy.quantize is deprecated:DeprecationWarning")

F32_MAX = float(np.finfo(np.float32).max)
NAN, INF = float("nan"), float("inf")


# -- Transformer Engine's scale-update scenarios (test_scale_update_numeric_scenarios) ---------


@pytest.mark.parametrize("fmt, fmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_te_scale_update_scenarios(fmt, fmax, algo):
    def after(amax):
        p = DelayedScaling(history=1, algo=algo)
        p.observe("t", amax, fmt)
        return p.scale_for("t", fmt)

    assert after(0.0) == 1.0  # amax 0 -> previous scale (1)
    tiny = float(np.float32(fmax / F32_MAX / 2))  # fmax / tiny overflows float32
    assert after(tiny) == np.float32(F32_MAX)
    assert after(INF) == 1.0
    assert after(NAN) == 1.0
    normal = 0.7123
    assert after(normal) == np.float32(np.float32(fmax) / np.float32(normal))
    # with a previous scale, the bad amaxes keep it
    p = DelayedScaling(history=1, algo=algo)
    p.observe("t", 2.0, fmt)
    for bad in (0.0, INF, NAN):
        p.observe("t", bad, fmt)
        assert p.scale_for("t", fmt) == fmax / 2


# hand-computed: amax per step, then the scale in force at the next step (history 4, E4M3)
AMAXES = [1.0, 4.0, 2.0, 0.5, 8.0, 0.0, 1.0, NAN, 2.0, 0.25]
# max over the last 4 amaxes (NaN skipped as fmaxf does; an amax of 0 is not rolled in, as in
# TE's fused kernel_bulk, so the window and the scale stay):
#   1 | 1,4 | 1,4,2 | 1,4,2,.5 | 4,2,.5,8 | (0: 4,2,.5,8) | 2,.5,8,1 | .5,8,1,nan | 8,1,nan,2
#   | 1,nan,2,.25
SCALES_MAX = [448, 112, 112, 112, 56, 56, 56, 56, 56, 224]
# most recent: 448/1, 448/4, 448/2, 448/.5, 448/8, (0: keep), 448/1, (NaN: keep), 448/2, 448/.25
SCALES_RECENT = [448, 112, 224, 896, 56, 56, 448, 448, 224, 1792]


@pytest.mark.parametrize("algo, expect", [("max", SCALES_MAX), ("most_recent", SCALES_RECENT)])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_ten_step_sequences(algo, expect, margin):
    p = parse_policy(f"delayed:history=4,algo={algo},margin={margin}")
    used = []
    for amax in AMAXES:
        used.append(p.scale_for("x", "e4m3", current_amax=123.0))  # current amax is ignored
        p.observe("x", amax, "e4m3")
    final = p.scale_for("x", "e4m3")
    assert used == [1.0] + [s / 2**margin for s in expect[:-1]]  # the scale lags one step
    assert final == expect[-1] / 2**margin
    assert len(p.state_dict()["tensors"]["x"]["amax_history"]) == 4


def test_delayed_inf_in_history_freezes_max_for_the_window():
    p = parse_policy("delayed:history=3")
    for a in (2.0, INF, 1.0, 1.0):
        p.observe("x", a, "e4m3")
        assert p.scale_for("x", "e4m3") == 224.0  # inf stays in the window for 3 steps
    p.observe("x", 1.0, "e4m3")  # inf rolled out: window 1, 1, 1
    assert p.scale_for("x", "e4m3") == 448.0


def test_delayed_default_matches_te():
    p = parse_policy("delayed")
    assert p.params == {"history": 1024, "algo": "max", "margin": 0.0}
    assert not p.just_in_time and p.granularity == "tensor"


def test_tensors_are_independent():
    p = parse_policy("delayed:history=2")
    p.observe("a", 1.0, "e4m3")
    p.observe("b", 4.0, "e5m2")
    assert p.scale_for("a", "e4m3") == 448.0 and p.scale_for("b", "e5m2") == 14336.0
    assert p.scale_for("never-seen", "e4m3") == 1.0


# -- current, static, mx -------------------------------------------------------------------------


def test_current_scaling():
    p = parse_policy("current:pow2")
    assert p.just_in_time
    assert p.scale_for("x", "e4m3", current_amax=3.0) == 128.0
    assert parse_policy("current").scale_for("x", "e4m3", current_amax=3.0) == np.float32(448 / 3)
    assert parse_policy("current:margin=2").scale_for("x", "e5m2", current_amax=7.0) == 2048.0
    assert parse_policy("current").scale_for("x", "e4m3", current_amax=0.0) == 1.0
    with pytest.raises(ValueError, match="current_amax"):
        p.scale_for("x", "e4m3")


def test_static_scales_are_judged_as_the_float32_they_become():
    # 1e-45 rounds to 2**-149 (float32's smallest subnormal), 3.40282356e38 to float32's max
    assert parse_policy("static:scale=1e-45").scale_for("x", "e4m3") == 2.0**-149
    big = parse_policy("static:scale=3.40282356e38").scale_for("x", "e4m3")
    assert big == float(np.finfo(np.float32).max)


def test_static_and_mx():
    s = parse_policy("static:scale=0.5")
    s.observe("x", 3.0, "e4m3")
    assert s.scale_for("x", "e4m3") == 0.5 and s.state_dict()["tensors"] == {}
    m = parse_policy("mx:rceil")
    assert m.granularity == "mx:rceil" and parse_policy("mx").granularity == "mx"
    assert m.scale_for("x", "e4m3", current_amax=448.0) == 1.0
    assert m.scale_for("x", "e4m3", current_amax=449.0) == 0.5
    assert parse_policy("mx").scale_for("x", "e4m3", current_amax=449.0) == 1.0
    assert math.isnan(m.scale_for("x", "e4m3", current_amax=NAN))


# -- MS-AMP ------------------------------------------------------------------------------------


def test_msamp_window_sequence():
    p = parse_policy("msamp:window=2")
    # step: amax -> scale used (in time while counter < 2, then from the previous window max)
    #  1: 3    in time: 2**floor(log2(448/3 = 149.3)) = 128; window [3, 0] -> 128, counter 1
    #  2: 10   in time: 448/10 = 44.8 -> 32;  window max 10 -> 32, counter 2
    #  3: 1    delayed: 32; window [1, 10] -> 32
    #  4: 1    delayed: 32; window [1, 1] -> 448 -> 256
    #  5: NaN  delayed: 256; non-finite: scale kept, warm-up restarts (counter 0)
    #  6: 2    in time: 224 -> 128; window [2, NaN]: max NaN keeps 128, counter 1
    #  7: 4    in time: 112 -> 64; window [4, 2] -> 64, counter 2
    #  8: 0.5  delayed: 64; window [0.5, 4] -> 64
    amaxes = [3.0, 10.0, 1.0, 1.0, NAN, 2.0, 4.0, 0.5]
    used = []
    for a in amaxes:
        used.append(p.scale_for("x", "e4m3", current_amax=a))
        p.observe("x", a, "e4m3")
    assert used == [128, 32, 32, 32, 256, 128, 64, 64]
    assert p.scale_for("x", "e4m3", current_amax=1e-3) == 64  # not in time: amax ignored


def test_msamp_window_one_is_just_in_time_with_margin():
    p = parse_policy("msamp:window=1,margin=1")
    assert p.scale_for("w", "e4m3", current_amax=3.0) == 64.0  # 128 / 2
    p.observe("w", 3.0, "e4m3")
    assert p.scale_for("w", "e4m3", current_amax=0.25) == 512.0  # 2**floor(log2 1792) = 1024, / 2
    assert p.scale_for("w", "e4m3", current_amax=0.0) == 64.0  # amax 0: previous scale
    with pytest.raises(ValueError, match="current_amax"):
        p.scale_for("w", "e4m3")
    # tiny amax: the quotient is inf in float32 -> float32 max -> 2**127 (no inf scale)
    assert parse_policy("msamp:window=1").scale_for("w", "e4m3", current_amax=1e-38) == 2.0**127
    assert (
        parse_policy("msamp:window=1,margin=-1").scale_for("w", "e4m3", current_amax=1e-38)
        == 2.0**127
    )


# -- FP8-LM AutoScale -----------------------------------------------------------------------------


def test_autoscale_mu_trajectory():
    p = parse_policy("autoscale:window=4,base=none")
    over = [0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    # hand: grow 1 -> 2 over 4 clean steps (x 2**(1/4) each), halve on overflow, regrow
    # geometrically from the halved value to 2 over 4 steps: from 2**-1.5 the exponents step
    # by (1 - (-1.5)) / 4 = 0.625
    expect = [
        2**0.25,
        2**0.5,
        2**0.75,
        2.0,
        2.0,
        1.0,
        2**0.25,
        2**0.5,
        2**-0.5,
        2**-1.5,
        2**-0.875,
        2**-0.25,
        2**0.375,
        2.0,
        2.0,
    ]
    got = []
    for o in over:
        assert p.scale_for("g", "e5m2") == np.float32(p.mu("g"))
        p.observe("g", 1.0, "e5m2", numel=1000, n_at_max=o)  # share 1e-3 > 1e-5 when o
        got.append(p.mu("g"))
    np.testing.assert_allclose(got, expect, rtol=1e-14)
    assert got[3] == got[4] == got[13] == 2.0 and got[5] == 1.0  # exact where the rule is exact


def test_autoscale_threshold_is_strict_and_uses_overflow_alias():
    p = parse_policy("autoscale:window=2,base=none")
    p.observe("g", 1.0, "e4m3", numel=100000, overflow=1)  # share == 1e-5: not above
    assert p.mu("g") == 2**0.5
    p.observe("g", 1.0, "e4m3", numel=100000, overflow=2)
    assert p.mu("g") == 2**-0.5
    with pytest.raises(ValueError, match="n_at_max"):
        p.observe("g", 1.0, "e4m3")


@_LEGACY
def test_autoscale_on_data_halves_when_mu_saturates():
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    p = parse_policy("autoscale:mu_init=2")
    st = p.quantize("g", x, "e4m3")
    # scale = 2 * 448 / amax: every scaled |x| from 432 (the midpoint 416|448, a tie to even
    # 448) upwards lands on +-448 -- a quarter of the values here, far above ratio 1e-5
    scale = np.float32(2) * scale_from_amax(np.abs(x).max(), "e4m3")
    n_max = int(np.count_nonzero((st.codes & 0x7F) == 0x7E))
    assert n_max == int(np.count_nonzero((np.abs(x) * scale).astype(np.float32) >= 432)) > 100
    assert p.mu("g") == 1.0
    assert p.scale_for("g", "e4m3", current_amax=448.0) == 1.0


# -- state dicts -------------------------------------------------------------------------------


SEQ = [1.0, 3.0, 0.5, NAN, 2.0, 7.0, 0.0, 1.5, 4.0, 0.25, INF, 1.0]


@pytest.mark.parametrize(
    "spec",
    [
        "delayed:history=4",
        "delayed:history=3,algo=most_recent,margin=1",
        "msamp:window=3",
        "autoscale:window=5",
        "current",
        "static:scale=2",
        "mx",
    ],
)
def test_state_dict_round_trip_mid_sequence(spec):
    def step(p, i, a):
        s = p.scale_for("t", "e4m3", current_amax=a)
        p.observe("t", a, "e4m3", numel=1000, n_at_max=i % 3 == 0)
        return s

    a = parse_policy(spec)
    for i, amax in enumerate(SEQ[:6]):
        step(a, i, amax)
    sd = json.loads(json.dumps(a.state_dict()))  # plain data survives JSON (NaN included)
    b = parse_policy(sd["policy"])
    b.load_state_dict(sd)
    for i, amax in enumerate(SEQ[6:], start=6):
        sa, sb = step(a, i, amax), step(b, i, amax)
        assert sa == sb or (math.isnan(sa) and math.isnan(sb))
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())


def test_load_state_dict_rejects_other_policies():
    sd = parse_policy("delayed:history=4").state_dict()
    with pytest.raises(ValueError, match="delayed:history=4"):
        parse_policy("delayed:history=5").load_state_dict(sd)
    with pytest.raises(ValueError, match="'policy' and 'tensors'"):
        parse_policy("delayed").load_state_dict({"scale": 1})


# -- spec parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICY_SPECS))
def test_every_policy_parses_and_round_trips(name):
    p = parse_policy(name)
    assert isinstance(p, ScalingPolicy) and p.spec.startswith(name)
    q = parse_policy(p.spec)
    assert q.spec == p.spec and type(q) is type(p)
    assert set(p.params) == set(POLICY_SPECS[name]["params"])
    assert parse_policy(p) is p


def test_spec_forms():
    assert (
        parse_policy("delayed:history=16,margin=1,algo=max").spec
        == "delayed:history=16,algo=max,margin=1"
    )
    assert parse_policy(" Delayed : most_recent , history=8 ").params["algo"] == "most_recent"
    assert parse_policy("current:pow2").params["pow2"] is True
    assert parse_policy("current:pow2=false").params["pow2"] is False
    assert parse_policy("current:gran=block:1x128").granularity == "block:1x128"
    assert parse_policy("autoscale:ratio=1e-5,window=1000").params["ratio"] == 1e-5
    assert isinstance(parse_policy("msamp:window=16"), MSAMPScaling)
    assert isinstance(parse_policy("autoscale"), AutoScale)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("te", "valid: current, delayed, msamp, autoscale, static, torchao, mx, nvfp4"),
        ("delayed:hist=4", "unknown parameter 'hist'; valid: history, algo, margin"),
        ("delayed:history=4.5", "integer"),
        ("delayed:history=0", "history must be >= 1"),
        ("delayed:algo=min", "one of max, most_recent"),
        ("delayed:history=4,history=5", "given twice"),
        ("current:pow3", "bare words: pow2"),
        ("current:pow2=maybe", "true/false"),
        ("current:gran=mx", "mx policy"),
        ("current:gran=block:0x4", "positive"),
        ("msamp:window=0", "window must be >= 1"),
        ("autoscale:ratio=2", "ratio"),
        ("autoscale:mu_init=4", "mu_init <= mu_max"),
        ("static:scale=0", "finite and > 0"),
        ("static:scale=1e39", "as a float32"),  # rounds to inf in float32
        ("static:scale=1e-50", "as a float32"),  # rounds to 0
        ("static:scale=7e-46", "as a float32"),  # below half of 2**-149: rounds to 0
        ("delayed:history=1e300", "<= 1048576"),
        ("static:scale=nan", "NaN"),
        ("mx:ceil", "floor, rceil"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_bad_inputs_to_policies():
    with pytest.raises(TypeError):
        parse_policy(3)
    p = parse_policy("delayed")
    with pytest.raises(ValueError, match=">= 0"):
        p.observe("x", -1.0, "e4m3")
    with pytest.raises(TypeError):
        p.observe("x", "big", "e4m3")
    with pytest.raises(ValueError, match="unknown format"):
        p.observe("x", 1.0, "e9m9x")


# -- quantize convenience (deprecated: casting is the quantizer's) --------------------------------


def test_policy_quantize_is_deprecated_naming_the_quantizer():
    with pytest.warns(DeprecationWarning, match="use fp8sim.quantizer.Quantizer"):
        parse_policy("current").quantize("x", np.ones((2, 4), np.float32), "e4m3")



@_LEGACY
def test_policy_quantize_delayed_uses_previous_scale_and_observes():
    x1 = np.full((2, 8), 2.0, np.float32)
    x2 = np.full((2, 8), 8.0, np.float32)
    p = parse_policy("delayed:history=2")
    st1 = p.quantize("x", x1, "e4m3")  # scale 1 (nothing observed yet)
    assert st1.scale_inv == 1.0
    st2 = p.quantize("x", x2, "e4m3")  # scale 448 / 2 from step 1: 8 * 224 saturates to 448
    assert st2.scale_inv == np.float32(1) / np.float32(224)
    assert np.all(st2.dequantize() == np.float32(448) * (np.float32(1) / np.float32(224)))
    assert p.scale_for("x", "e4m3") == 56.0


@_LEGACY
def test_policy_quantize_granularities():
    x = np.random.default_rng(1).standard_normal((4, 70)).astype(np.float32)
    assert parse_policy("current:gran=row").quantize("x", x, "e4m3").scale_inv.shape == (4, 1)
    st = parse_policy("mx:rceil").quantize("x", x, "e4m3")
    assert st.granularity == "mx:rceil" and st.scale_inv.shape == (4, 3)
    st = parse_policy("current").quantize("x", x, "e4m3")
    assert st.scale_inv == np.float32(1) / scale_from_amax(np.abs(x).max(), "e4m3")


# -- CLI -----------------------------------------------------------------------------------------


def _run(argv):
    parser = argparse.ArgumentParser(prog="fp8sim")
    policies_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_lists_policies(capsys):
    assert _run(["policies"]) == 0
    out = capsys.readouterr().out
    for name in POLICY_SPECS:
        assert f"{name}: " in out
    assert "history=1024" in out and "ratio=1e-05" in out and "window=16" in out
    assert _run(["policies", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["delayed"]["params"]["history"]["default"] == 1024
    assert data["autoscale"]["params"]["base"]["choices"] == ["current", "pow2", "none"]


def test_cli_checks_one_spec(capsys):
    assert _run(["policies", "delayed:history=16,margin=1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spec"] == "delayed:history=16,algo=max,margin=1" and info["just_in_time"] is False
    assert _run(["policies", "mx:rceil"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "mx:rule=rceil"
    with pytest.raises(ValueError, match="valid: history, algo, margin"):
        _run(["policies", "delayed:hist=3"])  # cli.main turns this into one line, exit 2


# -- review findings: Transformer Engine's fused update, clamps, NaN handling ------------------


def test_delayed_amax_zero_neither_rolls_nor_changes_the_scale():
    """TE delayed_scaling.cu kernel_bulk: `if (last_amax != 0.0f)` guards the roll."""
    p = parse_policy("delayed:history=2")
    for a in (10.0, 1.0, 0.0):
        p.observe("w", a, "e4m3")
    # had the 0 been rolled in, the window would be [1, 0] -> 448; TE keeps 448/10
    assert p.scale_for("w", "e4m3") == float(np.float32(448.0) / np.float32(10.0))
    assert p.state_dict()["tensors"]["w"]["amax_history"] == [10.0, 1.0]


def test_scale_uses_te_order_scaled_max_then_divide():
    """TE: scaled_max = fp8_max * 2**-margin (float32), then scale = scaled_max / amax."""
    rng = np.random.default_rng(0)
    amax = (rng.random(2000) * 1e3).astype(np.float32) + np.float32(1e-3)
    for margin in (0.5, 1, 3):
        scaled_max = np.float32(np.float32(448.0) * np.float32(2.0 ** -margin))
        want = (scaled_max / amax).astype(np.float32)
        assert np.array_equal(scale_from_amax(amax, "e4m3", margin=margin), want)


def test_autoscale_scale_is_clamped_to_float32_max():
    p = parse_policy("autoscale:mu_init=2")
    s = p.scale_for("g", "e4m3", current_amax=1e-38)
    assert s == float(np.finfo(np.float32).max)


@_LEGACY
def test_current_policy_skips_nan_like_other_granularities():
    x = np.array([[1, np.nan, 4], [2, 3, 0.5]], np.float32)
    a = parse_policy("current").quantize("a", x, "e4m3")
    b = parse_policy("current:gran=block:2x3").quantize("a", x, "e4m3")
    assert float(a.scale_inv) == float(np.asarray(b.scale_inv).ravel()[0])
    assert float(a.scale_inv) == float(np.float32(1) / (np.float32(448) / np.float32(4)))
