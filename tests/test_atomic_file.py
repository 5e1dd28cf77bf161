"""fp8sim.atomic_file.atomic_write: whole-or-nothing for regular files; in a path the user named
(``links="follow"``) links followed and device nodes / FIFOs written in place (a rename over them
would replace the node itself: ``--json /dev/null`` run as root used to turn /dev/null into a
regular file); fp8sim's own files never written through a link (tests/test_hostile_links.py)."""

from __future__ import annotations

import json
import os
import stat
import threading

import numpy as np
import pytest

from fp8sim import cli
from fp8sim.atomic_file import atomic_write


def read_fifo_in_background(path):
    """Start a reader of the FIFO at ``path`` (a writer's open blocks until one exists); returns
    (thread, list that receives the bytes read)."""
    got: list[bytes] = []

    def reader():
        with open(path, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    return t, got


def test_regular_file_replaced_whole_and_link_followed(tmp_path):
    target = tmp_path / "data.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write(link, lambda f: f.write(b"new"), links="follow")  # a path the user named
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json", "link.json"]  # no temp
    with pytest.raises(RuntimeError):  # a failing write leaves the old content, no temp file
        atomic_write(target, lambda f: (f.write(b"half"), (_ for _ in ()).throw(RuntimeError())))
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json", "link.json"]


def test_fifo_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    t, got = read_fifo_in_background(fifo)
    atomic_write(fifo, lambda f: f.write(b"through the pipe"), links="follow")
    t.join(10)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_character_device_stays_a_device(tmp_path):
    dev = tmp_path / "null"
    try:
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc})")
    atomic_write(dev, lambda f: f.write(b"discarded"), links="follow")
    assert stat.S_ISCHR(os.stat(dev).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]


def test_analyze_json_into_a_fifo_and_a_link(tmp_path, capsys):
    src = tmp_path / "t.npy"
    np.save(src, np.linspace(-3, 3, 100, dtype=np.float32))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    t, got = read_fifo_in_background(fifo)
    rc = cli.main(["analyze", str(src), "--format", "e4m3", "--json", str(fifo)])
    t.join(10)
    assert rc == 0 and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(got[0])["records"][0]["name"] == "t"
    target = tmp_path / "out" / "r.json"
    target.parent.mkdir()
    link = tmp_path / "r.json"
    link.symlink_to(target)
    rc = cli.main(["analyze", str(src), "--format", "e4m3", "--json", str(link)])
    assert rc == 0 and link.is_symlink() and json.loads(target.read_text())["records"]
    capsys.readouterr()


def test_json_never_overwrites_an_input(tmp_path, capsys):
    from fp8sim.trace import TraceWriter

    src = tmp_path / "a.npy"
    np.save(src, np.ones(10, np.float32))
    before = src.read_bytes()
    rc = cli.main(["analyze", str(src), "--json", str(src)])
    assert rc == 2 and src.read_bytes() == before
    assert "is one of the files analyzed" in capsys.readouterr().err
    rc = cli.main(["analyze", str(tmp_path), "--json", str(src)])  # found in a directory too
    assert rc == 2 and src.read_bytes() == before
    tr = tmp_path / "trace"
    with TraceWriter(tr, {"model": "toy"}) as w:
        w.add_tensor("x", "weight", "e4m3", (64,))
        w.record(0, "x", np.linspace(-2, 2, 64, dtype=np.float32), scale=1.0)
    meta = (tr / "trace.json").read_bytes()
    for argv in (["analyze", str(tr)], ["replay", str(tr), "--policy", "current"]):
        rc = cli.main([*argv, "--json", str(tr / "trace.json")])
        assert rc == 2 and (tr / "trace.json").read_bytes() == meta
        assert "inside the fp8sim trace" in capsys.readouterr().err


def test_permissions_kept_or_as_open_gives(tmp_path):
    old = tmp_path / "shared.json"
    old.write_text("old")
    os.chmod(old, 0o644)
    atomic_write(old, lambda f: f.write(b"new"))
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o644 and old.read_text() == "new"
    mask = os.umask(0o027)
    try:
        atomic_write(tmp_path / "fresh.json", lambda f: f.write(b"x"))
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "fresh.json").st_mode) == 0o640


def test_a_failed_plot_keeps_the_old_png(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fp8sim.atomic_file import save_figure

    png = tmp_path / "loss.png"
    fig = plt.figure()
    save_figure(fig, png)
    good = png.read_bytes()
    assert good[:4] == b"\x89PNG"

    def failing(f, **kw):
        f.write(b"\x89PNG half")
        raise OSError(27, "File too large")

    fig.savefig = failing
    with pytest.raises(OSError):
        save_figure(fig, png)
    plt.close(fig)
    assert png.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
