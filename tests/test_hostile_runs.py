"""Hostile and damaged run directories (issue 24, class 5): every number a run reads back is
checked -- a checkpoint's step, its tensors, its RNG state, a run.json's figures, deep nesting --
and damaged input is one line naming the file, exit 2, never "internal error ... a bug"."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from fp8sim import cli

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


@pytest.fixture()
def run_dir(tmp_path, capsys, corpus):
    out = tmp_path / "r"
    assert train(capsys, corpus, "--steps", "4", "--out", out)[0] == 0
    return out


def _edit(path, change) -> None:
    body = torch.load(path, weights_only=True)
    change(body)
    torch.save(body, path)


@pytest.mark.parametrize("change, says", [
    (lambda b: b.update(step=-4), "step -4 is not an int >= 0"),
    (lambda b: b.update(step=True), "step True is not an int >= 0"),
    (lambda b: b.update(step=2.0), "step 2.0 is not an int >= 0"),
    (lambda b: b.update(step=9), "step 9 is outside 0..4"),
    (lambda b: b.update(model={}), "damaged checkpoint: it does not fit the run (RuntimeError"),
    (lambda b: b["model"].update({next(iter(b["model"])): torch.zeros(3)}), "does not fit the run"),
    (lambda b: b.update(rng={}), "does not fit the run (KeyError"),
    (lambda b: b.update(rng={"torch": torch.zeros(3), "python": (3, (1,), None)}), "does not fit the run"),
    (lambda b: b.update(optimizer={"state": {}, "param_groups": "x"}), "does not fit the run"),
    (lambda b: b["optimizer"]["param_groups"][0].update(lr=float("nan")), "learning rate nan restored"),
    (lambda b: b.update(config=[1]), "its config is a list"),
])  # fmt: skip
def test_a_damaged_checkpoint_is_exit_2_naming_it(run_dir, capsys, corpus, change, says):
    ck = run_dir / "checkpoint.pt"
    _edit(ck, change)
    rc, _, err = train(capsys, corpus, "--steps", "4", "--out", run_dir, "--resume")
    assert rc == 2, err
    assert err.count("\n") == 1 and "internal error" not in err
    assert f"{ck}: " in err and says in err, err
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # nothing trained, nothing lost


def test_a_deeply_nested_checkpoint_is_exit_2(run_dir, capsys, corpus):
    nest: list = []
    for _ in range(5000):
        nest = [nest]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # torch.save pickles recursively; reading it back must not fail
    try:
        _edit(run_dir / "checkpoint.pt", lambda b: b.update(policies=nest))
    finally:
        sys.setrecursionlimit(limit)
    rc, _, err = train(capsys, corpus, "--steps", "4", "--out", run_dir, "--resume")
    assert rc == 2 and "internal error" not in err and "checkpoint.pt: " in err, err


@pytest.mark.parametrize("text, says", [
    ('{"step": -4, "world": 2}', "needs an int step >= 0"),
    ('{"step": 4, "world": true}', "needs an int step >= 0"),
    ('{"step": "4", "world": 2}', "needs an int step >= 0"),
    ("[" * 30_000 + "]" * 30_000, "nested too deeply"),
])  # fmt: skip
def test_a_damaged_checkpoint_index_is_named(tmp_path, text, says):
    from fp8sim.training.dist_checkpoint import latest_checkpoint

    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "LATEST").write_text(text)
    with pytest.raises(ValueError, match="LATEST: ") as e:
        latest_checkpoint(tmp_path)
    assert says in str(e.value)


@pytest.mark.parametrize("summary, says", [
    ({"memory_bytes_per_param": {"weights": 1.0}}, "memory_bytes_per_param is"),
    ({"memory_bytes_per_param": {"weights": "x", "grads": 1, "optimizer": 1, "total": 1}},
     "memory_bytes_per_param is"),
    ({"comm_bytes_per_step": {"wgrad_fp8": 1}}, "comm_bytes_per_step is"),
    ({"median_step_time_s": "fast"}, "median_step_time_s is"),
    ({"config": [1]}, "config is"),
    ("deep", "nested too deeply"),
])  # fmt: skip
def test_a_damaged_run_json_is_exit_2_naming_it(tmp_path, capsys, corpus, summary, says):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert train(capsys, corpus, "--steps", "2", "--out", d)[0] == 0
    rj = b / "run.json"
    if summary == "deep":
        rj.write_text("[" * 100_000 + "]" * 100_000)
    else:
        rj.write_text(json.dumps({**json.loads(rj.read_text()), **summary}))
    rc = cli.main(["compare", str(a), str(b)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "internal error" not in err
    assert f"{rj}: corrupt" in err and says in err, err
    # a finished run's run.json read back by --resume (the summary it prints) is checked too
    rc, _, err = train(capsys, corpus, "--steps", "2", "--out", b, "--resume")
    assert rc == 2 and "internal error" not in err and f"{rj}: corrupt" in err, err


def test_deeply_nested_metrics_row_is_named(run_dir, capsys):
    m = run_dir / "metrics.jsonl"
    m.write_text("[" * 100_000 + "]" * 100_000 + "\n" + m.read_text())
    rc = cli.main(["compare", str(run_dir), str(run_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{m}:1: corrupt metrics row" in err
