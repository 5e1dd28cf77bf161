"""Block-scaled policies in ``replay`` (NVFP4, MX, Transformer Engine's Float8BlockScaling): each is
replayed at the records whose full tensor the trace saved, and its counts are checked on those
same tensors against fp8sim.nvfp4 (NVFP4) and quantize_scaled + the emulator (MX, block) directly;
the records without a saved tensor are counted as skipped, never dropped silently."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch
import pytest

import fp8sim
from fp8sim.analysis.policy_replay import RECORDED, replay_policies
from fp8sim.nvfp4 import block_scales, cast_multiplier, dequantize_nvfp4_2d, quantize_nvfp4_2d
from fp8sim import backends, get_format
from fp8sim.policies import parse_policy
from fp8sim.quantizer import Quantizer
from fp8sim.recipes import CastConfig
from fp8sim.scaling_config import parse_scaling
from fp8sim.scaling import quantize_scaled, scale_from_amax
from fp8sim.trace import TraceWriter

F32 = np.float32
STEPS = 5
SAVED = (0, 2, 4)
SHAPE = (37, 72)  # ragged: 37 rows (16x1, 16x16 blocks), 72 columns (1x16: 4.5 blocks)


def tensor_for(rng, step: int, name: str) -> np.ndarray:
    x = rng.standard_normal(SHAPE).astype(F32)
    x *= np.exp2(rng.integers(-12, 12, (SHAPE[0], 1))).astype(F32)  # rows of very different size
    if name == "act":
        x[5, 16:32] = 0  # a zero block
        x[6, :16] *= F32(1e-9)  # a block far below the tensor amax: E4M3 scale 0 or subnormal
    else:
        x[0, 0] = F32(5000.0 * (step + 1))  # above 2688 * 7/6: torchao-block saturates
    return x


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("replay_block") / "trace"
    data = {}
    with TraceWriter(path, {"test": True}, chunk_steps=2) as tw:
        tw.add_tensor("act", "activation", "e4m3", SHAPE)
        tw.add_tensor("w", "weight", "e5m2", SHAPE)
        for s in range(STEPS):
            for name, fmt in (("act", "e4m3"), ("w", "e5m2")):
                x = tensor_for(rng, s, name)
                tw.record(s, name, x, scale=1.0)
                if s in SAVED:
                    tw.save_tensor(s, name, x)
                data[(s, name)] = (x, fmt)
    return path, data


def nvfp4_truth(x: np.ndarray, layout: str, variant: str) -> tuple[int, int, float, int]:
    """(overflow, underflow, multiplier of the block holding the amax, overflow in blocks with
    an E4M3 scale in the normal range) straight from fp8sim.nvfp4: overflow = values of blocks
    with a nonzero scale whose float32 product ``x * cast_multiplier`` rounds above 6 (|y| >= 7:
    the tie at 7 goes to 8, even), underflow = nonzero values whose dequantized value is 0."""
    p = quantize_nvfp4_2d(x, layout, variant)
    r = cast_multiplier(p.block_scale, p.global_amax, variant)
    tile = {"1x16": (1, 16), "16x1": (16, 1), "16x16": (16, 16)}[layout]
    m, n = x.shape
    full = np.repeat(np.repeat(r, tile[0], 0)[:m], tile[1], 1)[:, :n]
    live = np.repeat(np.repeat(p.block_scale > 0, tile[0], 0)[:m], tile[1], 1)[:, :n]
    y = (x * full).astype(F32)
    over = int((live & (np.abs(y) >= 7)).sum())
    normal = np.repeat(np.repeat(p.block_scale >= 2.0**-6, tile[0], 0)[:m], tile[1], 1)[:, :n]
    over_normal = int((normal & (np.abs(y) >= 7)).sum())
    deq = dequantize_nvfp4_2d(p.codes, p.block_scale, p.tensor_scale, layout, variant)
    under = int(((x != 0) & (deq == 0)).sum())
    a = F32(np.abs(x).max())
    _, b = block_scales(a, a, variant)
    return over, under, float(cast_multiplier(b, a, variant)), over_normal


def scaled_truth(x: np.ndarray, fmt: str, gran: str, **kw) -> tuple[int, int]:
    """(overflow, underflow) of quantize_scaled's cast, from its scales and the emulator."""
    st = quantize_scaled(x, fmt, gran, **kw)
    m, n = x.shape
    if gran.startswith("mx"):
        (r, c), mult = (1, 32), (F32(1) / st.scale_inv).astype(F32)  # exact: powers of two
    else:
        r, c = (int(v) for v in gran[6:].split("x"))
        mult = scale_from_amax(st.amax, fmt, **kw)
    full = np.repeat(np.repeat(mult, r, 0)[:m], c, 1)[:, :n]
    q = fp8sim.quantize((x * full).astype(F32), fmt, saturate=False)
    over = int((~np.isfinite(q)).sum())
    under = int(((x != 0) & (st.dequantize() == 0)).sum())
    return over, under


@pytest.mark.parametrize("spec, layout, variant", [
    ("nvfp4", "1x16", "te"),
    ("nvfp4:16x1", "16x1", "te"),
    ("nvfp4:2d,torchao", "16x16", "torchao"),
    ("nvfp4:variant=torchao-block", "1x16", "torchao-block"),
])  # fmt: skip
def test_nvfp4_counts_are_fp8sim_nvfp4s_on_the_saved_tensors(trace, spec, layout, variant):
    path, data = trace
    rec, rp = replay_policies(path, [spec])
    assert rec.policy == RECORDED and rec.cols["step"].size == 2 * STEPS
    c = rp.cols
    assert c["step"].size == 2 * len(SAVED) and rp.skipped == 2 * (STEPS - len(SAVED))
    assert sorted(zip(c["step"].tolist(), (rp.names[t] for t in c["tensor"]))) == sorted(
        (s, n) for s in SAVED for n in ("act", "w"))
    events = over_normal = 0
    for i in range(c["step"].size):
        x, _ = data[(int(c["step"][i]), rp.names[int(c["tensor"][i])])]
        over, under, mult, on = nvfp4_truth(x, layout, variant)  # E2M1 whatever the format
        over_normal += on
        assert (c["overflow_lo"][i], c["overflow_hi"][i]) == (over, over)
        assert (c["underflow_lo"][i], c["underflow_hi"][i]) == (under, under)
        assert c["exact"][i] and bool(c["event"][i]) == (over > 0)
        assert c["scale"][i] == mult
        assert (c["finite"][i], c["nonzero"][i]) == (x.size, int((x != 0).sum()))
        events += over > 0
    s = rp.summary()
    assert s["events"] == events and s["skipped"] == rp.skipped and s["exact_pct"] == 100.0
    if layout == "1x16":  # rows of tiny values: blocks with subnormal scales (te), or clamped
        assert events > 0  # scales (torchao-block), overflow
    if variant == "torchao-block":  # its block scale stops at 448: 5000 / 448 > 7 overflows
        assert over_normal > 0
    else:  # the tensor scale keeps every block scale <= 448: only blocks whose E4M3 scale is
        assert over_normal == 0  # subnormal (a few bits: rounded down by up to half) overflow
    if spec == "nvfp4":
        assert s["worst_underflow_pct"] > 0  # the tiny block underflows


def test_mx_and_te_block_counts_match_quantize_scaled(trace):
    path, data = trace
    specs = {"mx:rceil": ("mx:rceil", {}), "mx": ("mx", {}),
             "current:gran=block:1x128,pow2": ("block:1x128", {"pow2": True}),
             "current:gran=block:128x128,margin=1": ("block:128x128", {"margin": 1.0})}  # fmt: skip
    reps = replay_policies(path, list(specs), include_recorded=False)
    floor_overflows = 0
    for rp, (gran, kw) in zip(reps, specs.values()):
        c = rp.cols
        assert c["step"].size == 2 * len(SAVED)
        for i in range(c["step"].size):
            x, fmt = data[(int(c["step"][i]), rp.names[int(c["tensor"][i])])]
            over, under = scaled_truth(x, fmt, gran, **kw)
            assert (int(c["overflow_lo"][i]), int(c["underflow_lo"][i])) == (over, under), rp.policy
            if gran == "mx":
                floor_overflows += over
    assert floor_overflows > 0  # the OCP floor rule puts block maxima above the format's max
    with pytest.raises(ValueError, match="epsilon is not replayed"):
        replay_policies(path, ["current:gran=block:1x16,epsilon=1e-3"])


def test_block_policies_run_beside_tensor_policies_with_their_own_state(trace):
    path, _ = trace
    reps = replay_policies(path, ["delayed:history=4", "nvfp4", "current"], include_recorded=False)
    assert [r.skipped for r in reps] == [0, 2 * (STEPS - len(SAVED)), 0]
    assert [r.cols["step"].size for r in reps] == [2 * STEPS, 2 * len(SAVED), 2 * STEPS]
    alone = replay_policies(path, ["delayed:history=4"], include_recorded=False)[0]
    for k in alone.cols:
        assert np.array_equal(alone.cols[k], reps[0].cols[k])


def test_block_policies_refused_without_full_tensors_or_when_not_countable(tmp_path):
    path = tmp_path / "t"
    with TraceWriter(path, {}, rounding="rtz") as tw:
        tw.add_tensor("a", "activation", "e4m3", (4, 32))
        x = np.linspace(-3, 3, 128, dtype=F32).reshape(4, 32)
        tw.record(0, "a", x, scale=1.0)
    with pytest.raises(ValueError, match="saved no full tensor .*--save-every"):
        replay_policies(path, ["nvfp4"])
    with pytest.raises(ValueError, match="nvfp4:2d scaling needs per-block amaxes"):
        replay_policies(path, ["nvfp4:2d"])
    with TraceWriter(path, None, mode="a") as tw:
        tw.save_tensor(0, "a", x)
    with pytest.raises(ValueError, match="compressed-tensors NVFP4 variant is not replayed"):
        replay_policies(path, ["nvfp4:ct"])
    for spec in ("mx", "current:gran=row"):
        with pytest.raises(ValueError, match="this trace rounds rtz"):
            replay_policies(path, [spec])
    (rp,) = replay_policies(path, ["nvfp4"], include_recorded=False)  # E2M1 RNE by definition
    assert rp.cols["step"].size == 1 and rp.skipped == 0
    assert int(rp.cols["underflow_lo"][0]) == nvfp4_truth(x, "1x16", "te")[1]


def test_nvfp4_policy_spec_and_cast():
    p = parse_policy("nvfp4:2d,ct")
    assert p.spec == "nvfp4:layout=16x16,variant=compressed-tensors"
    assert parse_policy(p.spec).spec == p.spec and p.granularity == "nvfp4:2d:compressed-tensors"
    assert parse_policy("nvfp4").granularity == "nvfp4"
    with pytest.raises(ValueError, match="nvfp4 policy"):
        parse_policy("current:gran=nvfp4")
    with pytest.raises(ValueError, match="bare words: 1x16, 16x1"):
        parse_policy("nvfp4:32x1")
    x = np.random.default_rng(0).standard_normal((20, 40)).astype(F32)
    for spec, tile, var in (("nvfp4", "1x16", "te"), ("nvfp4:16x1,torchao", "16x1", "torchao"),
                            ("nvfp4:2d,ct", "16x16", "compressed-tensors")):  # fmt: skip
        config, gran = parse_scaling(spec)
        st = Quantizer(CastConfig(get_format("e2m1"), config, gran), backends.get("emulator")).quantize(
            "w", torch.from_numpy(x))
        ref = quantize_nvfp4_2d(x, tile, var)
        assert st.fmt.name == "e2m1" and np.array_equal(st.codes.numpy(), ref.codes)
        assert np.array_equal(st.scale_inv.numpy(), ref.block_scale)
    # compressed-tensors divides by b / G: its multiplier is 1 / float32(b / G)
    a = F32(3.0)
    g = F32(2688) * (F32(1) / a)
    b = F32(fp8sim.quantize(np.array([g * (a / F32(6))], F32), "e4m3")[0])
    assert parse_policy("nvfp4:ct").scale_for("w", "e4m3", current_amax=3.0) == F32(1) / F32(b / g)


def test_cli_replay_nvfp4_reports_skipped_records(trace):
    path, _ = trace
    cmd = ["replay", str(path), "--policy", "nvfp4", "--policy", "current", "--json", "-"]
    out = subprocess.run([sys.executable, "-m", "cli", *cmd], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    by = {s["policy"]: s for s in doc["policies"]}
    assert by["nvfp4:layout=1x16,variant=te"]["records"] == 2 * len(SAVED)
    assert by["nvfp4:layout=1x16,variant=te"]["skipped"] == 2 * (STEPS - len(SAVED))
    assert by[RECORDED]["skipped"] == 0
    assert "replayed at the 6 records with a saved full tensor (or, for mx, block statistics); 4 without either left out" in out.stderr
