"""fp8sim analyze / replay on the edges a demanding user hits: stray or damaged trace.json files,
big-endian arrays, damaged stored .npz members (CRC-32), options checked before any work,
paths after options, duplicate variants, clashing .pt names, overlapping safetensors offsets,
all-NaN tensors, internal errors (exit 3, not 1)."""

from __future__ import annotations

import json
import struct
import zipfile

import numpy as np
import pytest

from fp8sim import cli
from fp8sim.trace import TraceWriter


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def records(path):
    return json.loads(path.read_text())["records"]


@pytest.fixture()
def good(tmp_path):
    p = tmp_path / "good.npy"
    np.save(p, np.array([0.5, -3.0, 1e-9, 700.0], np.float32))  # 700 overflows e4m3 (max 448)
    return p


@pytest.fixture()
def trace(tmp_path):
    path = tmp_path / "trace"
    with TraceWriter(path, {"run": "t"}, chunk_steps=4) as tw:
        tw.add_tensor("w", "weight", "e4m3", (4,))
        tw.record(0, "w", np.array([0.5, 1, 2, 4], np.float32), scale=1.0)
    return path


# ---- trace.json that is not ours, or ours but damaged ----------------------------------------
@pytest.mark.parametrize("text", ["null", "[1, 2]", '"fp8sim"', '{"traceEvents": []}'])
def test_a_foreign_trace_json_is_a_plain_folder(tmp_path, good, capsys, text):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "trace.json").write_text(text)  # a profiler's, say
    np.save(d / "sub" / "x.npy", np.load(good))
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", d, "--format", "e4m3", "--scaling", "none", "--json", js)
    assert rc == 0, err
    assert [r["name"] for r in records(js)] == ["x"]
    rc, out, err = run(capsys, "replay", d / "sub", "--policy", "msamp")
    assert rc == 2 and "not an fp8sim trace directory" in err and err.count("\n") == 1


def test_a_damaged_trace_json_is_refused_by_name(tmp_path, good, trace, capsys):
    (trace / "trace.json").write_text('{"schema": "fp8sim-trace", "vers')  # cut short
    rc, out, err = run(capsys, "analyze", trace)
    assert rc == 2 and "corrupt trace.json" in err and str(trace) in err
    rc, out, err = run(capsys, "replay", trace, "--policy", "msamp")
    assert rc == 2 and "corrupt trace.json" in err
    # inside a directory, with --keep-going: the other files are still analyzed
    d = tmp_path
    js = tmp_path / "k.json"
    rc, out, err = run(capsys, "analyze", d, "--keep-going", "--format", "e4m3", "--json", js)
    assert rc == 2
    doc = json.loads(js.read_text())
    assert {r["name"] for r in doc["records"]} == {"good"}
    assert [e["file"] for e in doc["errors"]] == [str(trace)]


def test_replay_names_a_missing_directory(tmp_path, capsys):
    rc, out, err = run(capsys, "replay", tmp_path / "nope", "--policy", "msamp")
    assert rc == 2 and "no such directory" in err


# ---- big-endian data ---------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [">f2", ">f4", ">f8"])
def test_big_endian_arrays_give_the_native_figures(tmp_path, capsys, dt):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1000) * 100).astype(dt)
    x[5] = np.nan
    np.save(tmp_path / "be.npy", x)
    np.savez(tmp_path / "be.npz", m=x)
    np.save(tmp_path / "le.npy", x.astype(x.dtype.newbyteorder("<")))
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", tmp_path / "be.npy", tmp_path / "be.npz", tmp_path / "le.npy",
                       "--scaling", "none,tensor", "--json", js)  # fmt: skip
    assert rc == 0, err
    recs = records(js)
    key = ("format", "scaling", "amax", "overflow", "underflow", "subnormal", "nan", "sqnr_db")
    by_name = {n: [tuple(r[k] for k in key) for r in recs if r["name"] == n] for n in ("be", "m", "le")}
    assert by_name["be"] == by_name["le"] == by_name["m"] and len(by_name["le"]) == 4
    assert by_name["le"][0][2] == float(np.float32(np.nanmax(np.abs(x.astype(np.float64)))))  # float32 amax
    assert by_name["le"][0][6] == 1


# ---- stored .npz members: CRC-32 ---------------------------------------------------------------
def _flip_data_byte(path, member, at_fraction=0.5):
    """Flip one byte in the middle of a stored member's data (its CRC no longer matches)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    raw = bytearray(path.read_bytes())
    (name_len, extra_len) = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    pos = start + int(info.compress_size * at_fraction)
    raw[pos] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_damaged_stored_npz_member_is_refused(tmp_path, capsys, order):
    x = np.asfortranarray(np.ones((300, 300), np.float32)) if order == "F" else np.ones((300, 300), np.float32)
    p = tmp_path / "s.npz"
    np.savez(p, a=x, b=np.ones(10, np.float32))  # stored, not compressed
    js = tmp_path / "ok.json"
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3", "--scaling", "none", "--json", js)
    assert rc == 0, err  # intact: read as it is
    assert {r["name"]: r["amax"] for r in records(js)} == {"a": 1.0, "b": 1.0}
    _flip_data_byte(p, "a.npy")
    with pytest.raises(zipfile.BadZipFile):  # what numpy itself says of this file
        np.load(p)["a"]
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3", "--scaling", "none")
    assert rc == 2 and "a.npy" in err and ("CRC" in err) and err.count("\n") == 1
    # with --keep-going the intact member of another file still counts, the bad file is listed
    q = tmp_path / "q.npy"
    np.save(q, np.full(4, 2.0, np.float32))
    rc, out, err = run(capsys, "analyze", p, q, "--keep-going", "--format", "e4m3", "--scaling", "none",
                       "--json", js)  # fmt: skip
    assert rc == 2 and [e["file"] for e in json.loads(js.read_text())["errors"]] == [str(p)]


# ---- options checked before any file is read ----------------------------------------------------
@pytest.mark.parametrize("argv, what", [
    (["--fail-on", ""], "--fail-on"),
    (["--margin", "nan"], "--margin"),
    (["--margin", "1000", "--keep-going"], "--margin"),
    (["--underflow-warning", "3", "--underflow-critical", "2"], "--underflow-warning"),
    (["--underflow-warning", "nan"], "--underflow-warning"),
    (["--scaling", "block:1x99999999999999999999"], "block:1x99999999999999999999"),
    (["--fp8-block", "128x128"], "--fp8-block applies with --scales apply only"),
    (["--fp8-block", "128x128", "--fp8-scales", "stored"], "--fp8-block applies with --scales apply only"),
    (["--fp8-block", "128x128", "--scales", "stored"], "--scales apply"),
])  # fmt: skip
def test_bad_options_are_one_line_exit_2(good, capsys, argv, what):
    rc, out, err = run(capsys, "analyze", good, *argv)
    assert rc == 2 and what in err and err.count("\n") == 1 and out == ""
    assert "bad files" not in err


def test_an_unwritable_json_destination_is_refused_first(tmp_path, good, capsys):
    rc, out, err = run(capsys, "analyze", good, "--json", tmp_path / "no" / "such" / "r.json")
    assert rc == 2 and "--json" in err and out == ""  # refused before the analysis (no table)
    rc, out, err = run(capsys, "analyze", good, "--json", tmp_path)
    assert rc == 2 and "is a directory" in err


def test_json_replaces_an_old_file_whole(tmp_path, good, capsys):
    js = tmp_path / "r.json"
    js.write_text("old")
    rc, out, err = run(capsys, "analyze", good, "--format", "e4m3", "--scaling", "none", "--json", js)
    assert rc == 1 or rc == 0
    assert records(js)[0]["name"] == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.npy", "r.json"]  # no temp left


def test_paths_after_options_are_paths(tmp_path, good, capsys):
    other = tmp_path / "other.npy"
    np.save(other, np.ones(3, np.float32))
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", good, "--scaling", "none", "--format", "e4m3", other,
                       "--json", js)  # fmt: skip
    assert rc == 0, err
    assert [r["name"] for r in records(js)] == ["good", "other"]
    rc, out, err = run(capsys, "analyze", good, "--bogus")
    assert rc == 2 and "fp8sim analyze: error: unrecognized arguments: --bogus" in err


# ---- what is analyzed -----------------------------------------------------------------------------
def test_duplicate_variants_are_analyzed_once(good, tmp_path, capsys):
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", good, "--format", "e4m3,e4m3fn", "--scaling", "tensor,TENSOR",
                       "--json", js)  # fmt: skip
    assert rc == 0, err
    assert [(r["format"], r["scaling"]) for r in records(js)] == [("e4m3", "tensor")]


def test_clashing_pt_names_stay_apart(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    p = tmp_path / "c.pt"
    torch.save({"a.b": torch.full((3,), 2.0), "a": {"b": torch.full((3,), 5.0)}}, p)
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3", "--scaling", "none", "--json", js)
    assert rc == 0, err
    assert sorted((r["name"], r["amax"]) for r in records(js)) == [("a.b", 2.0), ("a.b#2", 5.0)]


def _safetensors(path, entries, data):
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_overlapping_safetensors_offsets_are_refused(tmp_path, capsys):
    data = np.arange(6, dtype=np.float32).tobytes()
    p = tmp_path / "o.safetensors"
    _safetensors(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                     "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, data)  # fmt: skip
    rc, out, err = run(capsys, "analyze", p)
    assert rc == 2 and "share bytes" in err and "'a'" in err and "'b'" in err
    ok = tmp_path / "k.safetensors"
    _safetensors(ok, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                      "e": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}, data)  # fmt: skip
    rc, out, err = run(capsys, "analyze", ok, "--format", "e4m3", "--scaling", "none")
    assert rc == 0, err


def test_an_all_nan_tensor_has_no_sqnr(tmp_path, capsys):
    p = tmp_path / "n.npy"
    np.save(p, np.array([np.nan, np.inf, -np.inf], np.float32))
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3", "--scaling", "none,tensor", "--json", js)
    assert rc == 0, err
    for r in records(js):
        assert r["sqnr_db"] is None and r["rel_mse"] is None and r["nan"] == 1 and r["inf"] == 2
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3", "--scaling", "none")
    assert "exact" not in out  # nothing was compared, so nothing was exact


def test_json_and_table_tell_the_three_sqnr_cases_apart(tmp_path, capsys):
    # margin 126 with amax 3e38: the scale underflows to 0, 0 x inf dequantizes to NaN -- an
    # unbounded error (-inf dB), the worst; an all-NaN tensor: undefined; exact values: no error
    bad, nan, ok = tmp_path / "bad.npy", tmp_path / "nan.npy", tmp_path / "ok.npy"
    np.save(bad, np.array([3e38, 1.0, -2.0, 0.0], np.float32))
    np.save(nan, np.array([np.nan, np.nan], np.float32))
    np.save(ok, np.array([1.0, 2.0, -0.5], np.float32))  # e4m3 values, scale 1 under none
    js = tmp_path / "r.json"
    argv = ["analyze", ok, nan, bad, "--format", "e4m3", "--margin", "126", "--json", js]
    rc, _, err = run(capsys, *argv, "--scaling", "tensor")
    assert rc == 0, err
    by = {r["name"]: r for r in records(js)}
    assert (by["bad"]["sqnr_db"], by["bad"]["rel_mse"], by["bad"]["sqnr_case"]) == (None, None, "unbounded")
    assert (by["nan"]["sqnr_db"], by["nan"]["rel_mse"], by["nan"]["sqnr_case"]) == (None, None, "undefined")
    assert by["ok"]["sqnr_case"] == "finite" and by["ok"]["sqnr_db"] is not None
    rc, out, err = run(capsys, *argv[:-2], "--scaling", "none")
    rows = {ln.split()[1]: ln.split()[-1] for ln in out.splitlines()[2:5]}
    assert rows["ok"] == "exact" and rows["nan"] == "-"
    rc, out, err = run(capsys, *argv[:-2], "--scaling", "tensor")
    rows = [(ln.split()[1], ln.split()[-1]) for ln in out.splitlines()[2:5]]
    # bad and ok both critical (every value underflows): the unbounded error is the worse
    assert rows == [("bad", "-inf"), ("ok", "0.0"), ("nan", "-")]
    # --fail-on: the unbounded error crosses sqnr_db<20 and rel_mse>1, the undefined one neither
    for rule in ("sqnr_db<20", "rel_mse>1"):
        rc, _, err = run(capsys, "analyze", bad, nan, "--format", "e4m3", "--margin", "126",
                         "--fail-on", rule)
        assert rc == 1 and "by bad" in err, (rule, err)
        rc, _, err = run(capsys, "analyze", nan, "--format", "e4m3", "--fail-on", rule)
        assert rc == 0, (rule, err)


def test_an_amax_beyond_float32_is_inf_in_the_table_and_the_rules(tmp_path, capsys):
    # float32(1e40) is inf: the amax is inf (JSON null, as every non-finite figure)
    p = tmp_path / "big.npy"
    np.save(p, np.array([1e40, 1.0, 2.0]))
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3", "--json", js)
    assert rc == 0, err
    (r,) = records(js)
    assert r["amax"] is None and r["overflow"] == 1
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3")
    assert out.splitlines()[2].split()[5] == "inf"
    for rule, crossed in (("amax>1e30", True), ("amax<1", False), ("amax>=1e38", True)):
        rc, _, err = run(capsys, "analyze", p, "--format", "e4m3", "--fail-on", rule)
        assert rc == (1 if crossed else 0), (rule, err)


def test_trace_records_of_one_step_count_as_one_step(tmp_path, capsys):
    # two records per step (micro-batches): 2 steps, overflow in step 0 only; the counts add up
    rng = np.random.default_rng(0)
    xs = {}
    with TraceWriter(tmp_path / "tr", {}) as tw:
        tw.add_tensor("X", "weight_grad", "e4m3", (256,))
        for step in range(2):
            for _ in range(2):
                x = rng.standard_normal(256).astype(np.float32) * (1000 if step == 0 else 1)
                tw.record(step, "X", x, scale=1.0)
                xs.setdefault(step, []).append(x)
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", tmp_path / "tr", "--json", js)
    (row,) = json.loads(js.read_text())["traces"][0]["tensors"]
    over = sum(int((np.abs(x) > 464).sum()) for x in xs[0])  # e4m3: above 464 rounds past 448
    assert (row["steps"], row["overflow_steps"], row["overflow"]) == (2, 1, over) and over > 0


def test_an_unwritable_plot_dir_is_refused_before_any_work(good, tmp_path, capsys, monkeypatch):
    import tempfile

    real = tempfile.TemporaryFile
    target = str(tmp_path / "p")

    def refused(*a, dir=None, **k):  # an immutable or read-only directory (root passes chmod)
        if dir is not None and str(dir) == target:
            raise PermissionError(1, "Operation not permitted")
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    calls = []
    monkeypatch.setattr("fp8sim.analysis.stats.tensor_stats", lambda *a, **k: calls.append(1))
    rc, out, err = run(capsys, "analyze", good, "--plot", tmp_path / "p")
    assert rc == 2 and not calls and err.strip().endswith("p: not writable (Operation not permitted)")


def test_an_internal_error_exits_3_in_one_line(good, capsys, monkeypatch):
    import fp8sim.analysis.stats as stats_mod

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(stats_mod, "tensor_stats", boom)
    monkeypatch.delenv("FP8SIM_DEBUG", raising=False)
    rc, out, err = run(capsys, "analyze", good)
    assert rc == 3 and "internal error: RuntimeError: boom" in err and err.count("\n") == 1


def test_a_newline_in_a_file_name_stays_in_one_line(tmp_path, capsys):
    bad = tmp_path / "odd\nname.npy"
    bad.write_bytes(b"not an npy file")
    rc, out, err = run(capsys, "analyze", bad)
    assert rc == 2 and err.count("\n") == 1 and "odd\\nname.npy" in err and "corrupt" in err
    good = tmp_path / "g.npy"
    np.save(good, np.ones(3, np.float32))
    rc, out, err = run(capsys, "analyze", bad, good, "--keep-going", "--format", "e4m3")
    listed = err.split("bad files (1):\n", 1)[1]
    assert rc == 2 and listed.count("\n") == 1 and "odd\\nname.npy" in listed


def test_one_line_keeps_short_messages_whole_and_cuts_long_ones():
    from fp8sim.commands.output import one_line

    assert one_line("a\nb: corrupt") == "a\\nb: corrupt"
    assert one_line("plain") == "plain"
    long = "first line\n" + "x" * 1000
    assert one_line(long) == "first line"


def test_fail_on_takes_both_infinities():
    from fp8sim.analysis.report import parse_fail_on

    (hi,), (lo,) = parse_fail_on("amax>=inf"), parse_fail_on("sqnr_db>-inf")
    assert hi.value == float("inf") and lo.value == float("-inf")
    assert not hi.crossed({"amax": 1e300}) and hi.crossed({"amax": None})  # null amax: inf
    assert lo.crossed({"sqnr_db": -1e300, "rel_mse": 1.0})
    with pytest.raises(ValueError, match="never fire"):  # a count is never inf
        parse_fail_on("overflow>inf")
    with pytest.raises(ValueError):
        parse_fail_on("overflow>nan")


def test_hugging_face_torch_bin_checkpoints(tmp_path, capsys):
    """``pytorch_model*.bin`` (torch.save zips) are read in a directory and when named; another
    .bin in a directory is left alone; a .bin that is no torch file is refused in one line."""
    import torch

    d = tmp_path / "hf"
    d.mkdir()
    torch.save({"w": torch.full((4,), 700.0)}, d / "pytorch_model-00001-of-00002.bin")
    torch.save({"v": torch.ones(3)}, d / "pytorch_model-00002-of-00002.bin")
    torch.save({"lr": 1e-3}, d / "training_args.bin")  # not weights: not picked up
    (d / "vocab.bin").write_bytes(b"\x00\x01\x02\x03")
    out = tmp_path / "r.json"
    rc, _, err = run(capsys, "analyze", d, "--format", "e4m3", "--scaling", "none", "--json", out)
    assert rc == 0, err
    recs = records(out)
    assert sorted((r["name"], r["overflow"]) for r in recs) == [("v", 0), ("w", 4)]
    assert all(r["file"].endswith(".bin") and "pytorch_model" in r["file"] for r in recs)
    rc, _, err = run(capsys, "analyze", d / "training_args.bin")  # named: opened, nothing to analyze
    assert rc == 2 and "no data analyzed" in err and "lr: skipped: not a tensor" in err
    rc, _, err = run(capsys, "analyze", d / "training_args.bin", "--allow-empty")
    assert rc == 0 and "lr: skipped: not a tensor" in err
    rc, _, err = run(capsys, "analyze", d / "vocab.bin")
    assert rc == 2 and "vocab.bin: a .bin file that is not a torch checkpoint" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("rule, says", [("overflow<0", "never negative"), ("events>-1", "never negative"),
                                        ("events>=0", "never negative"), ("overflow>=0", "never negative"),
                                        ("underflow>200%", "at most 100%")])  # fmt: skip
def test_fail_on_rules_that_cannot_decide_are_refused(rule, says):
    from fp8sim.analysis.report import REPLAY_FAIL_METRICS, parse_fail_on

    with pytest.raises(ValueError, match=says):
        parse_fail_on(rule, REPLAY_FAIL_METRICS)
    assert parse_fail_on("sqnr_db<-3")[0].value == -3  # a negative SQNR is a real figure
