"""``fp8sim train`` and ``fp8sim compare`` through the real command line."""

import json

import pytest

from fp8sim import cli
from fp8sim.training.trainer import read_metrics


pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
         "--steps", "4", "--warmup", "1", "--eval-every", "2", "--checkpoint-every", "2"]


def test_train_and_compare(tmp_path, capsys):
    a, b, trace = tmp_path / "a", tmp_path / "b", tmp_path / "trace"
    assert cli.main(["train", "--recipe", "fp32", "--out", str(a), "--json", *SMALL]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["final_loss"] == read_metrics(a)[-1]["loss"] and out["steps_done"] == 4
    rc = cli.main(["train", "--recipe", "te-delayed", "--backend", "torch", "--out", str(b), "--record", str(trace), *SMALL])
    assert rc == 0
    cap = capsys.readouterr()
    assert "final loss" in cap.out and "fp8sim train: te-delayed on torch" in cap.err
    assert "step/s" not in cap.err and "it/s" not in cap.err  # no progress bar when not a terminal
    assert (trace / "trace.json").is_file()
    rows_b = read_metrics(b)
    assert all({"loss", "tokens_per_s", "overflow", "underflow"} <= set(r) for r in rows_b)

    assert cli.main(["compare", str(a), str(b), "--plot", str(tmp_path / "plots"), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["final_loss"]["delta"] == rows_b[-1]["loss"] - read_metrics(a)[-1]["loss"]
    assert c["memory_bytes_per_param"]["a"]["total"] == pytest.approx(16.0, abs=0.01)
    assert c["events"]["b"]["fp8"] and not c["events"]["a"]["fp8"]
    assert c["events"]["b"]["underflow_total"] == sum(r["underflow"] for r in rows_b)
    png = tmp_path / "plots" / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["compare", str(a), str(b)]) == 0
    assert "bytes/param total" in capsys.readouterr().out


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["train", "--steps", "0", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp8sim train: error:") and "steps" in err and "\n" not in err
    assert cli.main(["compare", str(tmp_path), str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--recipe", "fp9"])
    assert e.value.code == 2
