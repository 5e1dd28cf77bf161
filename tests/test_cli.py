"""The command line: formats, cast, conformance; exit codes; README <-> CI consistency."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8sim import cli
import fp8sim

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_formats_json_matches_the_format_objects(capsys):
    code, out, _ = run_cli(capsys, "formats", "--json")
    assert code == 0
    records = {r["name"]: r for r in json.loads(out)}
    assert set(records) == {f.name for f in fp8sim.list_formats()}
    e4m3 = records["e4m3"]
    assert (e4m3["max"], e4m3["min_normal"], e4m3["min_subnormal"]) == (448.0, 2**-6, 2**-9)
    assert e4m3["nan"] == "0x7f" and e4m3["inf"] is None
    assert records["e5m2"]["inf"] == "0x7c"
    assert records["e5m2"]["dynamic_range_binades"] == pytest.approx(31.807, abs=1e-3)


def test_formats_table_and_generic(capsys):
    code, out, _ = run_cli(capsys, "formats", "e4m3", "e3m3")
    assert code == 0 and "e3m3" in out and "448" in out


def test_cast_fields_and_errors(capsys):
    code, out, _ = run_cli(capsys, "cast", "464", "-3e-5", "nan", "--format", "e4m3", "--json")
    assert code == 0
    res = json.loads(out)["results"]
    assert res[0]["code"] == "0x7e" and res[0]["fields"] == "0.1111.110" and res[0]["value"] == 448
    assert res[0]["abs_error"] == -16.0
    assert res[1]["code"] == "0x80" and res[1]["value"] == 0.0
    assert res[2]["code"] == "0x7f"
    code, out, _ = run_cli(capsys, "cast", "1e5", "--format", "e5m2", "--no-saturate", "--json")
    assert json.loads(out)["results"][0]["code"] == "0x7c"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["cast", "1", "--format", "e4m4fn"], "unknown format 'e4m4fn'; valid:"),
        (["cast", "abc"], "not a number: 'abc'"),
        (["cast", "1e6", "--format", "e2m1", "--no-saturate"], "overflow e2m1"),
        (["cast", "nan", "--format", "e2m1"], "has no NaN"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_usage_errors_are_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-c", "import sys; from fp8sim import cli; sys.exit(cli.main())",
                           "cast", "1", "--rounding", "bogus"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_json_output_is_strict_json(capsys):
    code, out, _ = run_cli(capsys, "cast", "nan", "inf", "--json")
    res = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert res["results"][0]["value"] == "nan" and res["results"][1]["input"] == "inf"


def test_generic_formats_beyond_float32_are_refused(capsys):
    code, out, err = run_cli(capsys, "formats", "e9m6")
    assert code == 2 and "2..8 exponent bits" in err and err.count("\n") == 1


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = [ln for ln in ci.splitlines() if ln.startswith("python3 -m venv")]
    assert len(cmd) == 1
    # the README shows the same command (CI adds -q to pip for quieter logs)
    readme_cmds = re.findall(r"^(python3 -m venv .*)$", readme, flags=re.M)
    assert cmd[0].replace("pip install -q ", "pip install ") in readme_cmds
