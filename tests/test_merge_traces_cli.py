"""``fp8sim merge RUN_DIR --out DIR``: a run's rank traces merged into one trace by the command
that also merges analyze results. The merged trace is what ``merge_rank_traces`` writes (every
record, histogram, saved tensor and rank scale equal; only the trace id and the creation time
differ), nothing that exists is overwritten, and every misuse is one line, exit 2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from fp8sim import cli
from fp8sim.trace import TraceReader
from fp8sim.trace.merge import merge_rank_traces
from tests.test_trace_merge import _run


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_same_trace(a, b):
    """Two traces hold the same config, catalogue, records, saved tensors and rank scales."""
    ra, rb = TraceReader(a), TraceReader(b)
    assert ra.config == rb.config and ra.meta["tensors"] == rb.meta["tensors"]
    assert ra.rounding == rb.rounding and ra.meta["chunk_steps"] == rb.meta["chunk_steps"]
    recs_a, recs_b = list(ra.records()), list(rb.records())
    assert len(recs_a) == len(recs_b) > 0
    for x, y in zip(recs_a, recs_b):
        assert (x.step, x.name, x.format, x.numel, x.zero, x.nan, x.inf, x.overflow, x.underflow) == (
            y.step, y.name, y.format, y.numel, y.zero, y.nan, y.inf, y.overflow, y.underflow)
        assert np.array_equal([x.amax, x.scale], [y.amax, y.scale], equal_nan=True)
        np.testing.assert_array_equal(x.hist.bins, y.hist.bins)
        np.testing.assert_array_equal(x.hist.counts, y.hist.counts)
    assert ra.saved_tensors() == rb.saved_tensors() and ra.saved_tensors()
    for step, name in ra.saved_tensors():
        ta, tb = ra.load_tensor(step, name), rb.load_tensor(step, name)
        assert ta.dtype == tb.dtype and torch.equal(ta.nan_to_num(7.0), tb.nan_to_num(7.0))
    with np.load(os.path.join(a, "rank_scales.npz")) as sa, np.load(os.path.join(b, "rank_scales.npz")) as sb:
        assert sorted(sa.files) == sorted(sb.files)
        for k in sa.files:
            np.testing.assert_array_equal(sa[k], sb[k])


def test_merge_writes_the_library_merged_trace(tmp_path, capsys, monkeypatch):
    run_dir = _run(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    rc, out, err = run(capsys, "merge", "record", "--out", "merged")
    assert rc == 0 and out == "", err
    assert err.strip() == ("merged 2 rank traces of record into merged: 3 tensors, 3 steps (partitioned "
                           "tensors summed, replicated ones checked equal and taken once; each rank's "
                           "scales in rank_scales.npz)")  # fmt: skip
    ref = merge_rank_traces("record", tmp_path / "ref")
    assert_same_trace(tmp_path / "merged", ref)
    assert TraceReader(tmp_path / "merged").config["merged"] == {"from": "record", "ranks": 2}
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank0", "rank1"]  # the run untouched
    # the merged trace analyzes as the run directory does (same figures, another path shown)
    rc1, _, _ = run(capsys, "analyze", "merged", "--json", "a.json")
    rc2, _, _ = run(capsys, "analyze", "record", "--json", "b.json")
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    def rows(doc):
        return [{k: v for k, v in r.items() if k != "file"} for r in doc["traces"][0]["tensors"]]

    assert rc1 == rc2 and a["records"] and rows(a) == rows(b)
    assert [r["amax"] for r in a["records"]] == [r["amax"] for r in b["records"]]
    # --jobs: the workers open the merged trace behind the run directory shown
    rc3, _, _ = run(capsys, "analyze", "record", "--jobs", "2", "--json", "c.json")
    assert rc3 == rc2 and (tmp_path / "c.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_merge_never_overwrites(tmp_path, capsys):
    run_dir = _run(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("keep")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for dest in ("full", "empty", "file", "dangling"):
        rc, out, err = run(capsys, "merge", run_dir, "--out", tmp_path / dest)
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert f"{tmp_path / dest}: exists; the merged trace goes to a new directory" in err
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep" and (tmp_path / "file").read_text() == "keep"
    assert not any((tmp_path / "empty").iterdir()) and os.readlink(tmp_path / "dangling") == str(tmp_path / "nowhere")
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == ["dangling", "empty", "file", "full", "record"]  # no temporary left behind


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A run's record directory, a JSON file, an empty folder and a run missing rank 1."""
    tmp_path = tmp_path_factory.mktemp("inputs")
    run_dir = _run(tmp_path)
    (tmp_path / "part.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    gap = tmp_path / "gap"
    gap.mkdir()
    for r in (0, 2):
        os.symlink(run_dir / f"rank{r % 2}", gap / f"rank{r}")
    return tmp_path, run_dir


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{run}"], "record: a run's rank traces: give --out DIR, the new directory of the merged trace"),
        (["{run}", "--out", "{t}/m", "--json", "{t}/m.json"], "--json is for analyze results; a run's rank traces merge into --out DIR"),
        (["{run}", "--out", "{t}/m", "--top", "5"], "--top is for analyze results"),
        (["{run}", "{t}/part.json", "--out", "{t}/m"], "merge takes one run's record directory at a time (given with other analyze results"),
        (["{run}", "{run}", "--out", "{t}/m"], "merge takes one run's record directory at a time (given with other runs"),
        (["{run}/rank0", "--out", "{t}/m"], "rank0: one trace, nothing to merge"),
        (["{t}/empty", "--out", "{t}/m"], "empty: a directory without rank traces (rank0/, rank1/, ..."),
        (["{t}/gap", "--out", "{t}/m"], "gap: rank traces rank1 missing (found rank0, rank2)"),
        (["{run}", "--out", "{run}/rank2"], "rank2: inside the run's rank traces (or named like one, rank2)"),
        (["{run}", "--out", "{run}/rank0/sub"], "sub: inside the run's rank traces (or named like one, rank0)"),
        (["{run}", "--out", "{t}/no/such"], "such: its folder"),
        (["{t}/part.json", "--out", "{t}/m"], "--out is for a run's rank traces; the merged analyze result goes to --json FILE"),
        (["{t}/missing", "--out", "{t}/m"], "missing: no such file or directory"),
    ],
)
def test_merge_misuse_is_one_line(inputs, capsys, argv, message):
    tmp_path, run_dir = inputs
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    rc, out, err = run(capsys, "merge", *[a.format(run=run_dir, t=tmp_path) for a in argv])
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("fp8sim merge: error: ") and message in err, err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written
