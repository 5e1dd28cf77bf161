"""fp8sim deletes only what it wrote, and one process at a time writes a directory (issue 30,
class 2): a report folder's list of files (fp8sim.owned_tree) refuses anything else anywhere
inside; old data-parallel checkpoint steps and an overwritten trace lose only fp8sim's own files;
a second writer of a run, report or plot directory is refused in one line, and a holder killed
with SIGKILL leaves nothing stuck. (The demo's own rerun: tests/test_training_demo.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fp8sim import cli
from tests.conftest import TINY_TRAIN as SMALL


def report(root):
    """A folder fp8sim wrote whole, listed."""
    from fp8sim.owned_tree import list_files

    (root / "runs" / "a").mkdir(parents=True)
    (root / "runs" / "a" / "checkpoint.pt").write_bytes(b"model")
    (root / "summary.md").write_text("# report")
    (root / "plots").mkdir()
    list_files(root, ".list", "test-report")
    return root


@pytest.mark.parametrize("planted, says", [
    ("runs/my-run/checkpoint.pt", "holds 'runs/my-run/checkpoint.pt', a file fp8sim did not write"),
    ("plots/my-notes.md", "holds 'plots/my-notes.md', a file fp8sim did not write"),
    ("runs/a/notes", "holds 'runs/a/notes', a directory fp8sim did not write"),
    ("link", "holds 'plots/link', a symbolic link fp8sim did not write"),
    ("edit", "'summary.md' changed since fp8sim wrote it"),
])  # fmt: skip
def test_a_listed_folder_holding_anything_else_is_refused_and_nothing_deleted(tmp_path, planted, says):
    root = report(tmp_path / "r")
    if planted == "link":
        (root / "plots" / "link").symlink_to(root / "summary.md")
    elif planted == "edit":
        (root / "summary.md").write_text("# my edits")
    elif planted.endswith("notes"):
        (root / planted).mkdir()
    else:
        (root / planted).parent.mkdir(exist_ok=True)
        (root / planted).write_text("mine")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    from fp8sim.owned_tree import clear_listed

    with pytest.raises(ValueError, match="nothing was deleted") as e:
        clear_listed(root, ".list", "test-report", "--out")
    assert says in str(e.value) and str(e.value).startswith(f"--out {root}: ")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before


def test_a_listed_folder_is_cleared_exactly(tmp_path):
    from fp8sim.owned_tree import begin_list, clear_listed

    root = report(tmp_path / "r")
    clear_listed(root, ".list", "test-report", "--out")
    assert list(root.iterdir()) == []
    begin_list(root, ".list", "test-report")  # then a run killed before it listed its files
    (root / "runs").mkdir()
    (root / "runs" / "x").write_text("written, not listed")
    with pytest.raises(ValueError, match="stopped before it listed its files .* cannot tell them from yours"):
        clear_listed(root, ".list", "test-report", "--out")
    assert (root / "runs" / "x").is_file()
    (root / ".list").write_text("a report of `fp8sim demo`: a rerun replaces it\n")  # an older version's mark
    with pytest.raises(ValueError, match="is not a list of files of this fp8sim"):
        clear_listed(root, ".list", "test-report", "--out")


def test_old_checkpoint_steps_lose_only_their_checkpoint_files(tmp_path):
    import torch

    from fp8sim.training.dist_checkpoint import save_dcp_checkpoint

    net = torch.nn.Linear(2, 2)
    save_dcp_checkpoint(tmp_path, step=1, rank=0, world=1, model=net, optimizer=None, extra={"x": 1})
    first = tmp_path / "checkpoint" / "step00000001"
    assert ".metadata" in {p.name for p in first.iterdir()}  # DCP's files, removed below
    (first / "notes.txt").write_text("mine")
    save_dcp_checkpoint(tmp_path, step=2, rank=0, world=1, model=net, optimizer=None, extra={"x": 2})
    assert sorted(p.name for p in first.iterdir()) == ["notes.txt"]
    assert (tmp_path / "checkpoint" / "step00000002" / ".metadata").is_file()


def test_an_overwritten_trace_loses_only_its_own_files(tmp_path):
    from fp8sim.trace import TraceReader, TraceWriter

    t = tmp_path / "t"
    with TraceWriter(t) as tw:
        tw.add_tensor("x", "weight", "e4m3", (8,))
        tw.record(1, "x", np.ones(8, np.float32), scale=1.0)
        tw.save_tensor(1, "x", np.ones(8, np.float32))
    (t / "chunks" / "README").write_text("mine")
    (t / "tensors" / "keep.safetensors").write_text("mine too")
    TraceWriter(t, overwrite=True).close()
    assert sorted(p.name for p in (t / "chunks").iterdir()) == ["README"]
    assert sorted(p.name for p in (t / "tensors").iterdir()) == ["keep.safetensors"]
    assert TraceReader(t).steps().tolist() == []


def test_one_writer_per_directory_and_a_killed_holder_leaves_nothing_stuck(tmp_path, capsys, corpus):
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), *SMALL, "--steps", "100000", "--checkpoint-every", "1", "--out", str(out)]
    holder = subprocess.Popen([sys.executable, "-m", "fp8sim.cli", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoint.pt").is_file() and time.monotonic() < deadline:  # it trains
            time.sleep(0.2)
        assert (out / "checkpoint.pt").is_file(), "the first run did not start"
        rows = (out / "metrics.jsonl").read_text()
        rc = cli.main(["train", "--resume", "--out", str(out)])  # a second writer of the same run
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert f"--out {out}: another fp8sim process is writing there" in err
        assert (out / "metrics.jsonl").read_text().startswith(rows)  # nothing cut back
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    from fp8sim.output_dir import output_dir

    with output_dir(out, "--out"):  # the lock went with the killed process: the next writer gets it
        pass


_HOLDER = """
import sys, time
from fp8sim.output_dir import output_dir
with output_dir(sys.argv[1], "--out"):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_every_command_refuses_a_directory_another_process_writes(tmp_path, capsys, corpus):
    held = tmp_path / "held"
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(held)], stdout=subprocess.PIPE, text=True)
    np.save(tmp_path / "x.npy", np.linspace(-1, 1, 64, dtype=np.float32))
    try:
        assert p.stdout.readline().strip() == "holding"
        for argv, opt in ((["demo", "--quick", "--out", str(held)], "--out"),
                          (["train", "--data", str(corpus), *SMALL, "--steps", "1", "--out", str(held)], "--out"),
                          (["train", "--data", str(corpus), *SMALL, "--recipe", "te-delayed", "--steps", "1", "--out",
                            str(tmp_path / "r"), "--record", str(held)], "--record"),
                          (["analyze", str(tmp_path / "x.npy"), "--plot", str(held)], "--plot")):  # fmt: skip
            assert cli.main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{opt} {held}: another fp8sim process is writing there" in err, err
        assert list(held.iterdir()) == [] and not (tmp_path / "r").exists()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert cli.main(["analyze", str(tmp_path / "x.npy"), "--plot", str(held)]) == 0  # free again


def test_a_demo_that_fails_part_way_lists_what_it_wrote(tmp_path, monkeypatch):
    from fp8sim.commands import demo

    def fails(out, *a):
        (out / "runs").mkdir()
        (out / "runs" / "half.json").write_text("{}")
        raise RuntimeError("stopped")

    monkeypatch.setattr(demo, "_demo", fails)
    with pytest.raises(RuntimeError, match="stopped"):
        demo.run_demo(tmp_path / "r", size="quick")
    listed = json.loads((tmp_path / "r" / ".fp8sim-demo").read_text())
    assert listed["complete"] and list(listed["files"]) == ["runs/half.json"] and listed["dirs"] == ["runs"]
    demo._clear_previous_report(tmp_path / "r")  # a rerun: exactly that is removed
    assert list((tmp_path / "r").iterdir()) == []
