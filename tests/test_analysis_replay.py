"""analysis.policy_replay: policies over a trace, counts checked against fp8sim.quantize on the tensors
that were recorded (the test keeps them), scales against the policy objects themselves."""

from __future__ import annotations

import numpy as np
import torch
import pytest

import fp8sim
from fp8sim.analysis.policy_replay import RECORDED, _at_max, replay_policies, summary_rows
from fp8sim.policies import parse_policy
from fp8sim.scaling import scale_from_amax
from fp8sim.trace import TraceWriter

STEPS = 8


def truth(x: np.ndarray, fmt: str, scale: float) -> tuple[int, int, bool]:
    """(overflow, underflow, amax event) of encode(float32(float32(x) * scale)) by the emulator."""
    p = (x.astype(np.float32) * np.float32(scale)).astype(np.float32)
    q = fp8sim.quantize(p, fmt, saturate=False)
    fin = np.isfinite(x)
    over = int((fin & ~np.isfinite(q)).sum())
    under = int((fin & (x != 0) & (q == 0)).sum())
    amax = np.float32(np.abs(x[fin]).max())
    qa = fp8sim.quantize(np.array([amax * np.float32(scale)], np.float32), fmt, saturate=False)
    return over, under, bool(~np.isfinite(qa[0]))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("replay") / "trace"
    data = {}
    with TraceWriter(path, {"test": True}, chunk_steps=5) as tw:
        tw.add_tensor("act", "activation", "e4m3", (32, 48))
        tw.add_tensor("grad", "weight_grad", "e5m2", (32, 48))
        for s in range(STEPS):
            # growing activations (delayed scaling lags behind: overflow), tiny gradients
            act = (rng.standard_normal((32, 48)) * 1.6**s).astype(np.float32)
            grad = (rng.standard_normal((32, 48)) * 1e-6 * np.exp2(rng.integers(-6, 6, (32, 48)))).astype(np.float32)
            for name, x, fmt in (("act", act, "e4m3"), ("grad", grad, "e5m2")):
                amax = float(np.abs(x).max())
                tw.record(s, name, x, scale=1.0, amax=amax)
                data[(s, name)] = (x, fmt, amax)
    return path, data


def test_pow2_policies_are_exact(trace):
    path, data = trace
    specs = ["static:scale=1", "current:pow2", "msamp:window=1"]
    reps = replay_policies(path, specs)
    assert [r.policy for r in reps][0] == RECORDED
    for rp in reps:
        c = rp.cols
        assert c["step"].size == 2 * STEPS
        for i in range(c["step"].size):
            name = rp.names[int(c["tensor"][i])]
            x, fmt, amax = data[(int(c["step"][i]), name)]
            scale = float(c["scale"][i])
            if rp.policy.startswith("current"):
                assert scale == float(scale_from_amax(amax, fmt, pow2=True))
            assert c["exact"][i]
            ov, un, ev = truth(x, fmt, scale)
            assert (c["overflow_lo"][i], c["overflow_hi"][i]) == (ov, ov)
            assert (c["underflow_lo"][i], c["underflow_hi"][i]) == (un, un)
            assert bool(c["event"][i]) == ev


def test_delayed_scaling_brackets_truth_and_follows_the_policy(trace):
    path, data = trace
    (rp,) = replay_policies(path, ["delayed:history=4,margin=0"], include_recorded=False)
    pol = parse_policy("delayed:history=4,margin=0")
    c = rp.cols
    events = 0
    for i in range(c["step"].size):
        name = rp.names[int(c["tensor"][i])]
        x, fmt, amax = data[(int(c["step"][i]), name)]
        assert c["scale"][i] == pol.scale_for(name, fmt)
        pol.observe(name, amax, fmt)
        ov, un, ev = truth(x, fmt, float(c["scale"][i]))
        assert c["overflow_lo"][i] <= ov <= c["overflow_hi"][i]
        assert c["underflow_lo"][i] <= un <= c["underflow_hi"][i]
        assert bool(c["event"][i]) == ev
        events += ev
    s = rp.summary()
    assert events > 0 and s["events"] == events  # growing activations outrun the history
    share = rp.overflow_share
    worst = int(np.argmax(share))
    assert (s["worst_tensor"], s["worst_step"]) == (rp.names[int(c["tensor"][worst])], int(c["step"][worst]))
    assert s["median_underflow_pct"] == pytest.approx(100 * np.median(rp.underflow_share))


def test_recorded_rows_and_summary(trace):
    path, data = trace
    rec, cur = replay_policies(path, ["current"])
    for i in range(rec.cols["step"].size):
        x, fmt, _ = data[(int(rec.cols["step"][i]), rec.names[int(rec.cols["tensor"][i])])]
        ov, un, _ = truth(x, fmt, 1.0)
        assert rec.cols["overflow_lo"][i] == ov and rec.cols["underflow_lo"][i] == un
    rows = summary_rows([rec, cur])
    assert rows[0]["policy"] == RECORDED and rows[1]["policy"].startswith("current")
    assert rows[1]["events"] == 0  # just-in-time scaling maps amax to max
    steps, mat = cur.grid("underflow_share")
    assert mat.shape == (2, STEPS) and np.array_equal(steps, np.arange(STEPS))


def test_unreplayable_policies_refused(trace):
    path, _ = trace
    with pytest.raises(ValueError, match="per-block"):
        replay_policies(path, ["mx"])
    with pytest.raises(ValueError, match="per-block"):
        replay_policies(path, ["current:gran=row"])
    with pytest.raises(ValueError, match="unknown scaling policy"):
        replay_policies(path, ["magic"])


def test_at_max_counts_values_landing_on_max():
    from fp8sim.trace import abs_histogram

    rng = np.random.default_rng(5)
    x = (rng.standard_normal(20000) * 100).astype(np.float32)
    # values around the boundary max - ulp/2 (= 432 for e4m3, its tie goes to max: even)
    x[:6] = [432, np.nextafter(np.float32(432), np.float32(0)), 448, 464, 480, -432]
    h = abs_histogram(x)
    for fmt in ("e4m3", "e5m2"):
        f = fp8sim.get_format(fmt)
        for j in (-2, 0, 3, 8):
            q = fp8sim.quantize(x * np.float32(2.0**j), fmt, saturate=True)
            want = int((np.abs(q) == f.max).sum())
            assert _at_max(h, f, 2.0**j) == (want, want), (fmt, j)


def test_the_same_policy_spelled_twice_is_replayed_once(trace):
    path, _ = trace
    reps = replay_policies(path, ["current", "current:margin=0", "delayed:history=4",
                                  "delayed:history=4,algo=max"], include_recorded=False)  # fmt: skip
    assert [r.policy for r in reps] == [parse_policy("current").spec,
                                        parse_policy("delayed:history=4").spec]  # fmt: skip


def test_autoscale_replay_counts_infs_at_max_as_the_live_policy(tmp_path):
    # an inf saturates to max in the cast, so policy.quantize counts it in n_at_max; the replay
    # (which reads the finite histogram) must add the record's infs: the same scales step by step
    rng = np.random.default_rng(1)
    xs = []
    with TraceWriter(tmp_path / "t", {}) as tw:
        tw.add_tensor("X", "weight_grad", "e4m3", (256,))
        for s in range(4):
            x = rng.standard_normal(256).astype(np.float32)
            x[0] = np.inf
            tw.record(s, "X", x, scale=1.0)
            xs.append(x)
    spec = "autoscale:base=none,ratio=0.001,window=2,mu_max=4"
    (rep,) = replay_policies(tmp_path / "t", [spec], include_recorded=False)
    from fp8sim import backends, get_format
    from fp8sim.quantizer import Quantizer
    from fp8sim.recipes import CastConfig
    from fp8sim.scaling_config import parse_scaling

    live, q = [], Quantizer(CastConfig(get_format("e4m3"), parse_scaling(spec)[0]), backends.get("emulator"))
    for x in xs:  # the live casts: the quantizer counts the values cast to +-max itself
        live.append(q.scale_for("X", None))
        q.quantize("X", torch.from_numpy(x).reshape(1, -1))
    assert list(rep.cols["scale"]) == live and live[-1] < live[0]
