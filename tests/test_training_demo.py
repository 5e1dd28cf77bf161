"""``fp8sim demo --quick``: the whole pipeline runs and its report states measured figures."""

import json

import pytest

from fp8sim import cli


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_demo_quick_writes_report_shows_progress_and_reruns(tmp_path, capsys, monkeypatch):
    """One quick demo: its report and figures, progress lines without a terminal; run again into
    the same folder it replaces its own report (and only that); a file of somebody else's
    anywhere inside, or a file of its own changed since, makes it refuse, deleting nothing."""
    from fp8sim.training import trainer

    monkeypatch.setattr(trainer, "PROGRESS_LINE_S", 0.0)  # a line per step
    out = tmp_path / "report"
    assert cli.main(["demo", "--quick", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    fig = json.loads(captured.out)
    assert fig == json.loads((out / "summary.json").read_text())
    e = fig["emulator_vs_torch"]
    # every FP8 cast of step 1 (4 linears x input, weight, grad_output) compared, all identical
    assert e["step1_casts"] == 12 and e["codes_identical_step1"]
    assert e["max_rel_loss_diff"] < 1e-3
    assert fig["memory_bytes_per_param"]["b"]["total"] >= 16.0
    assert [s["policy"] for s in fig["replay"]][0] == "recorded"
    md = (out / "summary.md").read_text()
    assert "## Targets (measured)" in md and f"{e['max_rel_loss_diff']:.2e}" in md
    # it explains itself, and every file it names is there
    from fp8sim.commands.demo_report import named_files

    assert md.index("## How to read this") < md.index("## Targets (measured)")
    for words in ("bf16 is the reference", "**Statuses**", "**Verdict words**", "**What-if rows.**"):
        assert words in md, words
    named = named_files(md)
    assert {"plots/loss_curves.png", "plots/policies.png", "plots/underflow_recorded.png", "runs/bf16", "traces",
            "analyze.json", "summary.json"} <= set(named)  # fmt: skip
    assert [n for n in named if not (out / n).exists()] == []
    assert sorted(p.name for p in (out / "plots").iterdir()) == [
        "loss_curves.png", "overflow_recorded.png", "policies.png", "underflow_recorded.png"]  # one underflow plot
    for png in ("loss_curves.png", "policies.png", "underflow_recorded.png"):
        assert (out / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    for run in ("bf16", "te-delayed-torch", "te-delayed-emulator"):  # each run's files, named and there
        assert {f"runs/{run}/{n}" for n in ("config.json", "metrics.jsonl", "run.json", "checkpoint.pt")} <= set(named)
    # compare, replay's recorded row and analyze's trace table count the same casts
    counted = fig["overflow_counted_by"]
    assert counted["compare"] == counted["replay_recorded"] == counted["analyze_trace"]
    assert fig["analysis"]["what_if_rows"] == 4  # the 4 linears' weight gradients
    assert (out / "traces" / "bf16" / "trace.json").is_file() and (out / "analyze.json").is_file()
    # capsys's stderr is not a terminal: progress comes as lines
    assert "bf16/emulator: step 12/12, loss" in captured.err and "te-delayed/torch: step 1/12, loss" in captured.err

    # run again into the same folder: the demo's own report is replaced, nothing else touched --
    # anywhere inside it (issue 30: a user's run put under runs/ was deleted with the report)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    mine = out / "runs" / "my-3-day-run" / "checkpoint.pt"
    mine.parent.mkdir()
    mine.write_text("three days of training")
    assert cli.main(["demo", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 'runs/my-3-day-run/checkpoint.pt', a file fp8sim did not write" in err, err
    assert mine.read_text() == "three days of training"
    assert sorted(p for p in out.rglob("*") if p.is_file()) == sorted(files + [mine])  # nothing deleted
    mine.unlink()
    mine.parent.rmdir()
    (out / "plots" / "policies.png").write_bytes(b"edited")  # a listed file changed since: the user's now
    assert cli.main(["demo", "--quick", "--out", str(out)]) == 2
    assert "'plots/policies.png' changed since fp8sim wrote it" in capsys.readouterr().err
    (out / "plots" / "policies.png").unlink()
    from fp8sim.commands.demo import _clear_previous_report

    _clear_previous_report(out)  # what a rerun does first (the rest is the run above)
    assert "replaced the previous report" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_demo_never_writes_into_a_directory_of_other_files(tmp_path, capsys):
    mine = tmp_path / "docs"
    mine.mkdir()
    (mine / "summary.md").write_text("# my notes")
    assert cli.main(["demo", "--quick", "--out", str(mine)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["summary.md"]
    assert (mine / "summary.md").read_text() == "# my notes"


def test_the_report_lists_the_files_a_run_stopped_early_holds(tmp_path):
    """The default demo's emulator run stops after 50 of 200 steps: no run.json, no checkpoint
    yet. The report names what each run folder holds, nothing more."""
    from fp8sim.commands.demo_report import _run_files, named_files

    for run, files in (("full", ("config.json", "metrics.jsonl", "run.json", "checkpoint.pt")),
                       ("stopped", ("config.json", "metrics.jsonl"))):  # fmt: skip
        (tmp_path / "runs" / run).mkdir(parents=True)
        for f in files:
            (tmp_path / "runs" / run / f).write_text("{}")
    text = _run_files(tmp_path)
    assert text == ("`runs/full/` (config.json, metrics.jsonl, run.json, checkpoint.pt), "
                    "`runs/stopped/` (config.json, metrics.jsonl)")
    assert [n for n in named_files(text) if not (tmp_path / n).exists()] == []
    assert "runs/stopped/run.json" not in named_files(text)
