"""fp8sim analyze / replay through cli.main: tables, --json fields, --plot PNGs, --fail-on exit
codes, bad files (exit 2, named), --keep-going, notes for empty and integer tensors; report
rules (classes, --fail-on parsing)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from fp8sim import cli
from fp8sim.analysis.report import parse_fail_on
from fp8sim.analysis.status import Thresholds, classify
from fp8sim.trace import TraceWriter

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def dumps(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    rng = np.random.default_rng(1)
    hot = np.linspace(-1, 1, 256, dtype=np.float32)
    hot[7] = 1000.0  # beyond e4m3's 464: one overflow with no scaling (hand computation)
    save_file({"hot": hot, "ids": np.arange(4, dtype=np.int64), "empty": np.zeros((0, 3), np.float32)},
              str(d / "a.safetensors"))  # fmt: skip
    np.save(d / "tiny.npy", (rng.standard_normal(300) * 1e-4).astype(np.float32))
    return d


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_analyze_json_fields_and_values(dumps, tmp_path, capsys):
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", str(dumps), "--format", "e4m3,e5m2", "--scaling", "none,tensor",
                       "--json", str(js), "--overflow-warning", "0.1", "--overflow-critical", "0.3")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(js.read_text())
    recs = doc["records"]
    assert len(recs) == 2 * 2 * 2  # tensors (hot, tiny) x formats x scalings
    need = {"name", "shape", "dtype", "numel", "format", "scaling", "amax", "scale", "overflow",
            "underflow", "subnormal", "nan", "inf", "sqnr_db", "rel_mse"}  # fmt: skip
    assert all(need <= set(r) for r in recs)
    hot = {(r["format"], r["scaling"]): r for r in recs if r["name"] == "hot"}
    # 1 value of 256 (0.39%) overflows: critical from --overflow-critical 0.3 (%)
    assert hot["e4m3", "none"]["overflow"] == 1 and hot["e4m3", "none"]["status"] == "critical"
    assert hot["e5m2", "none"]["overflow"] == 0  # 1000 < 57344
    assert hot["e4m3", "tensor"]["scale"] == pytest.approx(448 / 1000, rel=1e-7)
    assert hot["e4m3", "none"]["shape"] == [256] and hot["e4m3", "none"]["dtype"] == "float32"
    tiny = [r for r in recs if r["name"] == "tiny" and r["scaling"] == "none" and r["format"] == "e4m3"][0]
    assert tiny["underflow"] > 0  # 1e-4 values below e4m3's 2**-10 with no scaling
    notes = {n["name"]: n["note"] for n in doc["notes"]}
    assert "empty tensor" in notes["empty"] and "int64" in notes["ids"]
    assert doc["errors"] == [] and doc["summary"]["critical"] >= 1
    # the table went to stdout, worst first; no progress bar when not a terminal
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["status", "tensor", "format"]
    assert lines[2].startswith("critical") and "hot" in lines[2]
    assert "elem/s" not in err and "\r" not in err


def test_fail_on_exit_codes(dumps, capsys):
    assert run(capsys, "analyze", str(dumps), "--scaling", "none", "--fail-on", "overflow>0")[0] == 1
    assert run(capsys, "analyze", str(dumps), "--scaling", "tensor", "--fail-on", "overflow>0")[0] == 0
    rc, _, err = run(capsys, "analyze", str(dumps), "--scaling", "none", "--fail-on", "underflow>50%")
    assert rc == 1 and "underflow>50%" in err  # tiny: all of it underflows unscaled
    rc, _, err = run(capsys, "analyze", str(dumps), "--fail-on", "speed>3")
    assert rc == 2 and "--fail-on rule" in err
    rc, _, err = run(capsys, "analyze", str(dumps), "--format", "e9m9")
    assert rc == 2 and err.count("\n") == 1


def test_bad_files_exit_2_and_keep_going(dumps, tmp_path, capsys):
    raw = (dumps / "a.safetensors").read_bytes()
    (dumps / "b_cut.safetensors").write_bytes(raw[:-40])
    rc, out, err = run(capsys, "analyze", str(dumps))
    assert rc == 2 and "b_cut.safetensors" in err and "truncated" in err and err.count("\n") == 1
    js = tmp_path / "k.json"
    rc, out, err = run(capsys, "analyze", str(dumps), "--keep-going", "--json", str(js))
    assert rc == 2
    doc = json.loads(js.read_text())
    assert {r["name"] for r in doc["records"]} == {"hot", "tiny"}  # the others still analyzed
    assert len(doc["errors"]) == 1 and "b_cut.safetensors" in doc["errors"][0]["file"]
    assert "bad files (1)" in err
    rc, _, err = run(capsys, "analyze", str(tmp_path / "nope.pt"))
    assert rc == 2 and "nope.pt" in err


def test_plots_and_json_to_stdout(dumps, tmp_path, capsys):
    plots = tmp_path / "plots"
    rc, out, err = run(capsys, "analyze", str(dumps / "a.safetensors"), "--plot", str(plots),
                       "--json", "-")  # fmt: skip
    assert rc == 0
    doc = json.loads(out)  # stdout holds only the JSON
    assert {r["name"] for r in doc["records"]} == {"hot"}
    pngs = sorted(plots.glob("*.png"))
    assert [p.name for p in pngs] == ["0000_hot.png"] and pngs[0].read_bytes()[:8] == PNG


def test_a_plot_directory_holds_one_runs_plots_and_never_writes_through_links(dumps, tmp_path,
                                                                              capsys):
    plots = tmp_path / "plots"
    plots.mkdir()
    mine = plots / "notes.png"  # the user's own file: never listed, never touched
    mine.write_bytes(b"mine")
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"keep")
    (plots / "0001_tiny.png").symlink_to(outside)  # a link where a plot goes: replaced
    rc, _, err = run(capsys, "analyze", str(dumps), "--plot", str(plots))
    assert rc == 0, err
    assert outside.read_bytes() == b"keep" and not (plots / "0001_tiny.png").is_symlink()
    assert sorted(p.name for p in plots.glob("*.png")) == ["0000_hot.png", "0001_tiny.png", "notes.png"]
    listed = json.loads((plots / "fp8sim-plots.json").read_text())["png"]
    assert listed == ["0000_hot.png", "0001_tiny.png"]
    # the next run into the same directory: the plots of the first that it does not write go
    rc, _, err = run(capsys, "analyze", str(dumps / "a.safetensors"), "--plot", str(plots))
    assert rc == 0, err
    assert sorted(p.name for p in plots.glob("*.png")) == ["0000_hot.png", "notes.png"]
    assert mine.read_bytes() == b"mine"
    # a list that names what is not a bare .png of the directory deletes nothing of it
    (plots / "fp8sim-plots.json").write_text(json.dumps(
        {"schema": "fp8sim-plots", "png": ["../outside.png", "notes.png", str(outside)]}))
    rc, _, err = run(capsys, "analyze", str(dumps / "a.safetensors"), "--plot", str(plots))
    assert rc == 0 and outside.exists()
    assert not mine.exists()  # "notes.png" was listed as the previous run's plot: it goes


@pytest.fixture()
def trace(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "trace"
    with TraceWriter(path, {"run": "t"}, chunk_steps=4) as tw:
        tw.add_tensor("a", "activation", "e4m3", (16, 16))
        tw.add_tensor("g", "grad_output", "e5m2", (16, 16))
        for s in range(9):
            tw.record(s, "a", (rng.standard_normal((16, 16)) * 2.0**s).astype(np.float32), scale=1.0)
            tw.record(s, "g", (rng.standard_normal((16, 16)) * 1e-7).astype(np.float32), scale=1.0)
        tw.save_tensor(3, "a", rng.standard_normal((16, 16)).astype(np.float32))
    return path


def test_analyze_trace(trace, tmp_path, capsys):
    plots = tmp_path / "p"
    js = tmp_path / "t.json"
    rc, out, err = run(capsys, "analyze", str(trace), "--plot", str(plots), "--json", str(js))
    assert rc == 0, err
    doc = json.loads(js.read_text())
    assert [r["name"] for r in doc["records"]][:1] == ["a@step3"]
    (t,) = doc["traces"]
    rows = {r["name"]: r for r in t["tensors"]}
    assert rows["a"]["overflow"] > 0 and rows["a"]["status"] == "critical"  # 2**8 * randn > 464
    assert rows["g"]["underflow_pct"] > 50
    names = sorted(p.name for p in plots.glob("*.png"))
    assert "0000_trace_trace_underflow.png" in names and "0000_trace_trace_overflow.png" in names
    assert "trace " in out


def test_hard_links_and_files_inside_a_given_trace_are_analyzed_once(dumps, trace, tmp_path,
                                                                      capsys):
    os.link(dumps / "tiny.npy", tmp_path / "hard.npy")
    saved = sorted((trace / "tensors").iterdir())[0]  # a tensor the trace saved: part of it
    js = tmp_path / "o.json"
    rc, _, err = run(capsys, "analyze", str(dumps / "tiny.npy"), str(tmp_path / "hard.npy"),
                     str(trace), str(saved), "--json", str(js))  # fmt: skip
    assert rc == 0, err
    doc = json.loads(js.read_text())
    names = [r["name"] for r in doc["records"]]  # a record per tensor x format (e4m3, e5m2)
    assert sorted(names) == ["a@step3", "a@step3", "tiny", "tiny"]
    notes = {n["file"]: n["note"] for n in doc["notes"]}
    assert notes[str(tmp_path / "hard.npy")] == f"the same file as {dumps / 'tiny.npy'}: analyzed once"
    assert notes[str(saved)] == f"inside the trace {trace}: analyzed with it"


def test_plot_lists_with_odd_entries_delete_nothing_they_should_not(dumps, tmp_path, capsys):
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "sub.png").mkdir()  # listed, but a directory: left
    (plots / "0000_HOT.png").write_bytes(b"old")  # listed; this run writes 0000_hot.png
    (plots / "fp8sim-plots.json").write_text(json.dumps(
        {"schema": "fp8sim-plots", "png": ["sub.png", "nul\u0000.png", "0000_HOT.png"]}))
    js = tmp_path / "o.json"
    rc, _, err = run(capsys, "analyze", str(dumps / "a.safetensors"), "--plot", str(plots),
                     "--json", str(js))  # fmt: skip
    assert rc == 0, err
    assert js.exists() and (plots / "sub.png").is_dir() and (plots / "0000_hot.png").exists()
    # on a case-insensitive file system 0000_HOT.png is the new 0000_hot.png: never deleted
    assert (plots / "0000_HOT.png").exists()


def test_a_plot_is_listed_before_it_is_written(tmp_path):
    # a run stopped after some plots leaves them listed with the earlier run's: the next run
    # clears both
    from fp8sim.analysis.plots import PlotDir

    d = tmp_path / "p"
    first = PlotDir(str(d))
    (d / "0000_a.png").write_bytes(b"1")
    first.path("0000_a.png")
    first.finish()
    stopped = PlotDir(str(d))
    (d / stopped.path("0000_b.png")).write_bytes(b"2")  # then interrupted: no finish()
    listed = json.loads((d / "fp8sim-plots.json").read_text())["png"]
    assert listed == ["0000_a.png", "0000_b.png"]
    del stopped  # its process ends: the directory is let go
    nxt = PlotDir(str(d))
    (d / nxt.path("0000_c.png")).write_bytes(b"3")
    nxt.finish()
    assert sorted(p.name for p in d.glob("*.png")) == ["0000_c.png"]


def test_replay_cli(trace, tmp_path, capsys):
    js = tmp_path / "r.json"
    plots = tmp_path / "rp"
    rc, out, err = run(capsys, "replay", str(trace), "--policy", "delayed:history=4,margin=1",
                       "--policy", "current:pow2", "--json", str(js), "--plot", str(plots))  # fmt: skip
    assert rc == 0, err
    doc = json.loads(js.read_text())
    pols = [p["policy"] for p in doc["policies"]]
    assert pols[0] == "recorded" and pols[1].startswith("delayed") and pols[2].startswith("current")
    cur = doc["records"][pols[2]]
    assert len(cur) == 18 and all(r["exact"] for r in cur)
    assert all(r["overflow"] == [0, 0] for r in cur)
    for r in doc["records"]["recorded"] + cur:  # shares per tensor and step: counts / denominators
        assert r["overflow_share"] == [r["overflow"][0] / r["finite"], r["overflow"][1] / r["finite"]]
        assert r["underflow_share"] == [r["underflow"][0] / r["nonzero"],
                                        r["underflow"][1] / r["nonzero"]]
    assert doc["policies"][0]["events"] > 0  # scale 1 under growing activations
    assert {"events", "worst_tensor", "worst_step", "median_underflow_pct", "worst_underflow_pct"} <= set(doc["policies"][1])
    assert (plots / "policies.png").read_bytes()[:8] == PNG
    assert len(list(plots.glob("*_share.png"))) == 6
    assert out.splitlines()[0].startswith("policy")
    rc, _, err = run(capsys, "replay", str(tmp_path), "--policy", "current")
    assert rc == 2 and "not an fp8sim trace" in err
    rc, _, err = run(capsys, "replay", str(trace), "--policy", "mx")  # block-scaled: the saved tensor only
    assert rc == 0 and "policy mx:rule=floor: replayed at the 1 records with a saved full tensor (or, for mx, block statistics); 17 without either left out" in err


def test_classify_and_rules():
    base = {"overflow": 0, "overflow_pct": 0.0, "underflow_pct": 0.0, "nan": 0, "inf": 0, "lost": 0}
    th = Thresholds(underflow_warning=0.5, underflow_critical=2.0, overflow_warning=0.01, overflow_critical=0.1)
    assert classify(base, th) == "ok"
    assert classify(base | {"underflow_pct": 0.5}, th) == "warning"
    assert classify(base | {"underflow_pct": 2.0}, th) == "critical"
    assert classify(base | {"overflow": 1, "overflow_pct": 0.005}, th) == "ok"
    assert classify(base | {"overflow": 1, "overflow_pct": 0.05}, th) == "warning"
    assert classify(base | {"overflow": 9, "overflow_pct": 0.1}, th) == "critical"
    assert classify(base | {"nan": 3}, th) == "warning"
    assert classify(base | {"underflow_pct": 1.0}, Thresholds(underflow_warning=2.0, underflow_critical=5.0)) == "ok"
    r1, r2, r3 = parse_fail_on("overflow>0, underflow>=1%,sqnr_db<20")
    rec = {"overflow": 0, "overflow_pct": 0.0, "underflow": 5, "underflow_pct": 1.0, "sqnr_db": None}
    assert not r1.crossed(rec) and r2.crossed(rec) and not r3.crossed(rec)  # None: no error
    assert r3.crossed(rec | {"sqnr_db": 12.0})
    with pytest.raises(ValueError, match="no share"):
        parse_fail_on("nan>1%")
    with pytest.raises(ValueError):
        parse_fail_on("")


def test_keep_going_past_missing_path_and_corrupt_trace_chunk(dumps, tmp_path, capsys):
    tr = tmp_path / "tr"
    with TraceWriter(tr, {}) as tw:
        tw.add_tensor("w", "weight", "e4m3", (4,))
        tw.record(0, "w", np.ones(4, np.float32), scale=1.0)
    (chunk,) = (tr / "chunks").iterdir()
    chunk.write_bytes(b"PK\x03\x04 not a zip")
    js = tmp_path / "k.json"
    rc, out, err = run(capsys, "analyze", str(tmp_path / "missing.npy"), str(tr),
                       str(dumps / "tiny.npy"), "--keep-going", "--json", str(js))  # fmt: skip
    assert rc == 2
    doc = json.loads(js.read_text())
    assert {r["name"] for r in doc["records"]} == {"tiny"}
    files = sorted(e["file"] for e in doc["errors"])
    assert files == sorted([str(tmp_path / "missing.npy"), str(tr)])
    rc, _, err = run(capsys, "analyze", str(tr))  # without --keep-going: one line, exit 2
    assert rc == 2 and str(tr) in err and err.count("\n") == 1


def test_fail_on_applies_only_to_rows_with_the_field(tmp_path, capsys):
    tr = tmp_path / "tr"
    with TraceWriter(tr, {}) as tw:
        tw.add_tensor("w", "weight", "e4m3", (4,))
        tw.record(0, "w", np.array([0.5, 1, 2, 4], np.float32), scale=1.0)
    rc, out, err = run(capsys, "analyze", str(tr), "--fail-on", "sqnr_db>1000,rel_mse>0")
    assert rc == 0, err  # trace rows have neither field
    rule = parse_fail_on("sqnr_db>1000")[0]
    assert rule.crossed({"sqnr_db": None, "rel_mse": 0.0, "sqnr_case": "exact"})  # +inf dB
    assert not rule.crossed({"sqnr_db": None, "rel_mse": None, "sqnr_case": "undefined"})


def _expected_crossings(doc, crosses):
    """(rule text, policy, tensor, step) of every replay record for which ``crosses(record,
    events so far)`` holds, earliest step first, then policy order, then record order."""
    found = []
    for pi, pol in enumerate(p["policy"] for p in doc["policies"]):
        events = {}
        for i, r in enumerate(doc["records"][pol]):
            events[r["tensor"]] = events.get(r["tensor"], 0) + int(r["event"])
            for rule, hit in crosses(r, events[r["tensor"]]):
                if hit:
                    found.append((r["step"], pi, i, rule, pol, r["tensor"]))
    found.sort(key=lambda f: f[:3])
    return [(rule, pol, name, step) for step, _, _, rule, pol, name in found]


def test_replay_fail_on(trace, tmp_path, capsys):
    pols = ["--policy", "delayed:history=4,margin=1", "--policy", "current:pow2", "--policy", "static:scale=3"]
    js = tmp_path / "r.json"
    rc, _, err = run(capsys, "replay", str(trace), *pols, "--json", str(js),
                     "--fail-on", "overflow>0,underflow>50%,events>1")  # fmt: skip
    doc = json.loads(js.read_text())

    def crosses(r, events):
        # brackets cross only as a whole: lower bound for ">"; shares of the nonzero values
        return [("overflow>0", r["overflow"][0] > 0),
                ("underflow>50%", r["nonzero"] > 0 and 100 * r["underflow"][0] / r["nonzero"] > 50),
                ("events>1", events > 1)]  # fmt: skip

    want = _expected_crossings(doc, crosses)
    got = [(c["rule"], c["policy"], c["tensor"], c["step"]) for c in doc["fail_on"]]
    assert got == want and {w[0] for w in want} == {"overflow>0", "underflow>50%", "events>1"}
    rule, pol, name, step = want[0]
    assert rc == 1
    assert err.splitlines()[-1] == (f"--fail-on: {len(want)} crossing(s); first: {rule} under policy "
                                    f"{pol}: tensor {name} at step {step}")  # fmt: skip
    # a bracket [0, n] (non-power-of-two scale) crosses neither overflow>0 nor overflow<1
    split = [(p, r["tensor"], r["step"]) for p, recs in doc["records"].items() for r in recs
             if r["overflow"][0] == 0 < r["overflow"][1]]  # fmt: skip
    highs = {(c["policy"], c["tensor"], c["step"]) for c in doc["fail_on"] if c["rule"] == "overflow>0"}
    assert split and highs and not highs & set(split)
    rc, _, _ = run(capsys, "replay", str(trace), *pols, "--json", str(js), "--fail-on", "overflow<1")
    lows = {(c["policy"], c["tensor"], c["step"]) for c in json.loads(js.read_text())["fail_on"]}
    assert rc == 1 and lows and not lows & set(split)
    assert all(r["overflow"][1] < 1 for p, recs in doc["records"].items() for r in recs
               if (p, r["tensor"], r["step"]) in lows)  # fmt: skip
    # a policy that never overflows passes; so does the recorded run when left out
    pow2_ok = all(r["overflow"] == [0, 0] for p, recs in doc["records"].items()
                  if p.startswith("current") for r in recs)  # fmt: skip
    assert pow2_ok
    rc, _, err = run(capsys, "replay", str(trace), "--policy", "current:pow2", "--no-recorded",
                     "--fail-on", "overflow>0")  # fmt: skip
    assert rc == 0 and "--fail-on" not in err
    rc, _, err = run(capsys, "replay", str(trace), "--allreduce", "2", "--fail-on", "overflow>0")
    assert rc == 2 and "not to --allreduce" in err and err.count("\n") == 1


@pytest.mark.parametrize("rules, says", [
    ("sqnr_db<20", "METRIC in overflow, underflow, events"),
    ("events>1%", "no share"),
    ("overflow>>0", "--fail-on rule"),
    ("", "no rules given"),
])  # fmt: skip
def test_replay_fail_on_bad_rules_exit_2(trace, capsys, rules, says):
    rc, out, err = run(capsys, "replay", str(trace), "--policy", "current", "--fail-on", rules)
    assert rc == 2 and says in err and err.count("\n") == 1 and out == ""


def test_plot_labels_take_names_literally(tmp_path):
    # a terminal escape and a malformed mathtext in tensor names: no warning, no refusal
    import warnings

    from fp8sim.analysis.plots import plot_heatmap

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_heatmap(tmp_path / "h.png", "x \x1b[31m $\\frac{$", ["a\x1bb", "$\\frac{x$", "n\nl"],
                     np.arange(3), np.ones((3, 3)))  # fmt: skip
    assert (tmp_path / "h.png").stat().st_size > 0


def test_mx_floor_rule_clamping_is_reported_as_clamping_not_overflow(tmp_path, capsys):
    """One 32-block with amax 480: the OCP floor rule gives X = 2^(floor(log2 480) - 8) = 1, so 480
    lands above E4M3's 448 and the spec clamps it (by hand: 1 value); mx:rceil's X = 2 keeps it."""
    x = np.ones(64, np.float32)
    x[5] = 480.0
    np.save(tmp_path / "x.npy", x)
    rc, out, _ = run(capsys, "analyze", str(tmp_path / "x.npy"), "--format", "e4m3", "--scaling", "mx,mx:rceil",
                     "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert rc == 0
    recs = {r["scaling"]: r for r in json.loads((tmp_path / "r.json").read_text())["records"]}
    assert recs["mx"]["overflow"] == 1 and recs["mx"]["status"] == "warning"
    assert recs["mx:rceil"]["overflow"] == 0 and recs["mx:rceil"]["status"] == "ok"
    assert "clamped 1 (1.56%)" in out and "the spec clamps them to it by design" in out
    # the same share of overflow under any other scaling is one: 1.56% >= a 1% critical share
    assert classify({**recs["mx"], "scaling": "tensor"}, Thresholds(overflow_critical=1.0)) == "critical"
    assert classify(recs["mx"], Thresholds(overflow_critical=1.0)) == "warning"  # clamping: never critical
