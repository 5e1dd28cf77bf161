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
