"""Writes are whole or absent, and a failed one names the file (issue 24, class 6): a disk that
fills while ``fp8sim train`` writes config.json or a metrics row, and a ``--json`` write killed
mid-way, whose temporary file the next run removes."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from fp8sim import cli
from tests.conftest import FullDisk as _FullDisk

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "1", "--block-size", "16", "--batch-size", "4",
         "--warmup", "1", "--eval-every", "0"]


@pytest.fixture()
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(600)))
    return p


def fill_disk_for(monkeypatch, name: str) -> None:
    """Every file opened for writing whose name contains ``name`` (its temporary files too) fails
    with ENOSPC after half of its first write: through open(), io.open() (pathlib) and
    os.fdopen() (temporary files)."""
    real_open, real_fdopen = builtins.open, os.fdopen

    def wrap(f, where):
        mode = getattr(f, "mode", "")
        return _FullDisk(f) if name in str(where) and any(c in str(mode) for c in "wa+") else f

    def fake_open(file, mode="r", *a, **k):
        return wrap(real_open(file, mode, *a, **k), file)

    def fake_fdopen(fd, mode="r", *a, **k):
        return wrap(real_fdopen(fd, mode, *a, **k), os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "fdopen", fake_fdopen)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc")
def test_a_full_disk_at_the_start_of_train_leaves_no_cut_off_config(tmp_path, capsys, corpus, monkeypatch):
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), *SMALL, "--steps", "2", "--out", str(out)]
    with monkeypatch.context() as m:
        fill_disk_for(m, "config.json")
        rc = cli.main(args)
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[-1] == f"fp8sim train: error: cannot write {out}/config.json: No space left on device"
    assert not out.exists() or list(out.iterdir()) == []  # no cut-off config.json, no temp file
    assert cli.main(args) == 0  # a fresh run goes into the directory (not "already holds a run")
    assert cli.main([*args, "--resume"]) == 0  # and it is a run --resume recognises


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc")
def test_a_full_disk_while_appending_a_metrics_row_keeps_the_rows_whole(tmp_path, capsys, corpus,
                                                                        monkeypatch):  # fmt: skip
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), *SMALL, "--steps", "4", "--checkpoint-every", "2", "--out", str(out)]
    real_open, calls = builtins.open, []

    def full_on_third_append(file, mode="r", *a, **k):  # rows 1 and 2 go in, row 3 fails
        f = real_open(file, mode, *a, **k)
        if str(file).endswith("metrics.jsonl") and "a" in mode:
            calls.append(1)
            if len(calls) == 3:
                return _FullDisk(f)
        return f

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", full_on_third_append)
        rc = cli.main(args)
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[-1].endswith(f"cannot write {out}/metrics.jsonl: No space left on device")
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["step"] for x in text.splitlines()] == [1, 2]
    assert cli.main([*args, "--resume"]) == 0  # from the checkpoint after step 2
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


_SLOW_WRITER = """
import sys, time
from fp8sim.atomic_file import atomic_write

def write(f):
    f.write(b'{"half": ')
    f.flush()
    print("writing", flush=True)
    time.sleep(600)

atomic_write(sys.argv[1], write)
"""


def test_a_killed_json_write_leaves_no_temporary_file_after_the_next_run(tmp_path, capsys):
    dest = tmp_path / "out.json"
    p = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(dest)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        temps = [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
        assert len(temps) == 1 and temps[0].startswith(".out.json.")  # named after its file
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not dest.exists()  # the kill left no half file
    np.save(tmp_path / "x.npy", np.linspace(-1, 1, 64, dtype=np.float32))
    assert cli.main(["analyze", str(tmp_path / "x.npy"), "--json", str(dest)]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path)) == ["out.json", "x.npy"]  # the killed write's temp is gone
    assert json.loads(dest.read_text())["records"]


def test_a_failed_write_names_its_file(tmp_path, monkeypatch):
    from fp8sim.atomic_file import WriteError, atomic_write

    def fsync_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (tmp_path / "a.json").write_text("old")
    monkeypatch.setattr(os, "fsync", fsync_full)
    with pytest.raises(WriteError) as e:
        atomic_write(tmp_path / "a.json", lambda f: f.write(b"new"))
    assert str(e.value) == f"cannot write {tmp_path / 'a.json'}: No space left on device"
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert os.listdir(tmp_path) == ["a.json"] and (tmp_path / "a.json").read_text() == "old"

