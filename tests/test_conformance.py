"""``fp8sim conformance``: its report is checked against the emulator, row by row.

Every row's counts and verdict are recomputed here from the library's own cast and
``fp8sim.encode`` on the same inputs, so the report is right whatever a library does -- Triton's
interpreter may convert float32 -> fp8 wrongly (3.9 loses the rounding carry) or rightly, and
either answer passes as long as the report states it. Facts about torch and ml_dtypes that do not
change (their overflow rules) are asserted as such.
"""

import json

import numpy as np

import fp8sim
from fp8sim import cli
from fp8sim.conformance import KNOWN_DIFFERENCES, available_casts, float16_all, float32_sweep, untested_libraries

PATTERNS = 65536


def _matches(theirs: np.ndarray, ours: np.ndarray, fmt) -> np.ndarray:
    """Same code, or both codes NaN (payloads carry no meaning)."""
    table = fp8sim.emulator.decode_table(fmt, np.float64)
    return (theirs == ours) | (np.isnan(table[theirs]) & np.isnan(table[ours]))


def _expected_row(library, tname, fmt, x, cast):
    """(n, agree_saturating, agree_nonsaturating, verdict, excluded) from first principles."""
    if fmt.nan == "none":
        x = x[np.isfinite(x)]
    excluded = 0
    if (library, tname) in KNOWN_DIFFERENCES:
        skip = KNOWN_DIFFERENCES[(library, tname)][1](x)
        excluded, x = int(skip.sum()), x[~skip]
    theirs = cast(x).astype(np.int64)
    counts = {}
    for sat in (True, False):
        try:
            ours = fp8sim.encode(x, fmt, saturate=sat).astype(np.int64)
        except ValueError:  # no NaN/inf to overflow into
            counts[sat] = -1
            continue
        counts[sat] = int(_matches(theirs, ours, fmt).sum())
    n = x.size
    verdict = ("agrees (no overflow in range)" if counts[True] == counts[False] == n else
               "agrees, saturating" if counts[True] == n else
               "agrees, non-saturating" if counts[False] == n else "DISAGREES")
    return n, counts[True], counts[False], verdict, excluded


def test_conformance_report_is_right_about_every_library(capsys):
    code = cli.main(["conformance", "--patterns", str(PATTERNS), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out)
    rows = {(r["library"], r["target"], r["inputs"]): r for r in doc if r["verdict"] != "UNTESTED"}
    assert {r["library"] for r in doc if r["verdict"] == "UNTESTED"} == set(untested_libraries())
    casts = available_casts()
    assert {(lib, t) for lib, t, _, _ in casts} == {(k[0], k[1]) for k in rows}
    for library, tname, ours, factory in casts:
        fmt = fp8sim.get_format(ours)
        cast = factory()
        for inputs, x in (("float16-all", float16_all()),
                          ("float32-sweep", float32_sweep(PATTERNS, fmt))):
            r = rows[(library, tname, inputs)]
            assert r["error"] is None, r
            want = _expected_row(library, tname, fmt, x, cast)
            got = (r["n"], r["agree_saturating"], r["agree_nonsaturating"], r["verdict"],
                   r["excluded"])
            assert got == want, (library, tname, inputs)
            # a disagreement shown is a real one: the library's and the emulator's codes
            best = r["agree_saturating"] >= r["agree_nonsaturating"]
            assert bool(r["first_disagreements"]) == (r["verdict"] == "DISAGREES")
            for d in r["first_disagreements"]:
                xi = np.array([d["input"]], np.float32)
                theirs, mine = int(cast(xi)[0]), int(fp8sim.encode(xi, fmt, saturate=best)[0])
                assert (d["theirs"], d["emulator"]) == (f"{theirs:#04x}", f"{mine:#04x}")
                assert not _matches(np.array([theirs]), np.array([mine]), fmt)[0]


def test_conformance_knows_torch_and_ml_dtypes_overflow_rules(capsys):
    """Independent facts: torch's e4m3fn cast saturates, ml_dtypes' does not (NaN), torch's
    e5m2 overflows to inf; E8M0's documented differences are excluded and named."""
    code = cli.main(["conformance", "--patterns", str(PATTERNS), "--json",
                     "--library", "torch", "--library", "ml_dtypes"])
    res = {(r["library"], r["target"], r["inputs"]): r for r in json.loads(capsys.readouterr().out)}
    assert code == 0
    torch_e4 = res[("torch", "float8_e4m3fn", "float32-sweep")]
    assert torch_e4["verdict"] == "agrees, saturating"
    assert torch_e4["agree_saturating"] == torch_e4["n"] >= PATTERNS
    assert res[("ml_dtypes", "float8_e4m3fn", "float32-sweep")]["verdict"] == "agrees, non-saturating"
    assert res[("torch", "float8_e5m2", "float16-all")]["verdict"] == "agrees, non-saturating"
    for lib in ("torch", "ml_dtypes"):
        r = res[(lib, "float8_e8m0fnu", "float32-sweep")]
        assert r["verdict"].startswith("agrees") and r["excluded"] > 0 and r["note"]


def test_a_library_that_cannot_be_tested_is_named_never_left_out_silently(capsys, monkeypatch):
    """Neither ml_dtypes nor Triton importable: each is listed (stderr, and a row UNTESTED with the
    reason in the JSON); asked for by name, one is an error (exit 2) before any work."""
    import sys

    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import fails, find_spec gives None
    monkeypatch.setitem(sys.modules, "triton", None)
    assert set(untested_libraries()) == {"ml_dtypes", "triton"}
    assert cli.main(["conformance", "--library", "ml_dtypes"]) == 2
    err = capsys.readouterr().err
    assert "--library ml_dtypes: cannot be tested here: ml_dtypes is not installed (pip install ml_dtypes)" in err
    assert cli.main(["conformance", "--patterns", "1024", "--json"]) == 0
    out, err = capsys.readouterr()
    untested = {r["library"]: r for r in json.loads(out) if r["verdict"] == "UNTESTED"}
    assert set(untested) == {"ml_dtypes", "triton"} and "pip install ml_dtypes" in untested["ml_dtypes"]["error"]
    assert "not tested: ml_dtypes: ml_dtypes is not installed" in err and "not tested: triton" in err
    assert cli.main(["conformance", "--patterns", "1024"]) == 0  # the table names them too
    table = capsys.readouterr().out
    assert any(line.startswith("ml_dtypes") and "ml_dtypes is not installed" in line for line in table.splitlines())
