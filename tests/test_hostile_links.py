"""fp8sim never writes through a symbolic link it finds where its own file goes (issue 30, class
1): a run's config.json, metrics.jsonl, checkpoint.pt or run.json, a trace's trace.json or its
chunks directory, a data-parallel checkpoint directory -- each replaced by a link to a file or
folder of the user's -- is refused in one line naming it, and the user's file is left as it was.
Only a path the user named (``--json FILE``) is followed."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest
import torch

from fp8sim import cli
from fp8sim.atomic_file import WriteError, append_line, atomic_write
from tests.conftest import TINY_TRAIN as SMALL, train_stopped_after


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "checkpoint.pt", "run.json"])
def test_a_link_in_a_run_directory_is_refused_and_never_written_through(tmp_path, capsys, corpus, monkeypatch,
                                                                        name):  # fmt: skip
    out = tmp_path / "run"
    train_stopped_after(monkeypatch, capsys, 2, "--data", corpus, *SMALL, "--steps", 4, "--checkpoint-every", 2,
                        "--out", out)  # fmt: skip
    mine = tmp_path / "mine" / name
    mine.parent.mkdir()
    if (out / name).exists():  # the run's own content, so that reading it works
        shutil.copy(out / name, mine)
        (out / name).unlink()
    else:
        mine.write_text("my precious notes")
    before = mine.read_bytes()
    (out / name).symlink_to(mine)
    rc = cli.main(["train", "--resume", "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[-1].startswith(f"fp8sim train: error: cannot write {out / name}: a symbolic link "
                                          f"(to {mine}) where fp8sim writes its own file; refused"), err  # fmt: skip
    assert mine.read_bytes() == before and (out / name).is_symlink()


def test_a_link_in_a_trace_is_refused(tmp_path):
    from fp8sim.trace import TraceWriter

    x = np.linspace(-2, 2, 64, dtype=np.float32)
    t = tmp_path / "t"
    with TraceWriter(t) as tw:
        tw.add_tensor("x", "weight", "e4m3", (64,))
        tw.record(1, "x", x, scale=1.0)
    mine = tmp_path / "mine.json"
    shutil.move(t / "trace.json", mine)
    before = mine.read_bytes()
    (t / "trace.json").symlink_to(mine)
    with pytest.raises(WriteError, match="trace.json: a symbolic link .* refused"):
        TraceWriter(t, mode="a")  # a resumed run appends: trace.json is written first
    assert mine.read_bytes() == before
    # the chunks directory a link to a folder of the user's: nothing is written into it
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    t2 = tmp_path / "t2"
    t2.mkdir()
    (t2 / "chunks").symlink_to(folder)
    tw = TraceWriter(t2)
    tw.add_tensor("x", "weight", "e4m3", (64,))
    tw.record(1, "x", x, scale=1.0)
    with pytest.raises(WriteError, match=f"{t2 / 'chunks'} is a symbolic link where fp8sim keeps its own directory"):
        tw.flush()
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_a_link_for_a_data_parallel_checkpoint_directory_is_refused(tmp_path):
    from fp8sim.training.dist_checkpoint import save_dcp_checkpoint

    folder = tmp_path / "folder"
    folder.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").symlink_to(folder)
    with pytest.raises(WriteError, match=f"{run / 'checkpoint'} is a symbolic link where fp8sim keeps"):
        save_dcp_checkpoint(run, step=2, rank=0, world=1, model=torch.nn.Linear(2, 2), optimizer=None,
                            extra={"x": 1})
    assert list(folder.iterdir()) == []


def test_atomic_write_refuses_links_and_special_files_of_its_own_names(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("user's")
    (tmp_path / "own.json").symlink_to(target)
    with pytest.raises(WriteError, match="own.json: a symbolic link"):
        atomic_write(tmp_path / "own.json", lambda f: f.write(b"x"))
    assert target.read_text() == "user's"
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    done: list = []

    def write():  # nothing reads the FIFO: writing into it would block for ever
        for fn in (lambda: atomic_write(fifo, lambda f: f.write(b"x")), lambda: append_line(fifo, "x\n")):
            try:
                fn()
            except WriteError as exc:
                done.append(str(exc))

    th = threading.Thread(target=write, daemon=True)
    th.start()
    th.join(20)
    assert done == [f"cannot write {fifo}: a named pipe (FIFO) where fp8sim writes its own file; refused"] * 2
    link = tmp_path / "rows.jsonl"
    link.symlink_to(target)
    with pytest.raises(WriteError, match="rows.jsonl: a symbolic link"):
        append_line(link, "row\n")
    assert target.read_text() == "user's"
    from fp8sim.atomic_file import owned_dir

    with pytest.raises(WriteError, match="is a symbolic link where fp8sim keeps its own directory"):
        owned_dir(tmp_path, "own.json/sub")


def test_a_plot_name_taken_by_a_link_is_replaced_and_said(tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fp8sim.atomic_file import save_figure

    outside = tmp_path / "outside.png"
    outside.write_bytes(b"keep")
    png = tmp_path / "plots" / "loss.png"
    png.parent.mkdir()
    png.symlink_to(outside)
    fig = plt.figure()
    save_figure(fig, png)
    plt.close(fig)
    assert outside.read_bytes() == b"keep" and not png.is_symlink() and png.read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err
    assert err == f"fp8sim: {png} was a symbolic link (to {outside}); replaced by fp8sim's file, {outside} untouched\n"


def test_a_dangling_out_link_is_said_in_words(tmp_path, capsys, corpus):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    for argv in (["train", "--data", str(corpus), *SMALL, "--steps", "1", "--out", str(link)],
                 ["demo", "--quick", "--out", str(link)]):  # fmt: skip
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {link}: a symbolic link to nothing ({tmp_path / 'gone'} does " \
                                       "not exist)" in err, err  # fmt: skip
    assert not (tmp_path / "gone").exists() and link.is_symlink()
