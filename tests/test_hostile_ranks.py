"""A rank killed from outside (issue 24, class 7): ``fp8sim train --nproc 2`` whose rank is
SIGKILLed (the out-of-memory killer's signal) says in one line which rank died of which signal and
that ``--resume`` continues from its last complete checkpoint -- not "internal error ... a bug",
no multiprocessing warning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "1", "--block-size", "16", "--batch-size", "4",
         "--warmup", "1", "--eval-every", "0"]


def _spawned_ranks(pid: int) -> list[int]:
    """The launcher's children that run a rank (torchrun's elastic launcher starts them as
    ``python -m fp8sim.training.launch``)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "fp8sim.training.launch" in cmdline:
            out.append(int(entry))
    return sorted(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_killed_from_outside_is_said_in_one_line_and_resume_continues(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(600)))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fp8sim", "train", "--data", str(corpus), *SMALL, "--steps", "60",
           "--checkpoint-every", "2", "--nproc", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoint" / "LATEST").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = _spawned_ranks(proc.pid)
        assert len(ranks) == 2 and proc.poll() is None, "the run did not start (or ended already)"
        os.kill(ranks[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err
    assert len(lines) == 2 and lines[0].startswith("fp8sim train: bf16 on emulator, 2 rank(s)"), err
    assert lines[1].startswith("fp8sim train: error: rank ") and "died of signal SIGKILL" in lines[1]
    assert "--resume' continues the run in" in lines[1] and "from its last checkpoint (step " in lines[1]
    assert "internal error" not in err and "Warning" not in err and "leaked" not in err
    # the step it names is the complete checkpoint --resume starts from (resuming after kills is
    # tested bit for bit in test_training_dist_resume.py)
    latest = json.loads((out / "checkpoint" / "LATEST").read_text())
    assert f"from its last checkpoint (step {latest['step']})" in lines[1]
    assert ".metadata" in os.listdir(out / "checkpoint" / f"step{latest['step']:08d}")  # complete (DCP)
