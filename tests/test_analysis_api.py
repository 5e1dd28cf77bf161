"""fp8sim.analysis.analyze / replay from Python: inputs in memory read as the same tensors in a
file are, typed records, the CLI's table and JSON, worst(), to_pandas(), argument errors that
name parameters (and flags on the command line)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fp8sim import cli
from fp8sim.analysis import (
    AnalysisResult,
    BadInput,
    ReplayRecord,
    ReplayResult,
    TensorRecord,
    TraceTensorRecord,
    analyze,
    replay,
)
from fp8sim.errors import ArgumentError
from fp8sim.trace import TraceWriter


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


def _fields(rec: TensorRecord) -> dict:
    d = rec.to_dict()
    del d["file"]
    return d


def test_hand_computed_counts_of_an_array():
    # E4M3, no scaling: 1000 rounds above 448 (overflow); 1e-4 is below half the smallest
    # subnormal 2**-9 and becomes 0 (underflow); 0.5 and 300 are exact
    x = np.array([1000.0, 300.0, 1e-4, 0.5], np.float32)
    res = analyze(x, "e4m3", "none")
    (r,) = res.records
    assert isinstance(res, AnalysisResult) and isinstance(r, TensorRecord)
    assert (r.name, r.file, r.shape, r.dtype) == ("array", "<input 0>", (4,), "float32")
    assert (r.overflow, r.underflow, r.status) == (1, 1, "critical")
    assert r.overflow_pct == 25.0 and r.underflow_pct == 25.0 and r.amax == 1000.0


def test_tensors_in_memory_read_as_the_same_tensors_in_a_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(torch.bfloat16)
    q = (torch.randn(32, 16, generator=g) * 50).to(torch.float8_e4m3fn)
    t = torch.randn(40, 24, generator=g).t()  # strided: read in C order without a copy of it
    state = {"w": w, "q": q, "t": t, "wt": w.t(), "qt": q[::2].t()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m.safetensors"))
    kw = dict(formats="e4m3,e5m2", scalings="none,tensor,row,block:8x8,mx")
    mem, disk = analyze(state, **kw), analyze(tmp_path / "m.safetensors", **kw)
    assert len(mem.records) == 5 * 2 * 5
    assert [_fields(r) for r in mem.records] == [_fields(r) for r in disk.records]
    assert {r.file for r in mem.records} == {"<input 0>"}
    amax = {r.name: r.amax for r in mem.records}
    assert amax["q"] == float(q.float().abs().max()) and amax["w"] == float(w.float().abs().max())


def test_numpy_byte_order_strides_and_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((30, 20)) * 100).astype(np.float32)
    native = analyze({"x": x, "b": x.astype(ml_dtypes.bfloat16)}, "e4m3", "tensor,row")
    other = analyze({"x": x.astype(">f4")[::-1][::-1], "b": x.astype(ml_dtypes.bfloat16)},
                    "e4m3", "tensor,row")  # fmt: skip
    assert [_fields(r) for r in other.records] == [_fields(r) for r in native.records]
    strided = analyze({"x": np.asfortranarray(x).T.T, "b": x.astype(ml_dtypes.bfloat16)}, "e4m3",
                      "tensor,row")  # fmt: skip
    assert [_fields(r) for r in strided.records] == [_fields(r) for r in native.records]
    b = {r.scaling: r for r in native.records if r.name == "b"}
    assert b["tensor"].amax == float(np.abs(x.astype(ml_dtypes.bfloat16).astype(np.float32)).max())


def test_a_state_dict_with_shared_tensors_and_other_entries():
    w = torch.ones(8, 8)
    res = analyze({"a": w, "b": w, "step": 3, "ids": torch.arange(4)}, "e4m3", "tensor")
    assert [r.name for r in res.records] == ["a"]
    notes = {n.name: n.note for n in res.notes}
    assert notes["b"] == "skipped: same object as a" and notes["step"] == "skipped: not a tensor (int)"
    assert notes["ids"].startswith("skipped: int64 tensor")


def test_fp8_weights_in_memory_dequantized_with_their_companion(tmp_path, monkeypatch):
    # a config.json in the working directory is not the state_dict's: the default 128x128 holds
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [64, 64]}}))
    monkeypatch.chdir(tmp_path)
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)) * 0.01
    s = torch.stack([w[:128].abs().max(), w[128:].abs().max()]).reshape(2, 1) / 448
    q = torch.cat([(w[:128] / s[0]).to(torch.float8_e4m3fn), (w[128:] / s[1]).to(torch.float8_e4m3fn)])
    res = analyze({"layer.weight": q, "layer.weight_scale_inv": s}, "e4m3", "tensor", fp8_scales="apply")
    (r,) = res.records
    deq = torch.cat([q[:128].float() * s[0], q[128:].float() * s[1]])  # torch's q.float() * s
    assert r.name == "layer.weight" and r.amax == float(deq.abs().max())
    assert r.dequantized_with == "layer.weight_scale_inv: 128x128 block scales (default)"


def test_table_and_json_are_the_commands(tmp_path, capsys, trace):
    np.save(tmp_path / "x.npy", np.linspace(-600, 600, 301, dtype=np.float32))
    args = [str(tmp_path / "x.npy"), str(trace)]
    js = tmp_path / "cli.json"
    assert cli.main(["analyze", *args, "--scaling", "none,tensor", "--top", "3", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    res = analyze(args, scalings="none,tensor")
    assert res.table(top=3) + "\n" == out
    assert res.to_json() + "\n" == js.read_text()
    res.to_json(tmp_path / "lib.json")
    assert (tmp_path / "lib.json").read_text() == js.read_text()
    doc = json.loads(js.read_text())
    assert [TensorRecord.from_dict(r) for r in doc["records"]] == list(res.records)
    assert res.counts == doc["summary"]


def test_worst_ranks_records_and_trace_tensors_together(trace):
    res = analyze(trace, "e4m3", "tensor")
    rows = res.worst(100)
    assert len(rows) == len(res.records) + len(res.traces[0].tensors)
    # "a" grows to 2**8 * randn: recorded overflow, the worst; its saved tensor (randn) is ok
    assert isinstance(rows[0], TraceTensorRecord) and (rows[0].name, rows[0].status) == ("a", "critical")
    assert rows[-1].status == "ok" and res.worst(1) == rows[:1]
    assert "critical" in repr(res).splitlines()[0] and "a@step3" in repr(res)


def test_to_pandas_or_a_clear_import_error(monkeypatch):
    res = analyze(np.linspace(-1, 1, 64, dtype=np.float32), "e4m3,e5m2", "tensor")
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install pandas"):
        res.to_pandas()


def test_to_pandas_columns_are_the_json_fields(trace):
    pytest.importorskip("pandas")
    res = analyze(trace, "e4m3", "tensor,mx")
    df = res.to_pandas()
    assert list(df.columns) == list(res.records[0].to_dict()) and len(df) == len(res.records)
    assert df["overflow"].tolist() == [r.overflow for r in res.records]
    assert len(res.to_pandas("traces")) == 2
    rp = replay(trace, ["current", "static:scale=1"])
    assert len(rp.to_pandas()) == len(rp.records) and len(rp.to_pandas("policies")) == 3


def test_keep_going_lists_bad_inputs(tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.ones(10, np.float32))
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="bad.npy"):
        analyze([good, tmp_path / "bad.npy"])
    res = analyze([good, tmp_path / "bad.npy", tmp_path / "nope.npy"], keep_going=True)
    assert [r.name for r in res.records] == ["good", "good"]
    assert [type(e) for e in res.errors] == [BadInput, BadInput]
    assert [e.file for e in res.errors] == [str(tmp_path / "nope.npy"), str(tmp_path / "bad.npy")]
    assert all(e.name is None for e in res.errors)


@pytest.mark.parametrize("kwargs, names, flags", [
    (dict(fail_on="speed>3"), ("fail_on",), "--fail-on rule 'speed>3': expected METRIC"),
    (dict(margin=float("nan")), ("margin",), "--margin: margin must be finite"),
    (dict(underflow_warning=5, underflow_critical=1), ("underflow_warning", "underflow_critical"),
     "--underflow-warning 5 / --underflow-critical 1: need 0 <= warning"),
    (dict(fp8_block="128x128"), ("fp8_block", "fp8_scales"),
     "--fp8-block applies with --scales apply only"),
    (dict(fp8_scales="apply", fp8_block="12"), ("fp8_block",), "--fp8-block '12': expected RxC"),
    (dict(fp8_scales="both"), ("fp8_scales",), "--scales 'both': valid: stored, apply"),
    (dict(chunk=0), ("chunk",), "--chunk must be an integer >= 1, got 0"),
])  # fmt: skip
def test_argument_errors_name_parameters(kwargs, names, flags):
    from fp8sim.commands.analyze import ANALYZE_FLAGS

    with pytest.raises(ArgumentError) as info:
        analyze(np.ones(4, np.float32), **kwargs)
    assert info.value.arguments == names and str(info.value).startswith(names[0])
    assert info.value.spelled(ANALYZE_FLAGS).startswith(flags)
    assert isinstance(info.value, ValueError)  # bad input: exit code 2 on the command line


def test_other_argument_errors():
    res = analyze(np.ones(4, np.float32))
    with pytest.raises(ArgumentError, match=r"^top must be an integer >= 0"):
        res.table(top=-1)
    with pytest.raises(ArgumentError, match=r"^inputs: expected a path, a numpy array"):
        analyze(42)
    with pytest.raises(ArgumentError, match=r"^inputs\[1\]: expected"):
        analyze([np.ones(3, np.float32), 3.5])
    with pytest.raises(ArgumentError, match="^inputs: none given"):
        analyze([])
    with pytest.raises(ValueError, match="unknown granularity 'blah'"):
        analyze(np.ones(4, np.float32), scalings="blah")


def test_replay_from_python(trace, tmp_path, capsys):
    res = replay(trace, ["delayed:history=4", "current", "current:margin=0"], fail_on="overflow>0")
    assert isinstance(res, ReplayResult) and res.trace_records == 18
    assert [p.policy for p in res.policies][0] == "recorded" and len(res.policies) == 3
    assert len(res.records) == 3 * 18 and isinstance(res.records[0], ReplayRecord)
    rec = [r for r in res.records if r.policy == "recorded" and r.tensor == "a" and r.step == 8][0]
    assert rec.exact and rec.overflow[0] == rec.overflow[1] > 0  # the recorder's own count
    worst = res.worst(3)
    top_share = max(r.overflow_share[0] or 0.0 for r in res.records)
    assert worst[0].overflow_share[0] == top_share
    first = res.crossings[0]
    assert (first.rule, first.tensor) == ("overflow>0", "a")
    assert first.step == min(r.step for r in res.records if r.overflow[0] > 0)
    # the command's JSON and table are the library's
    js = tmp_path / "r.json"
    rc = cli.main(["replay", str(trace), "--policy", "delayed:history=4", "--policy", "current",
                   "--policy", "current:margin=0", "--fail-on", "overflow>0", "--json", str(js)])  # fmt: skip
    assert rc == 1
    assert capsys.readouterr().out == res.table() + "\n"
    assert js.read_text() == res.to_json() + "\n"
    assert "ReplayResult: 3 policies over 18 records" in repr(res)


def test_replay_argument_errors(trace, tmp_path):
    with pytest.raises(ArgumentError, match="^policies: give one policy spec"):
        replay(trace, [])
    with pytest.raises(ArgumentError, match="^fail_on rule 'sqnr_db<3'"):
        replay(trace, "current", fail_on="sqnr_db<3")
    with pytest.raises(ValueError, match="no such directory"):
        replay(tmp_path / "nope", "current")
    assert [p.policy for p in replay(trace, "msamp", include_recorded=False).policies] == ["msamp:window=16,margin=0"]


def test_plots_of_an_in_memory_analysis(tmp_path):
    w = np.linspace(-3, 3, 200, dtype=np.float32)
    res = analyze({"w": w}, "e4m3", "tensor")
    paths = res.plot(tmp_path / "p")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["0000_w.png"]
    assert (tmp_path / "p" / "0000_w.png").read_bytes()[:4] == b"\x89PNG"
    (h,) = res.histograms  # values per binade floor(log2|x|), as numpy counts them
    e, n = np.unique(np.floor(np.log2(np.abs(w[w != 0]))).astype(int), return_counts=True)
    assert h.exponents.tolist() == list(range(e[0], e[-1] + 1))
    assert dict(zip(h.exponents.tolist(), h.counts.tolist())) == {k: int(c) for k, c in zip(e, n)} | {
        k: 0 for k in range(e[0], e[-1] + 1) if k not in e}
