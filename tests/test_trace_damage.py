"""Damaged traces fail in one line naming the file (exit 2 in the CLI): lost, moved or copied
chunk files, edited trace.json settings and edited chunk values are never replayed as numbers,
and an interrupted truncation never leaves a gap."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fp8sim import cli
from fp8sim.trace import TraceReader, TraceWriter


def make(path: Path, steps: int = 6, chunk_steps: int = 2) -> Path:
    rng = np.random.default_rng(0)
    with TraceWriter(path, chunk_steps=chunk_steps) as tw:
        tw.add_tensor("a", "activation", "e4m3", (64,))
        for s in range(steps):
            x = rng.standard_normal(64).astype(np.float32)
            tw.record(s, "a", x, scale=float(448 / np.abs(x).max()))
    return path


def chunks(path: Path) -> list[Path]:
    return sorted((path / "chunks").iterdir())


def replay(capsys, path) -> tuple[int, str]:
    rc = cli.main(["replay", str(path), "--policy", "current"])
    _, err = capsys.readouterr()
    return rc, err


def test_the_intact_trace_replays(tmp_path, capsys):
    t = make(tmp_path / "t")
    assert [p.name[:12] for p in chunks(t)] == ["chunk-000000", "chunk-000001", "chunk-000002"]
    assert replay(capsys, t)[0] == 0


@pytest.mark.parametrize("damage, says", [
    ("lose the middle chunk", "chunk 000001 is missing"),
    ("renumber the first chunk last", "chunk 000000 is missing"),
    ("copy a chunk after the last", "not after step 5"),
])  # fmt: skip
def test_lost_moved_or_copied_chunks_are_refused(tmp_path, capsys, damage, says):
    t = make(tmp_path / "t")
    c = chunks(t)
    if damage == "lose the middle chunk":
        c[1].unlink()
    elif damage == "renumber the first chunk last":
        c[0].rename(c[0].with_name(c[0].name.replace("chunk-000000", "chunk-000009")))
    else:
        shutil.copy(c[1], c[1].with_name(c[1].name.replace("chunk-000001", "chunk-000003")))
    with pytest.raises(ValueError, match=says):
        TraceReader(t)
    rc, err = replay(capsys, t)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bits", [11, 64, -1])
def test_edited_histogram_bits_are_refused(tmp_path, capsys, bits):
    t = make(tmp_path / "t")
    meta = json.loads((t / "trace.json").read_text())
    meta["hist"]["mantissa_bits"] = bits
    (t / "trace.json").write_text(json.dumps(meta))
    rc, err = replay(capsys, t)
    assert rc == 2 and "mantissa_bits" in err and "outside 0..10" in err


@pytest.mark.parametrize("column, value, says", [
    ("scale", np.nan, "scale that is not finite"),
    ("scale", -1.0, "scale that is not finite"),
    ("scale", 1e39, "scale that is not finite"),  # inf as a float32
    ("numel", 0, "differs from numel"),
    ("zero", 99999, "differs from numel"),
    ("step", -5, "steps outside 0..1"),
    ("step", 2, "steps outside 0..1"),
    ("step", 1, "steps out of order"),
    ("hist_counts", -1000, "negative histogram counts"),
    ("overflow", -7, "negative overflow"),
    ("overflow", 65, "more overflow than finite values"),
    ("amax", -5.0, "negative amax"),
    ("hist_bins", 10**9, "bin ids outside"),
    ("hist_bins", 0, "bins not ascending"),  # the first record's second bin below its first
])  # fmt: skip
def test_edited_chunk_values_are_refused(tmp_path, capsys, column, value, says):
    t = make(tmp_path / "t")
    first = chunks(t)[0]
    with np.load(first) as z:
        cols = {k: z[k].copy() for k in z.files}
    row = 1 if column == "hist_bins" and value == 0 else 0
    cols[column][row] = value
    if column == "step" and value == 1:  # rows 1, 0: out of order
        cols["step"][1] = 0
    np.savez_compressed(first, **cols)
    with pytest.raises(ValueError, match=f"{first.name}: corrupt trace chunk: .*{says}"):
        list(TraceReader(t).records())
    rc, err = replay(capsys, t)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1


def test_negative_steps_are_refused_when_recording(tmp_path):
    tw = TraceWriter(tmp_path / "t")
    tw.add_tensor("a", "activation", "e4m3", (4,))
    with pytest.raises(ValueError, match="steps must be >= 0"):
        tw.record(-1, "a", np.ones(4, np.float32), scale=1.0)


def test_interrupted_truncation_leaves_a_readable_prefix(tmp_path, monkeypatch):
    """The truncation removes chunks from the last one down: killed after the first removal,
    the trace still reads (its early steps), and a second truncation finishes the job."""
    t = make(tmp_path / "t", steps=8)  # chunks 0..3: steps 0-1, 2-3, 4-5, 6-7
    real_unlink = Path.unlink
    removed = []

    def unlink_once(self, *a, **k):
        if removed:
            raise KeyboardInterrupt
        removed.append(self.name)
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", unlink_once)
    tw = TraceWriter(t, mode="a")
    with pytest.raises(KeyboardInterrupt):
        tw.truncate_after(1)
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert len(removed) == 1 and removed[0].startswith("chunk-000003")  # the last one first
    r = TraceReader(t)
    assert sorted(set(r.steps().tolist())) == list(range(6))
    TraceWriter(t, mode="a").truncate_after(1)
    assert sorted(set(TraceReader(t).steps().tolist())) == [0, 1]


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(rounding="stochastic"), "rounding 'stochastic' is not one of"),
    (lambda m: m["tensors"][0].update(format="e9m9"), "e9m9"),
    (lambda m: m["tensors"].append(dict(m["tensors"][0])), "tensor names listed twice: a"),
])  # fmt: skip
def test_edited_catalogue_is_refused(tmp_path, capsys, edit, says):
    t = make(tmp_path / "t")
    meta = json.loads((t / "trace.json").read_text())
    edit(meta)
    (t / "trace.json").write_text(json.dumps(meta))
    rc, err = replay(capsys, t)
    assert rc == 2 and "trace.json: corrupt trace.json" in err and says in err


def test_coarse_histograms_give_brackets_for_power_of_two_scales(tmp_path, capsys):
    """A trace with 2 histogram mantissa bits cannot give e4m3's counts exactly (its thresholds
    need 4); power-of-two policies get a bracket then, as other scales do, not an error."""
    rng = np.random.default_rng(1)
    with TraceWriter(tmp_path / "t", hist_mantissa_bits=2) as tw:
        tw.add_tensor("a", "activation", "e4m3", (256,))
        for s in range(3):
            tw.record(s, "a", rng.standard_normal(256).astype(np.float32) * 300, scale=1.0)
    out = tmp_path / "r.json"
    rc = cli.main(["replay", str(tmp_path / "t"), "--policy", "current:pow2", "--policy", "msamp",
                   "--json", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    recs = json.loads(out.read_text())["records"]
    rows = [r for p, rs in recs.items() if p != "recorded" for r in rs]
    assert all(r["overflow"][0] <= r["overflow"][1] for r in rows) and len(rows) == 6


def test_empty_json_destination_is_refused(tmp_path, capsys):
    rc, err = (cli.main(["replay", str(make(tmp_path / "t")), "--policy", "current", "--json", ""]),
               capsys.readouterr().err)  # fmt: skip
    assert rc == 2 and "--json: an empty path" in err


def test_a_tensor_recorded_twice_in_a_step_reads(tmp_path):
    """Micro-batches (or a layer called twice) record a tensor more than once per step: legal."""
    with TraceWriter(tmp_path / "t", chunk_steps=2) as tw:
        tw.add_tensor("a", "activation", "e4m3", (4,))
        for s in range(3):
            for _ in range(2):
                tw.record(s, "a", np.ones(4, np.float32), scale=1.0)
    assert len(list(TraceReader(tmp_path / "t").records())) == 6


def _rewrite_chunk(path: Path, change) -> None:
    with np.load(path) as z:
        cols = {k: z[k] for k in z.files}
    change(cols)
    np.savez_compressed(path, **cols)


def test_counts_that_would_wrap_when_summed_are_refused(tmp_path, capsys):
    """Issue 30: 1100 records of 2**53 values each sum past int64 (numel -7.6e18, underflow
    -70%, status ok, and --fail-on passing); such a trace is refused by name, by both commands."""
    t = make(tmp_path / "t", steps=1100, chunk_steps=1100)

    def huge(cols):
        hist = cols["numel"] - cols["zero"] - cols["nan"] - cols["inf"]
        cols["numel"] = np.full_like(cols["numel"], 2**53)
        cols["zero"] = cols["numel"] - cols["nan"] - cols["inf"] - hist  # still consistent per record

    _rewrite_chunk(chunks(t)[0], huge)
    from fp8sim.analysis import analyze

    with pytest.raises(ValueError, match=r"damaged trace: the numel counts of 'a' add up to about 9.91e\+18"):
        analyze(str(t))
    for argv in (["analyze", str(t), "--fail-on", "underflow>1%"],
                 ["replay", str(t), "--policy", "current", "--fail-on", "underflow>1%"]):  # fmt: skip
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{t}: damaged trace: the numel counts of 'a'" in err, err


def test_a_chunk_of_another_trace_is_refused_naming_both(tmp_path, capsys):
    a, b = make(tmp_path / "a"), make(tmp_path / "b")
    ida, idb = (json.loads((t / "trace.json").read_text())["trace_id"] for t in (a, b))
    assert ida != idb and len(ida) == 32
    shutil.copy(chunks(b)[1], chunks(a)[1])  # the same name and steps, another trace's records
    with pytest.raises(ValueError) as e:
        TraceReader(a).scalars()
    assert str(e.value) == (f"{chunks(a)[1]}: a chunk of another trace (id {idb}), not of {a} (id {ida}); "
                            "refused: copied in from elsewhere?")  # fmt: skip
    rc, err = replay(capsys, a)
    assert rc == 2 and f"a chunk of another trace (id {idb}), not of {a}" in err
    _rewrite_chunk(chunks(a)[1], lambda cols: cols.pop("trace_id"))  # one without an id: refused too
    with pytest.raises(ValueError, match="a chunk without a trace id, not of"):
        TraceReader(a).scalars()


def test_a_trace_of_an_older_version_has_no_ids_and_still_reads(tmp_path):
    t = make(tmp_path / "t")
    meta = json.loads((t / "trace.json").read_text())
    del meta["trace_id"]
    (t / "trace.json").write_text(json.dumps(meta))
    for c in chunks(t):
        _rewrite_chunk(c, lambda cols: cols.pop("trace_id"))
    assert TraceReader(t).steps().tolist() == [0, 1, 2, 3, 4, 5]
    with TraceWriter(t, mode="a") as tw:  # appended to: its new chunks carry no id either
        tw.record(6, "a", np.ones(64, np.float32), scale=1.0)
    assert TraceReader(t).steps().tolist() == list(range(7))
