"""Hostile and damaged inputs (issue 24), classes 1, 3 and 5 for files read: no file that is not
a regular file is ever opened (a FIFO would block), metadata is read with a byte bound, and a
damaged trace is refused in one line naming the file, by ``analyze`` and ``replay`` alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fp8sim import cli
from fp8sim.trace import TraceReader, TraceWriter, is_trace


def make_trace(path: Path, steps: int = 4, chunk_steps: int = 2) -> Path:
    rng = np.random.default_rng(0)
    with TraceWriter(path, chunk_steps=chunk_steps) as tw:
        tw.add_tensor("a", "activation", "e4m3", (64,))
        for s in range(steps):
            x = rng.standard_normal(64).astype(np.float32)
            tw.record(s, "a", x, scale=float(448 / np.abs(x).max()))
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- 1. a FIFO where a file should be: refused by name, never opened ---------------------------
@pytest.mark.parametrize("argv", [["replay", "{t}", "--policy", "current"],
                                  ["analyze", "--keep-going", "{t}", "{good}"]])  # fmt: skip
def test_a_fifo_named_like_a_chunk_never_blocks(tmp_path, argv):
    t = make_trace(tmp_path / "t")
    os.mkfifo(t / "chunks" / "chunk-000002-s00000004-00000005.npz")
    good = tmp_path / "good.npy"
    np.save(good, np.ones(8, np.float32))
    cmd = [sys.executable, "-m", "fp8sim", *(a.format(t=t, good=good) for a in argv)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # blocked: TimeoutExpired
    assert p.returncode == 2, p.stderr
    assert "chunk-000002-s00000004-00000005.npz: a named pipe (FIFO), not a regular file" in p.stderr
    if argv[0] == "analyze":  # went on to the next file: its record is in the table
        assert "good" in p.stdout and "bad files (1):" in p.stderr
    else:
        assert p.stderr.count("\n") == 1


@pytest.mark.parametrize("name", ["trace.json", "config.json", "run.json", "metrics.jsonl"])
def test_a_fifo_in_place_of_a_metadata_file_is_refused(tmp_path, capsys, name):
    """trace.json (trace detection and the reader), a run's config.json / run.json /
    metrics.jsonl (compare): in-process, so a blocking open would hang the test."""
    if name == "trace.json":
        t = make_trace(tmp_path / "t")
        (t / "trace.json").unlink()
        os.mkfifo(t / "trace.json")
        assert not is_trace(t)
        with pytest.raises(ValueError, match="a named pipe"):
            TraceReader(t)
        return
    from fp8sim.training.compare import load_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    if name == "metrics.jsonl":
        (run_dir / name).unlink()
    os.mkfifo(run_dir / name)
    with pytest.raises(ValueError, match=f"{name}: a named pipe"):
        load_run(run_dir)
    rc, _, err = run(capsys, "compare", run_dir, run_dir)
    assert rc == 2 and f"{name}: a named pipe" in err and err.count("\n") == 1


def test_a_fifo_as_a_checkpoint_or_its_index_is_refused(tmp_path):
    from fp8sim.training.checkpoint import load_checkpoint
    from fp8sim.training.dist_checkpoint import latest_checkpoint

    os.mkfifo(tmp_path / "checkpoint.pt")
    with pytest.raises((ValueError, FileNotFoundError), match="checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / "checkpoint").mkdir()
    os.mkfifo(tmp_path / "checkpoint" / "LATEST")
    with pytest.raises(ValueError, match="LATEST: a named pipe"):
        latest_checkpoint(tmp_path)


def test_a_fifo_in_a_corpus_directory_or_as_the_config_of_fp8_scales(tmp_path):
    from fp8sim.training.data import load_corpus

    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_bytes(b"x" * 4096)
    os.mkfifo(d / "b.txt")
    with pytest.raises(ValueError, match="b.txt: a named pipe"):
        load_corpus(d)


# ---- 3. memory bounded by what is used, not by the file ----------------------------------------
def test_trace_detection_reads_trace_json_with_a_bound(tmp_path, monkeypatch, capsys):
    from fp8sim.trace import layout

    t = make_trace(tmp_path / "t")
    meta = json.loads((t / "trace.json").read_text())
    meta["config"] = {"pad": "x" * (4 << 20)}  # a 4 MiB trace.json, the schema first
    (t / "trace.json").write_text(json.dumps(meta))
    assert is_trace(t)  # under the default bound: a trace
    monkeypatch.setattr(layout, "MAX_TRACE_JSON_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"trace.json \(more than 1048576 bytes"):
            is_trace(t)
        with pytest.raises(ValueError, match=r"trace.json: trace.json of more than 1048576 bytes"):
            TraceReader(t)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20  # never the whole file (4 MiB, and its parse)
    rc, _, err = run(capsys, "replay", t, "--policy", "current")
    assert rc == 2 and err.count("\n") == 1 and "more than 1048576 bytes" in err


def test_train_data_reads_at_most_the_cap(tmp_path):
    from fp8sim.training.data import load_corpus

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # 256 MiB, sparse: no disk, and reading it whole costs 256 MiB
        f.write(b"abc" * 1000)
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        corpus = load_corpus(big, max_bytes=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert corpus.num_bytes == 64 << 10
    assert bytes(corpus.train[:6].numpy()) == b"abcabc"
    assert peak < 8 << 20, peak


# ---- 5. every number read back is checked; damaged input is exit 2 naming the file -------------
def _rewrite_chunk(path: Path, **change) -> None:
    with np.load(path) as z:
        cols = {k: z[k] for k in z.files}
    cols.update(change)
    with open(path, "wb") as f:
        np.savez_compressed(f, **cols)


def _first_chunk(t: Path) -> Path:
    return sorted((t / "chunks").iterdir())[0]


@pytest.mark.parametrize("column, value, says", [
    ("scale", lambda c: c.astype(str), "column scale is <U"),
    ("amax", lambda c: c.astype(np.int64), "column amax is int64, not a float column"),
    ("step", lambda c: c.astype(np.float64), "column step is float64, not an integer column"),
    ("nan", lambda c: c.astype(bool), "column nan is bool"),
    ("numel", lambda c: c.reshape(1, -1), "column numel has shape"),
])  # fmt: skip
def test_trace_columns_of_the_wrong_dtype_fail_alike_in_analyze_and_replay(tmp_path, capsys, column,
                                                                           value, says):  # fmt: skip
    t = make_trace(tmp_path / "t")
    c = _first_chunk(t)
    with np.load(c) as z:
        _rewrite_chunk(c, **{column: value(z[column])})
    for argv in (["replay", t, "--policy", "current"], ["analyze", t]):
        rc, _, err = run(capsys, *argv)
        assert rc == 2, (argv, err)
        assert err.count("\n") == 1 and f"{c.name}: corrupt trace chunk: {says}" in err, err


def test_wrapped_integers_do_not_pass_the_consistency_checks(tmp_path, capsys):
    """uint64 counts chosen so that zero + nan + inf + total == numel holds in wrapped int64
    arithmetic: 2**64 - 1 counts as -1 there."""
    t = make_trace(tmp_path / "t")
    c = _first_chunk(t)
    with np.load(c) as z:
        numel, nan = z["numel"].astype(np.uint64), z["nan"].astype(np.uint64)
    wrapped = nan.copy()
    wrapped[0] = np.uint64(2**64 - 1)  # + 1 more zero below: the sum still "equals" numel
    with np.load(c) as z:
        zero = z["zero"].astype(np.uint64)
    zero[0] += np.uint64(1)
    _rewrite_chunk(c, nan=wrapped, zero=zero, numel=numel)
    with pytest.raises(ValueError, match="corrupt trace chunk: column nan holds 18446744073709551615"):
        TraceReader(t).scalars()
    rc, _, err = run(capsys, "analyze", t)
    assert rc == 2 and "column nan holds" in err


def test_uint64_histogram_offsets_cannot_wrap_past_the_order_check(tmp_path):
    t = make_trace(tmp_path / "t")
    c = _first_chunk(t)
    with np.load(c) as z:
        off = z["hist_offsets"].astype(np.uint64)
    off[1], off[2] = off[2], off[1]  # out of order: the uint64 difference wraps to a huge positive
    _rewrite_chunk(c, hist_offsets=off)
    with pytest.raises(ValueError, match="histogram offsets out of order"):
        TraceReader(t).scalars()


@pytest.mark.parametrize("damage, says", [
    (lambda m: m.update(tensors={"a": 1}), "tensors is a dict, not a list"),
    (lambda m: m["tensors"][0].update(shape=[64.5]), "is not a list of non-negative ints"),
    (lambda m: m["tensors"][0].update(shape=[-1]), "is not a list of non-negative ints"),
    (lambda m: m["tensors"][0].update(name=["a"]), "tensors[0].name: list"),
    (lambda m: m["tensors"][0].pop("role"), "KeyError: 'role'"),
    (lambda m: m.update(formats="e4m3"), "formats is a str"),
    ("deep", "nested too deeply"),
])  # fmt: skip
def test_a_damaged_trace_json_is_exit_2_naming_it(tmp_path, capsys, damage, says):
    t = make_trace(tmp_path / "t")
    tj = t / "trace.json"
    if damage == "deep":  # names the schema, then nests past Python's recursion limit
        tj.write_text('{"schema": "fp8sim-trace", "config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        meta = json.loads(tj.read_text())
        damage(meta)
        tj.write_text(json.dumps(meta))
    good = tmp_path / "good.npy"
    np.save(good, np.ones(8, np.float32))
    for argv in (["replay", t, "--policy", "current"], ["analyze", "--keep-going", t, good]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2, err
        assert "internal error" not in err and f"{tj}: corrupt trace.json" in err and says in err, err
        if argv[0] == "analyze":
            assert "good" in out  # went on


# ---- 2. work far beyond the bytes given --------------------------------------------------------
def test_an_expanded_tensor_is_refused_not_read_element_by_element(tmp_path):
    """torch.ones(1).expand(2**36) is a 1.5 KB file of one stored float: reading it element by
    element took 50 minutes. It is refused in one line (a bad tensor); the file's others go on."""
    torch = pytest.importorskip("torch")
    f = tmp_path / "x.pt"
    torch.save({"big": torch.ones(1).expand(2**36), "row": torch.arange(8.0).expand(4096, 8),
                "ok": torch.linspace(-1, 1, 100)}, f)  # fmt: skip
    assert f.stat().st_size < 4096
    cmd = [sys.executable, "-m", "fp8sim", "analyze", "--keep-going", str(f), "--format", "e4m3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "bad tensors (1):" in p.stderr and "big: its shape [68719476736] covers 68719476736 " \
        "elements but its storage holds 1" in p.stderr, p.stderr  # fmt: skip
    names = [ln.split()[1] for ln in p.stdout.splitlines()[2:] if ln.strip()]
    assert sorted(names) == ["ok", "row"]  # a small expanded view (32768 over 8) is still read


_DEFLATED_RSS_SCRIPT = """
import sys
import torch  # imported before the baseline
from fp8sim.analysis.dumps import open_dump

def status_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024

base = status_mb("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
(t,) = open_dump(sys.argv[1]).tensors
total = 0.0
for start in range(0, t.numel, 1 << 20):
    total += float(t.read(start, min(t.numel, start + (1 << 20))).sum(dtype="float64"))
print(t.numel, base, status_mb("VmHWM"), total)
"""


def test_a_deflated_pt_is_not_inflated_in_memory(tmp_path):
    """A .pt whose zip members are deflated (a zip rewritten by a tool) declares 128 MiB in a file
    of a few hundred KB; torch.load inflated it whole (2.46 GB peak for a 9 MB file). Now it is
    inflated piece by piece into a temporary file and mapped: the peak stays far below 128 MiB,
    the values are the ones saved, and no temporary file is left."""
    torch = pytest.importorskip("torch")
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to measure a peak")
    n = 32 << 20  # 128 MiB of float32
    plain, packed = tmp_path / "plain.pt", tmp_path / "packed.pt"
    torch.save({"w": torch.full((n,), 0.5)}, plain)
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    plain.unlink()
    assert packed.stat().st_size < 4 << 20
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run([sys.executable, "-c", _DEFLATED_RSS_SCRIPT, str(packed)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    numel, base, peak, total = p.stdout.split()
    assert int(numel) == n and float(total) == 0.5 * n
    print(f"RSS: {base} MiB before, peak {peak} MiB reading a 128 MiB deflated .pt")
    assert int(peak) - int(base) < 48, (base, peak)
    assert list(tmp.iterdir()) == []  # the inflated copy is gone
