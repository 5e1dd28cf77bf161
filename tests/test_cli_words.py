"""The command line speaks in its own words: flags and values as typed, never the Python API's
keyword arguments or array indices; ``--version``."""

from __future__ import annotations

import pytest

import fp8sim
from fp8sim import cli


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fp8sim {fp8sim.__version__}"


def test_cast_overflow_names_the_flag_and_the_value(capsys):
    rc, out, err = run(capsys, "cast", "3", "100", "--format", "e2m1", "--no-saturate")
    assert rc == 2 and out == ""
    assert "--no-saturate" in err and "(first: 100)" in err
    assert "saturate=True" not in err and "index" not in err and err.count("\n") == 1


def test_cast_nan_into_a_format_without_nan(capsys):
    rc, _, err = run(capsys, "cast", "1", "nan", "--format", "e2m1")
    assert rc == 2 and "(first: nan)" in err and "index" not in err


def test_top_negative_blames_top(tmp_path, capsys):
    import numpy as np

    np.save(tmp_path / "g.npy", np.ones(8, np.float32))
    rc, _, err = run(capsys, "analyze", str(tmp_path / "g.npy"), "--top", "-1")
    assert rc == 2 and "--top must be >= 0" in err and "--chunk" not in err


def test_cast_shows_the_sign_of_a_nan(capsys):
    rc, out, _ = run(capsys, "cast", "--", "-nan", "nan")
    rows = out.strip().splitlines()[2:]
    assert rc == 0 and rows[0].split()[:2] == ["-nan", "0xff"] and rows[1].split()[:2] == ["nan", "0x7f"]
    assert rows[0].split()[3] == "-nan"  # the code decodes to -NaN, as torch and ml_dtypes do


def test_debug_shows_the_traceback_and_keeps_the_exit_code(capsys, monkeypatch):
    monkeypatch.setenv("FP8SIM_DEBUG", "1")
    rc, _, err = run(capsys, "cast", "1", "nan", "--format", "e2m1")
    assert rc == 2  # bad input stays 2 (Python's 1 would read as a crossed --fail-on)
    assert "Traceback (most recent call last)" in err and "(first: nan)" in err


def test_analyze_help_defines_statuses_columns_and_every_fail_on_metric(capsys):
    from fp8sim.analysis.report import FAIL_METRICS

    with pytest.raises(SystemExit):
        cli.main(["analyze", "--help"])
    out = capsys.readouterr().out
    for word in ("critical:", "warning:", "ok:", "amax", "scale", "overflow", "underflow",
                 "subnormal", "sqnr_db"):
        assert word in out, word
    metrics_line = out.split("METRIC one of:")[1].splitlines()[1]
    assert [m.strip(" ,") for m in metrics_line.replace("(count, or % share)", "").split(",")] \
        == list(FAIL_METRICS)


def test_the_table_shows_nan_and_inf_and_why_a_scale_fell_back(tmp_path, capsys):
    import json

    import numpy as np

    g = (np.random.default_rng(0).standard_normal(4096) * 1e-3).astype(np.float32)
    g[:5], g[5:11] = np.nan, np.inf
    np.save(tmp_path / "grads.npy", g)
    np.save(tmp_path / "clean.npy", np.abs(g[11:]))
    rc, out, err = run(capsys, "analyze", str(tmp_path / "grads.npy"), str(tmp_path / "clean.npy"),
                       "--format", "e4m3")
    lines = out.splitlines()
    col = lines[0].split().index("nan/inf")
    cells = {ln.split()[1]: ln.split()[col] for ln in lines[2:]}
    assert cells == {"grads": "5/6", "clean": "-"}
    assert "scale fell back to 1 (the tensor holds 6 inf value(s)" in err
    assert err.count("fell back") == 1  # the clean tensor has a real scale: no note
    rc, out, _ = run(capsys, "analyze", str(tmp_path / "clean.npy"), "--format", "e4m3")
    assert "nan/inf" not in out  # the column appears only when it says something
    rc, out, _ = run(capsys, "analyze", str(tmp_path / "grads.npy"), "--format", "e4m3", "--json", "-")
    notes = json.loads(out)["notes"]
    assert [n["name"] for n in notes if "fell back" in n["note"]] == ["grads"]
