"""``fp8sim train`` / ``compare`` on the edges an adversarial review found: bad input under
``--nproc 2`` (the rank's own message, exit 2), runs killed before their first checkpoint
(``--resume`` starts again), corrupt checkpoints and metrics (one line naming the file, exit 2),
strict JSON, option ranges, a resume at the final step (run.json kept), interrupted saves (no
temporary files left), a killed launcher (its ranks stop too)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from fp8sim import cli
from fp8sim.training.checkpoint import CHECKPOINT_NAME
from fp8sim.training.dist_checkpoint import CHECKPOINT_DIR
from fp8sim.training.trainer import read_metrics

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "1", "--block-size", "16", "--batch-size", "4",
         "--warmup", "1", "--eval-every", "0"]


@pytest.fixture()
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(600)))
    return p


def train(capsys, corpus, *argv):
    rc = cli.main(["train", "--data", str(corpus), *SMALL, *[str(a) for a in argv]])
    out, err = capsys.readouterr()
    return rc, out, err


def test_bad_input_under_two_ranks_is_the_ranks_message(tmp_path, capsys, corpus):
    rc, _, err = train(capsys, corpus, "--steps", "2", "--nproc", "2", "--block-size", "100000",
                       "--out", tmp_path / "r")  # fmt: skip
    assert rc == 2 and "fp8sim train: error: train split has" in err and "Traceback" not in err
    assert "internal error" not in err and "SIGTERM" not in err
    rc, _, err = train(capsys, corpus, "--steps", "2", "--nproc", "2", "--out", corpus)
    assert rc == 2 and "exists and is not a directory" in err


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_before_the_first_checkpoint_starts_again(tmp_path, capsys, corpus, nproc):
    out = tmp_path / "r"
    args = ["--steps", "3", "--checkpoint-every", "100", "--nproc", nproc, "--out", out]
    rc, _, _ = train(capsys, corpus, *args, "--recipe", "bf16")
    assert rc == 0
    # as if killed after 3 steps, before any checkpoint: no checkpoint, metrics left behind
    for ck in (out / CHECKPOINT_NAME, out / CHECKPOINT_DIR):
        if ck.is_file():
            ck.unlink()
        elif ck.is_dir():
            shutil.rmtree(ck)
    (out / "run.json").unlink()
    rc, _, err = train(capsys, corpus, *args, "--recipe", "bf16")
    assert rc == 2 and "already holds a run; resume it (--resume)" in err
    rc, _, err = train(capsys, corpus, *args, "--recipe", "bf16", "--resume")
    assert rc == 0 and "no checkpoint yet; starting again from step 0" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_resume_with_the_wrong_rank_count_says_so(tmp_path, capsys, corpus):
    out = tmp_path / "r"
    assert train(capsys, corpus, "--steps", "2", "--nproc", "2", "--out", out)[0] == 0
    rc, _, err = train(capsys, corpus, "--steps", "2", "--out", out, "--resume", "--nproc", "1")
    assert rc == 2 and "--nproc 1: the run in --out was trained with 2; leave the option out" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # nothing wiped
    # a run directory of an older fp8sim (config.json without the options): said with advice
    cfg = json.loads((out / "config.json").read_text())
    del cfg["options"]
    (out / "config.json").write_text(json.dumps(cfg))
    rc, _, err = train(capsys, corpus, "--steps", "2", "--out", out, "--resume")
    assert rc == 2 and "checkpointed by 2 data-parallel rank(s); resume it with --nproc 2" in err


@pytest.mark.parametrize("damage", ["truncated", "empty", "text", "a list", "no model"])
def test_corrupt_checkpoint_is_named(tmp_path, capsys, corpus, damage):
    out = tmp_path / "r"
    assert train(capsys, corpus, "--steps", "2", "--out", out)[0] == 0
    ck = out / "checkpoint.pt"
    if damage == "truncated":
        ck.write_bytes(ck.read_bytes()[:500])
    elif damage == "empty":
        ck.write_bytes(b"")
    elif damage == "text":
        ck.write_text("hello")
    elif damage == "a list":
        torch.save([1, 2], ck)
    else:
        body = torch.load(ck, weights_only=True)
        del body["model"]
        torch.save(body, ck)
    rc, _, err = train(capsys, corpus, "--out", out, "--resume")
    assert rc == 2 and f"{ck}: corrupt or not an fp8sim checkpoint" in err


def test_metrics_rows_and_run_json_are_checked(tmp_path, capsys, corpus):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert train(capsys, corpus, "--steps", "2", "--out", d)[0] == 0
    m = b / "metrics.jsonl"
    good = m.read_text()
    m.write_text(good + '{"step": 3, "lo')  # a row cut short by a kill: left out
    assert [r["step"] for r in read_metrics(b)] == [1, 2]
    for bad, says in (('{"step": 1}\n', "needs an int step and a numeric loss"), ("[1, 2]\n", "corrupt metrics row"),
                      ("not json\n", "corrupt metrics row")):  # fmt: skip
        m.write_text(bad + good)
        rc = cli.main(["compare", str(a), str(b)])
        err = capsys.readouterr().err
        assert rc == 2 and f"{m}:1: " in err and says in err
    m.write_text(good)
    for text in ("[]", '{"memory_bytes_per_param": 5}', "{"):
        (b / "run.json").write_text(text)
        rc = cli.main(["compare", str(a), str(b)])
        assert rc == 2 and "run.json" in capsys.readouterr().err


def test_zero_reference_loss_and_strict_json(tmp_path, capsys, corpus):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert train(capsys, corpus, "--steps", "2", "--out", d)[0] == 0
    rows = read_metrics(a)
    rows[0]["loss"] = 0.0
    rows[1]["loss"] = float("nan")
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["compare", str(a), str(b), "--json"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and json.loads(out)["final_loss"]["a"] == "nan"


@pytest.mark.parametrize("opt, value, says", [
    ("--eval-every", "-1", "error: --eval-every must be an integer >= 0, got -1"),
    ("--checkpoint-every", "-3", "error: --checkpoint-every must be an integer >= 0, got -3"),
    ("--warmup", "-3", "error: --warmup must be an integer >= 0, got -3"),
    ("--lr", "inf", "error: --lr must be finite and > 0, got inf"),
    ("--steps", "0", "error: --steps must be an integer >= 1, got 0"),
    ("--n-head", "3", "error: --n-embd must be a multiple of the number of heads (3)"),
    ("--data", "", "an empty path"),
    ("--out", "", "--out: an empty path"),
    ("--record", "", "--record: an empty path"),
])  # fmt: skip
def test_option_ranges(tmp_path, capsys, corpus, opt, value, says):
    rc, _, err = train(capsys, corpus, "--steps", "2", "--out", tmp_path / "r", opt, value)
    assert rc == 2 and says in err


def test_resume_after_the_final_step_keeps_run_json(tmp_path, capsys, corpus):
    out = tmp_path / "r"
    assert train(capsys, corpus, "--steps", "2", "--out", out)[0] == 0
    before = json.loads((out / "run.json").read_text())
    assert before["memory_bytes_per_param"]["grads"] == 4.0
    rc, stdout, _ = train(capsys, corpus, "--steps", "2", "--out", out, "--resume", "--json")
    assert rc == 0 and json.loads((out / "run.json").read_text()) == before
    assert json.loads(stdout)["memory_bytes_per_param"]["grads"] == 4.0


def test_resume_takes_the_options_left_out_from_the_runs_config(tmp_path, capsys, corpus):
    """--resume needs only --out: recipe, seed, sizes, corpus and the rest come from config.json; a
    flag given must agree with it, and one that does not is refused by name before anything runs."""
    out = tmp_path / "r"
    first = ["--recipe", "te-current", "--seed", "3", "--lr", "0.01", "--warmup", "1", "--eval-every", "0"]
    assert train(capsys, corpus, "--steps", "2", "--out", out, *first)[0] == 0
    metrics = (out / "metrics.jsonl").read_text()
    rc, err = cli.main(["train", "--resume", "--out", str(out), "--json"]), capsys.readouterr().err
    assert rc == 0, err
    assert (out / "metrics.jsonl").read_text() == metrics
    rc, err = cli.main(["train", "--resume", "--out", str(out), "--seed", "4"]), capsys.readouterr().err
    assert rc == 2 and "--seed 4: the run in --out was trained with 3; leave the option out" in err
    rc, err = cli.main(["train", "--resume", "--out", str(out), "--seed", "3", "--recipe", "te-current"]), \
        capsys.readouterr().err
    assert rc == 0, err


def test_an_interrupted_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    from fp8sim.training import checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    (tmp_path / ".checkpoint.pt.k1ll3d.tmp").write_bytes(b"x" * 10)  # left by a killed save
    (tmp_path / "checkpoint.pt.tmp-backup").write_bytes(b"mine")  # not ours: never removed

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, policies=None, config={})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.k1ll3d.tmp",
                                                          "checkpoint.pt.tmp-backup"]  # fmt: skip
    monkeypatch.undo()
    checkpoint.save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, policies=None, config={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.pt.tmp-backup"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal, pidfd: Linux")
def test_ranks_stop_when_the_launcher_is_killed(tmp_path, corpus):
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "fp8sim.cli", "train", "--data", str(corpus), *SMALL, "--steps", "100000",
           "--checkpoint-every", "100000", "--nproc", "2", "--out", str(out), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    # the first row: the ranks train (the standard library has no notification of a file growing)
    while not (metrics.is_file() and metrics.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert metrics.stat().st_size > 0, "the run did not start"
        ranks = [os.pidfd_open(pid) for pid in _children(proc.pid)]
        assert len(ranks) >= 2  # the 2 ranks (and multiprocessing's resource tracker)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only, not its process group
        proc.wait()
        deadline = time.monotonic() + 60
        for fd in ranks:  # a pidfd turns readable when its process has ended: no rank runs any more
            assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0], "a rank still runs"
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)  # clean up before failing


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_refuses_a_corpus_that_changed(tmp_path, capsys, corpus, nproc):
    out = tmp_path / "r"
    args = ["--steps", "4", "--checkpoint-every", "2", "--nproc", nproc, "--out", out]
    assert train(capsys, corpus, *args)[0] == 0
    corpus.write_text(corpus.read_text().replace("lazy", "busy"))  # same size, other bytes
    rc, _, err = train(capsys, corpus, *args, "--resume")
    assert rc == 2 and "the corpus changed since the checkpoint" in err


@pytest.mark.parametrize("rank, world, says", [("0", "0", "need 0 <= RANK < WORLD_SIZE"),
                                               ("3", "2", "need 0 <= RANK < WORLD_SIZE"),
                                               ("x", "2", "must be integers")])  # fmt: skip
def test_torchrun_variables_are_checked(tmp_path, capsys, corpus, monkeypatch, rank, world, says):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    rc, _, err = train(capsys, corpus, "--steps", "2", "--out", tmp_path / "r")
    assert rc == 2 and says in err


@pytest.mark.parametrize("nproc", [1, 2])
def test_killed_before_the_first_metrics_row_with_a_trace(tmp_path, capsys, corpus, nproc):
    """Killed after config.json and the trace's trace.json, before any row: --resume starts
    again (the trace included), a plain rerun says to resume."""
    from fp8sim.trace import TraceReader, TraceWriter

    out, trace = tmp_path / "r", tmp_path / "r" / "trace"
    args = ["--recipe", "te-delayed", "--steps", "2", "--nproc", nproc, "--out", out, "--record", trace]
    ref = tmp_path / "ref"  # the config.json this run writes (a restart checks it is the same)
    assert train(capsys, corpus, "--recipe", "te-delayed", "--steps", "2", "--out", ref)[0] == 0
    out.mkdir()
    cfg = json.loads((ref / "config.json").read_text())  # as this run's: its own options
    cfg["options"].update(record=str(trace), nproc=nproc)
    (out / "config.json").write_text(json.dumps(cfg))
    for sub in ([trace / f"rank{r}" for r in range(nproc)] if nproc > 1 else [trace]):
        TraceWriter(sub).close()  # an empty trace, as a run killed at once leaves it
    rc, _, err = train(capsys, corpus, *args)
    assert rc == 2 and "already holds a run" in err
    rc, _, err = train(capsys, corpus, *args, "--resume")
    assert rc == 0 and "starting again from step 0" in err, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    sub = trace / "rank0" if nproc > 1 else trace
    assert TraceReader(sub).steps().tolist() == [1, 2]


def test_a_new_run_never_writes_into_a_directory_of_other_files(tmp_path, capsys, corpus):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "checkpoint.pt").write_text("my precious model")
    rc, _, err = train(capsys, corpus, "--steps", "2", "--checkpoint-every", "1", "--out", out)
    assert rc == 2 and "exists and is not empty (1 entries, e.g. 'checkpoint.pt')" in err
    assert (out / "checkpoint.pt").read_text() == "my precious model"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt"]
    (out / "checkpoint.pt").unlink()
    assert train(capsys, corpus, "--steps", "2", "--out", out)[0] == 0  # empty: fine


def test_a_restart_is_only_for_the_same_unfinished_run(tmp_path, capsys, corpus):
    out = tmp_path / "r"
    assert train(capsys, corpus, "--steps", "2", "--out", out)[0] == 0
    (out / "checkpoint.pt").unlink()  # e.g. to free disk: a finished run, nothing to resume
    metrics = (out / "metrics.jsonl").read_text()
    rc, _, err = train(capsys, corpus, "--steps", "2", "--out", out, "--resume")
    assert rc == 2 and "holds a finished run (run.json) whose checkpoint is gone" in err
    (out / "run.json").unlink()
    rc, _, err = train(capsys, corpus, "--steps", "2", "--seed", "7", "--out", out, "--resume")
    assert rc == 2 and "--seed 7: the run in --out was trained with 0; leave the option out" in err
    assert (out / "metrics.jsonl").read_text() == metrics
    hf = tmp_path / "hf"  # a model folder: its config.json is not a run's
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["GPT2"]}')
    rc, _, err = train(capsys, corpus, "--steps", "2", "--out", hf, "--resume")
    assert rc == 2 and "config.json is not an fp8sim run config" in err
    assert (hf / "config.json").read_text() == '{"architectures": ["GPT2"]}'


def test_outputs_never_inside_the_training_data(tmp_path, capsys, corpus):
    data = tmp_path / "data"
    data.mkdir()
    (data / "text.txt").write_bytes(corpus.read_bytes())
    for opt, extra in (("--out", []), ("--record", ["--recipe", "te-delayed"])):
        target = data / "run"
        argv = ["train", "--data", str(data), *SMALL, "--steps", "2", *extra, "--out",
                str(target if opt == "--out" else tmp_path / "r"), *([opt, str(target)] if opt == "--record" else [])]  # fmt: skip
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and f"{opt} {target}: inside the --data directory" in err
        assert sorted(p.name for p in data.iterdir()) == ["text.txt"]


def test_a_resume_never_appends_to_another_runs_trace(tmp_path, capsys, corpus, monkeypatch):
    from tests.conftest import train_stopped_after

    base = ["--recipe", "te-delayed", "--steps", "4", "--checkpoint-every", "2"]
    assert train(capsys, corpus, *base, "--out", tmp_path / "a", "--record", tmp_path / "ta")[0] == 0
    chunks = sorted((tmp_path / "ta" / "chunks").iterdir())
    before = [p.read_bytes() for p in chunks]
    train_stopped_after(monkeypatch, capsys, 2, "--data", corpus, *SMALL, *base, "--out", tmp_path / "b")
    rc, _, err = train(capsys, corpus, *base, "--out", tmp_path / "b", "--resume", "--record", tmp_path / "ta")
    assert rc == 2 and f"--record {tmp_path / 'ta'}: the run in --out was trained with None" in err
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    del cfg["options"]  # a run directory of an older fp8sim: --record is taken as given
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    rc, _, err = train(capsys, corpus, *base, "--out", tmp_path / "b", "--resume", "--record", tmp_path / "ta")
    assert rc == 2 and "holds the trace of another run (its run_dir differs" in err
    assert [p.read_bytes() for p in sorted((tmp_path / "ta" / "chunks").iterdir())] == before


def test_an_interrupted_step_is_not_left_in_the_trace(tmp_path, capsys, corpus, monkeypatch):
    from fp8sim.trace import TraceReader

    calls = {"n": 0}
    real_backward = torch.Tensor.backward

    def backward(self, *a, **k):  # Ctrl-C in step 3's backward: its forward is recorded
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_backward(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    rc, _, err = train(capsys, corpus, "--recipe", "te-delayed", "--steps", "5", "--out",
                       tmp_path / "r", "--record", tmp_path / "t")  # fmt: skip
    assert rc != 0 and "interrupted" in err
    sc = TraceReader(tmp_path / "t").scalars()
    steps, per_step = np.unique(sc["step"], return_counts=True)
    assert steps.tolist() == [1, 2] and per_step[0] == per_step[1]  # whole steps only


def test_a_taken_record_directory_is_refused_before_the_run_begins(tmp_path, capsys, corpus):
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "trace.json").write_text('{"traceEvents": []}')  # a profiler's trace, say
    rc, _, err = train(capsys, corpus, "--recipe", "te-delayed", "--steps", "2", "--out",
                       tmp_path / "r", "--record", prof)  # fmt: skip
    assert rc == 2 and f"--record {prof}: already holds a trace" in err and "mode=" not in err
    assert not (tmp_path / "r").exists()  # no run begun: a corrected command just works
    assert train(capsys, corpus, "--recipe", "te-delayed", "--steps", "2", "--out", tmp_path / "r",
                 "--record", tmp_path / "t")[0] == 0  # fmt: skip
