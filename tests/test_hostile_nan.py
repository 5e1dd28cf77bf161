"""A NaN never vanishes from a figure (issue 24, class 4): ``compare``'s max |rel loss diff|,
``analyze``'s trace amax, the worst-first order and the ``--fail-on`` gates."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fp8sim import cli
from fp8sim.trace import TraceWriter


def test_max_or_nan_keeps_a_nan_wherever_it_stands():
    from fp8sim.nan_aware import max_or_nan, nan_steps, worst_first

    assert max([1.0, math.nan, 0.5]) == 1.0  # what Python's max does
    for vals in ([1.0, math.nan, 0.5], [math.nan, 1.0], [1.0, 0.5, math.nan]):
        assert math.isnan(max_or_nan(vals))
    assert max_or_nan([1.0, 3.0, 2.0]) == 3.0 and max_or_nan([], default=None) is None
    assert nan_steps([(1, 0.5), (2, math.nan), (3, 1.0)]) == [2]
    assert sorted([3.0, math.nan, None, 5.0], key=worst_first) [1:] == [5.0, 3.0, None]


def _run(d, losses):
    d.mkdir()
    rows = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # NaN as NaN
    (d / "config.json").write_text(json.dumps({"recipe": "bf16", "backend": "emulator"}))
    return d


def test_compare_shows_a_nan_loss_and_names_its_step(tmp_path, capsys):
    a = _run(tmp_path / "a", [3.0, 2.5, 2.0, 1.5])
    b = _run(tmp_path / "b", [3.0, 2.5, math.nan, 1.5])  # NaN at step 3, not first
    assert cli.main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("max |rel loss diff|"))
    assert line.split()[5:7] == ["nan", "over"], line  # was 0.00e+00: max() skipped the NaN
    assert "NaN loss in B" in out and "at step(s) 3" in out
    assert cli.main(["compare", str(a), str(b), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["max_abs_rel_loss_diff"] == "nan" and doc["nan_loss_steps"] == {"a": [], "b": [3]}


def test_analyze_shows_a_nan_amax_of_a_trace(tmp_path, capsys):
    rng = np.random.default_rng(0)
    with TraceWriter(tmp_path / "t", chunk_steps=2) as tw:
        tw.add_tensor("a", "activation", "e4m3", (64,))
        for s in range(4):
            x = rng.standard_normal(64).astype(np.float32)
            if s == 2:
                x[5] = np.nan
            tw.record(s, "a", x, scale=1.0, amax=math.nan if s == 2 else float(np.abs(x).max()))
    assert cli.main(["analyze", str(tmp_path / "t"), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.split()[:2] == ["warning", "a"])
    assert row.split()[5] == "nan", row  # the max amax cell: was the largest of the other steps
    doc = json.loads((tmp_path / "r.json").read_text())
    rec = doc["traces"][0]["tensors"][0]
    assert rec["amax"] is None and rec["amax_nan_steps"] == 1
    # a gate on amax is crossed by a NaN amax, never passed over
    assert cli.main(["analyze", str(tmp_path / "t"), "--fail-on", "amax>1000"]) == 1
    assert "amax>1000 by a" in capsys.readouterr().err


# ---- 7. --fail-on rules that can never fire or always fire, at both ends of the range ----------
@pytest.mark.parametrize("rule, verdict", [
    ("overflow>=0", "always"), ("overflow<0", "never"),  # the low end (refused before)
    ("underflow<=100%", "always"), ("subnormal>100%", "never"),  # a share's high end
    ("overflow<inf", "always"), ("nan>=inf", "never"), ("lost>inf", "never"),  # counts are finite
    ("sqnr_db>=-inf", "always"), ("sqnr_db<=inf", "always"), ("sqnr_db<-inf", "never"),
    ("sqnr_db>inf", "never"), ("rel_mse<=inf", "always"), ("amax>inf", "never"),
])  # fmt: skip
def test_fail_on_rules_that_cannot_decide_are_refused_at_both_ends(tmp_path, capsys, rule, verdict):
    np.save(tmp_path / "x.npy", np.linspace(-1, 1, 64, dtype=np.float32))
    assert cli.main(["analyze", str(tmp_path / "x.npy"), "--fail-on", rule]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--fail-on rule {rule!r}" in err and f"would {verdict} fire" in err


@pytest.mark.parametrize("rule", ["underflow>=100%", "underflow<100%", "underflow<=0%", "sqnr_db>=inf",
                                  "rel_mse>=inf", "amax>=inf", "overflow>0", "overflow<=0"])  # fmt: skip
def test_fail_on_rules_that_can_go_either_way_are_taken(rule):
    from fp8sim.analysis.report import parse_fail_on

    assert len(parse_fail_on(rule)) == 1


def test_replay_fail_on_events_range(tmp_path):
    from fp8sim.analysis.report import REPLAY_FAIL_METRICS, parse_fail_on

    for rule in ("events<inf", "events>=inf", "underflow>100%"):
        with pytest.raises(ValueError, match="would (always|never) fire"):
            parse_fail_on(rule, REPLAY_FAIL_METRICS)
