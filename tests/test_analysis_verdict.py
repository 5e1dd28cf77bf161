"""The per-layer verdict of a trace (``analyze(TRACE).verdicts``, the end of ``fp8sim analyze
TRACE``): every verdict class on small synthetic traces whose figures are computed by hand or
by ml_dtypes; warm-up reported apart; output gradients judged in their recorded E5M2."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from fp8sim import cli
from fp8sim.analysis import LayerVerdict, analyze
from fp8sim.analysis.verdict import layer_of
from fp8sim.trace import TraceWriter, abs_histogram

E4M3 = ml_dtypes.float8_e4m3fn


def _underflow_pct(x: np.ndarray, scale: float, dtype=E4M3) -> float:
    """Share (percent) of the nonzero values that become 0 in ``dtype`` (ml_dtypes, RNE)."""
    q = (x.astype(np.float32) * np.float32(scale)).astype(dtype).astype(np.float32)
    nz = x != 0
    return 100.0 * float(((q == 0) & nz).sum()) / float(nz.sum())


def _log_uniform(rng, shape, lo: int, hi: int) -> np.ndarray:
    """|x| = 2**u, u uniform in [lo, hi), random signs (float32)."""
    u = rng.uniform(lo, hi, shape)
    return (np.exp2(u) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def _rows(n_rows: int, n_cols: int, rng) -> np.ndarray:
    """Row i has magnitudes in [1, 2) * 2**-i: each row needs its own scale."""
    x = rng.uniform(1.0, 2.0, (n_rows, n_cols)) * np.exp2(-np.arange(n_rows))[:, None]
    return x.astype(np.float32)


def _pow2_jit(x: np.ndarray, fmax: float) -> float:
    """2**floor(log2(fmax / amax))."""
    return float(2.0 ** np.floor(np.log2(fmax / np.abs(x).max())))


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("verdict") / "trace"
    data: dict = {}
    with TraceWriter(path, {"run": "verdict"}, chunk_steps=2) as tw:
        tw.add_tensor("l0.input", "activation", "e4m3", (32, 128))
        tw.add_tensor("l0.weight", "weight", "e4m3", (32, 128))
        tw.add_tensor("l0.grad_output", "grad_output", "e5m2", (32, 128))
        tw.add_tensor("l1.input", "activation", "e4m3", (32, 128))
        tw.add_tensor("l1.weight", "weight", "e4m3", (32, 128))
        tw.add_tensor("l2.input", "activation", "e4m3", (24, 128))
        tw.add_tensor("l2.weight", "weight", "e4m3", (32, 128))
        for step in (1, 2, 3, 4):
            # l0.input: delayed scaling's warm-up: scale 1 at step 1, then 2**16
            x = (rng.standard_normal((32, 128)) * 1e-3).astype(np.float32)
            data["l0.input", step] = x
            tw.record(step, "l0.input", x, scale=1.0 if step == 1 else 2.0**16)
            # l0.weight: |x| < 3 at scale 64, and a spike of 20 at step 3 in 8 values (0.2% of the
            # tensor, over the 0.1% overflow warning share): 20 * 64 = 1280 overflows
            w = np.clip(rng.standard_normal((32, 128)), -3, 3).astype(np.float32)
            if step == 3:
                w[5, 7:15] = 20.0
            data["l0.weight", step] = w
            tw.record(step, "l0.weight", w, scale=64.0)
            # l0.grad_output: 25 binades; E4M3 would lose about a third, E5M2 (32 binades) none
            g = _log_uniform(rng, (32, 128), -25, 0)
            data["l0.grad_output", step] = g
            tw.record(step, "l0.grad_output", g, scale=_pow2_jit(g, 57344.0))
            # l1.input: rows 32 binades apart; l1.weight: iid over 40 binades
            a = _rows(32, 128, rng)
            tw.record(step, "l1.input", a, scale=_pow2_jit(a, 448.0))
            b = _log_uniform(rng, (32, 128), -40, 0)
            data["l1.weight", step] = b
            tw.record(step, "l1.weight", b, scale=_pow2_jit(b, 448.0))
            # the same shapes without saved tensors: rows 24 binades apart, iid over 40 binades
            c = _rows(24, 128, rng)
            data["l2.input", step] = c
            tw.record(step, "l2.input", c, scale=_pow2_jit(c, 448.0))
            d = _log_uniform(rng, (32, 128), -40, 0)
            tw.record(step, "l2.weight", d, scale=_pow2_jit(d, 448.0))
            if step in (2, 4):
                tw.save_tensor(step, "l1.input", a)
                tw.save_tensor(step, "l1.weight", b)
        # a saved tensor in l0.input's warm-up: not used (the verdict is after warm-up)
        tw.save_tensor(1, "l0.input", data["l0.input", 1])
    return path, data


@pytest.fixture(scope="module")
def result(trace):
    return analyze(str(trace[0]))


def _by_tensor(result) -> dict[str, LayerVerdict]:
    return {v.tensor: v for v in result.verdicts}


def test_layer_and_role_from_the_recorders_names():
    assert layer_of("h.0.attn.c_attn.grad_output") == "h.0.attn.c_attn"
    assert layer_of("lm_head.weight_grad") == "lm_head"
    assert layer_of("fc.input") == "fc"
    assert layer_of("exp_avg") == "exp_avg" and layer_of(".weight") == ".weight"


def test_ok_after_a_warm_up_reported_apart(result, trace):
    v = _by_tensor(result)["l0.input"]
    assert (v.layer, v.role, v.format) == ("l0", "activation", "e4m3")
    assert (v.verdict, v.text, v.margin) == ("ok", "ok", None)
    # warm-up: step 1 at scale 1, reported apart with its underflow (ml_dtypes' cast)
    assert (v.warmup_steps, v.warmup_first_step, v.warmup_last_step) == (1, 1, 1)
    warm = _underflow_pct(trace[1]["l0.input", 1], 1.0)
    assert warm > 50  # the spike the verdict leaves out
    assert v.warmup_worst_underflow_pct == pytest.approx(warm, abs=1e-9)
    assert v.steps == 3
    # after warm-up the recorded scale 2**16 is the pow2 just-in-time one: worst step by ml_dtypes
    jit = max(_underflow_pct(trace[1]["l0.input", s], _pow2_jit(trace[1]["l0.input", s], 448.0))
              for s in (2, 3, 4))  # fmt: skip
    assert v.jit_underflow_pct == pytest.approx(jit, abs=1e-9) and jit < 0.5


def test_needs_margin_the_smallest_that_removes_the_overflow(result, trace):
    v = _by_tensor(result)["l0.weight"]
    assert (v.verdict, v.text, v.margin, v.basis) == ("needs margin", "needs margin 2", 2, "histogram")
    assert (v.overflow, v.overflow_steps, v.warmup_steps) == (8, 1, 0)
    # ml_dtypes (non-saturating: overflow -> NaN): 20 * 64 / 2 = 640 overflows, / 4 = 320 does not
    w = trace[1]["l0.weight", 3]
    assert np.isnan((w * np.float32(64 / 2)).astype(E4M3).astype(np.float32)).sum() == 8
    assert not np.isnan((w * np.float32(64 / 4)).astype(E4M3).astype(np.float32)).any()


def test_a_handful_of_saturated_values_asks_for_no_margin(trace):
    """The same spike judged with a 1% overflow warning share: 0.2% of the values at one step
    stays below it, so no margin; the row says why."""
    res = analyze(str(trace[0]), overflow_warning=1.0, overflow_critical=2.0)
    v = _by_tensor(res)["l0.weight"]
    assert (v.verdict, v.margin, v.overflow) == ("ok", None, 8)
    assert "recorded overflow 8 in 1 steps (below the warning share: no margin needed)" in res.table()


def test_grad_output_is_judged_in_its_recorded_e5m2(result, trace):
    v = _by_tensor(result)["l0.grad_output"]
    assert (v.format, v.verdict) == ("e5m2", "ok")
    g = trace[1]["l0.grad_output", 2]
    assert _underflow_pct(g, _pow2_jit(g, 57344.0), ml_dtypes.float8_e5m2) == 0.0
    # judged in E4M3 it would not be ok: the histogram's count agrees with ml_dtypes
    s = _pow2_jit(g, 448.0)
    e4 = _underflow_pct(g, s)
    assert e4 > 10
    h = abs_histogram(g)
    assert 100.0 * h.underflow("e4m3", int(np.log2(s))) / h.nonzero == pytest.approx(e4, abs=1e-9)


def test_finer_scaling_from_saved_tensors(result):
    v = _by_tensor(result)["l1.input"]
    # per tensor, 32 binades of rows cannot fit; each row alone is one binade: row scaling is
    # exact to the last value, and the first of the tied finer scalings is the coarsest
    assert v.jit_underflow_pct > 0.5
    assert (v.verdict, v.text, v.basis) == ("needs finer scaling", "needs finer scaling (best: row)",
                                            "saved tensors")  # fmt: skip
    assert (v.best_scaling, v.finer_underflow_pct) == ("row", 0.0)


def test_keep_in_higher_precision_from_saved_tensors(result, trace):
    from fp8sim.analysis.stats import parse_variants, tensor_stats

    v = _by_tensor(result)["l1.weight"]
    assert (v.verdict, v.text, v.basis) == ("keep in higher precision", "keep in higher precision",
                                            "saved tensors")  # fmt: skip
    # even 32-element MX blocks cannot hold 40 binades: the best scaling's share, recomputed
    shares = {}
    for s in ("row", "block:1x128", "mx"):
        (var,) = parse_variants(["e4m3"], [s])
        shares[s] = max(tensor_stats(trace[1]["l1.weight", k], [var]).variants[0].underflow
                        / 4096 * 100 for k in (2, 4))  # fmt: skip
    best = min(shares, key=lambda k: (shares[k], list(shares).index(k)))
    assert v.best_scaling == best and v.finer_underflow_pct == pytest.approx(shares[best])
    assert shares[best] > 10


def test_estimates_without_saved_tensors(result):
    by = _by_tensor(result)
    c, d = by["l2.input"], by["l2.weight"]
    # 24 binades of rows: per tensor loses some, 8 more binades of headroom lose none
    assert c.jit_underflow_pct > 0.5 and c.finer_underflow_pct == 0.0
    assert (c.verdict, c.text, c.basis) == ("needs finer scaling", "needs finer scaling (estimate)", "estimate")
    assert (d.verdict, d.text, d.basis) == ("keep in higher precision",
                                            "keep in higher precision (estimate)", "estimate")  # fmt: skip
    assert d.finer_underflow_pct > 0.5


def test_threshold_is_underflow_warning(trace):
    # l2.input loses a few percent per tensor; above that threshold it is ok
    res = analyze(str(trace[0]), underflow_warning=50.0, underflow_critical=60.0)
    assert _by_tensor(res)["l2.input"].verdict == "ok"


def test_json_key_and_table(result):
    d = json.loads(result.to_json())
    assert [v["tensor"] for v in d["verdicts"]] == [v.tensor for v in result.verdicts]
    assert d["verdicts"][1] == result.verdicts[1].to_dict()
    assert LayerVerdict.from_dict(d["verdicts"][1]) == result.verdicts[1]
    table = result.table()
    tail = table[table.index("verdict per layer and role"):]
    lines = {ln.split()[0] + " " + ln.split()[1]: ln for ln in tail.splitlines()[3:]}
    assert "needs margin 2" in lines["l0 weight"]
    assert "step 1: underflow" in lines["l0 activation"]
    assert "needs finer scaling (best: row)" in lines["l1 activation"]
    assert "keep in higher precision (estimate)" in lines["l2 weight"]


def test_cli_ends_with_the_verdict_lines(trace, capsys):
    assert cli.main(["analyze", str(trace[0])]) in (0, 1)
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    # the last lines: one per layer and role, in the trace's order
    last = out[-7:]
    assert [ln.split()[:2] for ln in last] == [
        ["l0", "activation"], ["l0", "weight"], ["l0", "grad_output"], ["l1", "activation"],
        ["l1", "weight"], ["l2", "activation"], ["l2", "weight"]]  # fmt: skip
    assert "e5m2" in last[2] and " ok " in last[2]


# ------------------------------------------------------------------------------------------
# replay --by tensor|layer
# ------------------------------------------------------------------------------------------
def _expected_cells(doc: dict, key) -> dict:
    """(row, policy) -> cell text, from the per-record JSON."""
    out: dict = {}
    for pol, recs in doc["records"].items():
        acc: dict = {}
        for r in recs:
            a = acc.setdefault(key(r["tensor"]), [0, 0, 0, 0.0])
            a[0] += r["event"]
            a[1] += r["overflow"][0]
            a[2] += r["overflow"][1]
            lo, hi = r["underflow_share"]
            a[3] = max(a[3], 0.0 if lo is None else 100.0 * (lo + hi) / 2)
        for row, (ev, lo, hi, wu) in acc.items():
            out[row, pol] = f"{ev} / {lo if lo == hi else f'{lo}..{hi}'} / {wu:.3g}%"
    return out


@pytest.mark.parametrize("by", ["tensor", "layer"])
def test_replay_by_table_against_the_per_record_json(trace, tmp_path, capsys, by):
    js = tmp_path / "r.json"
    rc = cli.main(["replay", str(trace[0]), "--policy", "delayed:history=2", "--policy", "current:pow2",
                   "--by", by, "--json", str(js)])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    doc = json.loads(js.read_text())
    expected = _expected_cells(doc, (lambda n: n) if by == "tensor" else layer_of)
    pols = [p["policy"] for p in doc["policies"]]
    assert out[0].split() == [by, *pols]
    assert out[-1].startswith("cells: overflow events")
    rows = out[2:-1]
    assert len(rows) == len({r for r, _ in expected})
    assert [ln.split()[0] for ln in rows] == list(dict.fromkeys(r for r, _ in expected))
    for ln in rows:
        row = ln.split()[0]
        cells = [c.strip() for c in ln[len(row):].split("  ") if c.strip()]
        assert cells == [expected[row, p] for p in pols]
    # the recorded scales overflowed l0.weight once (one value): its event is in the table
    if by == "tensor":
        assert expected["l0.weight", "recorded"].startswith("1 / 8 / ")


def test_replay_by_default_is_the_policy_table(trace):
    from fp8sim.analysis import replay

    res = replay(str(trace[0]), ["current"])
    assert res.table() == res.table(by="policy") and res.table().split()[0] == "policy"
    with pytest.raises(ValueError, match="by"):
        res.table(by="step")
