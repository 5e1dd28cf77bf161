"""fp8sim analyze --keep-going past a tensor whose data cannot be read (the file's other tensors
still analyzed, the bad one listed by file and name, no partial record), whole bad files still
listed as such, and table cells that stay on one line (control characters in names escaped;
same-named tensors of different files told apart)."""

from __future__ import annotations

import json
import os
import struct
import zipfile

import numpy as np
import pytest

from fp8sim import cli
from fp8sim.analysis.dumps import TensorSource
from fp8sim.trace import TraceWriter


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _flip_member_byte(path, member, at_fraction=0.5):
    """Flip one byte inside a zip member's (stored or deflated) data."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    raw[start + int(info.compress_size * at_fraction)] ^= 0xFF
    path.write_bytes(bytes(raw))
    with zipfile.ZipFile(path) as zf:  # the damage is where it is meant to be
        zf.read("a.npy"), zf.read("c.npy")
        with pytest.raises((zipfile.BadZipFile, Exception)):
            zf.read(member)


def _bad_npz(tmp_path, compressed):
    p = tmp_path / ("z.npz" if compressed else "s.npz")
    rng = np.random.default_rng(0)
    arrays = dict(a=np.ones(1000, np.float32), b=rng.standard_normal(20000).astype(np.float32),
                  c=np.full(1000, 2, np.float32))  # fmt: skip
    (np.savez_compressed if compressed else np.savez)(p, **arrays)
    _flip_member_byte(p, "b.npy")
    return p


def _consistent(doc, err):
    """The JSON and stderr agree: the summary counts the records, every error is listed."""
    rows = doc["records"] + [r for t in doc["traces"] for r in t["tensors"]]
    counts = {k: sum(r["status"] == k for r in rows) for k in ("critical", "warning", "ok")}
    assert doc["summary"] == counts
    assert f"{counts['critical']} critical, {counts['warning']} warning, {counts['ok']} ok" in err
    for e in doc["errors"]:
        assert f"  {e['reason']}\n" in err


@pytest.mark.parametrize("compressed", [False, True])
def test_a_damaged_npz_member_is_bad_alone(tmp_path, capsys, compressed):
    p = _bad_npz(tmp_path, compressed)
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", p, "--keep-going", "--format", "e4m3", "--json", js)
    assert rc == 2
    doc = json.loads(js.read_text())
    assert sorted(r["name"] for r in doc["records"]) == ["a", "c"]  # c is not dropped
    (e,) = doc["errors"]
    assert e["file"] == str(p) and e["name"] == "b" and str(p) in e["reason"]
    assert ("b.npy" in e["reason"] or "cannot read b" in e["reason"]) and "CRC" in e["reason"]
    assert "bad tensors (1):\n" in err and "bad files" not in err
    _consistent(doc, err)
    # the table (no --json) shows a and c, never b
    rc, out, err = run(capsys, "analyze", p, "--keep-going", "--format", "e4m3")
    names = [line.split()[1] for line in out.splitlines()[2:]]
    assert rc == 2 and sorted(names) == ["a", "c"]
    # without --keep-going: exit 2 at the bad tensor, one line naming file and member
    rc, out, err = run(capsys, "analyze", p, "--format", "e4m3")
    assert rc == 2 and out == "" and err.count("\n") == 1 and str(p) in err and "CRC" in err


def _fail_mid_way(monkeypatch, bad_name):
    """TensorSource.read fails for ``bad_name`` after its first chunk was read."""
    real = TensorSource.read
    calls = {"n": 0}

    def read(self, start, stop):
        if self.name == bad_name:
            calls["n"] += 1
            if calls["n"] > 1:
                raise ValueError(f"{self.file}: truncated: data ends 12 bytes early")
        return real(self, start, stop)

    monkeypatch.setattr(TensorSource, "read", read)
    return calls


def _write(kind, tmp_path, tensors):
    if kind == "safetensors":
        from safetensors.numpy import save_file

        p = tmp_path / "m.safetensors"
        save_file(tensors, str(p))
    elif kind == "pt":
        import torch

        p = tmp_path / "m.pt"
        torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, p)
    else:
        p = tmp_path / "m.npz"
        np.savez_compressed(p, **tensors) if kind == "npz-deflated" else np.savez(p, **tensors)
    return p


@pytest.mark.parametrize("kind", ["safetensors", "pt", "npz", "npz-deflated"])
def test_a_tensor_failing_mid_way_has_no_record(tmp_path, capsys, monkeypatch, kind):
    tensors = {n: np.full(1000, v, np.float32) for n, v in (("a", 1.0), ("b", 3.0), ("c", 2.0))}
    p = _write(kind, tmp_path, tensors)
    other = tmp_path / "other.npy"
    np.save(other, np.full(10, 4.0, np.float32))
    calls = _fail_mid_way(monkeypatch, "b")
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", p, other, "--keep-going", "--chunk", "100", "--json", js)
    assert rc == 2 and calls["n"] == 2  # b was read in part, then failed
    doc = json.loads(js.read_text())
    assert sorted({r["name"] for r in doc["records"]}) == ["a", "c", "other"]
    assert [(e["file"], e["name"]) for e in doc["errors"]] == [(str(p), "b")]
    assert doc["errors"][0]["reason"].startswith(f"{p}: b: truncated")
    _consistent(doc, err)


def test_a_bad_npy_next_to_good_files_is_a_bad_tensor_of_its_file(tmp_path, capsys, monkeypatch):
    for n in ("a", "b", "c"):
        np.save(tmp_path / f"{n}.npy", np.ones(500, np.float32))
    _fail_mid_way(monkeypatch, "b")
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", tmp_path, "--keep-going", "--chunk", "100", "--json", js)
    doc = json.loads(js.read_text())
    assert rc == 2 and sorted({r["name"] for r in doc["records"]}) == ["a", "c"]
    assert [(e["file"], e["name"]) for e in doc["errors"]] == [(str(tmp_path / "b.npy"), "b")]


def test_a_saved_trace_tensor_failing_leaves_the_trace_and_its_other_tensors(tmp_path, capsys,
                                                                               monkeypatch):  # fmt: skip
    tr = tmp_path / "tr"
    with TraceWriter(tr, {}) as tw:
        tw.add_tensor("w", "weight", "e4m3", (400,))
        for step in (0, 1):
            x = np.full(400, step + 1.0, np.float32)
            tw.record(step, "w", x, scale=1.0)
            tw.save_tensor(step, "w", x)
    _fail_mid_way(monkeypatch, "w@step0")
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", tr, "--keep-going", "--chunk", "100", "--json", js)
    doc = json.loads(js.read_text())
    assert rc == 2 and {r["name"] for r in doc["records"]} == {"w@step1"}
    assert [t["path"] for t in doc["traces"]] == [str(tr)]  # its recorded statistics still shown
    assert [(e["file"], e["name"]) for e in doc["errors"]] == [(str(tr), "w@step0")]
    assert "bad tensors (1):" in err and f"{tr}: w@step0: {tr}{os.sep}tensors" in err
    _consistent(doc, err)


def test_whole_bad_files_and_bad_tensors_are_listed_apart(tmp_path, capsys):
    p = _bad_npz(tmp_path, compressed=False)
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"PK\x03\x04 not a zip")
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", broken, p, "--keep-going", "--format", "e4m3", "--json", js)
    doc = json.loads(js.read_text())
    assert rc == 2 and sorted(r["name"] for r in doc["records"]) == ["a", "c"]
    assert [(e["file"], e["name"]) for e in doc["errors"]] == [(str(broken), None), (str(p), "b")]
    files, tensors = err.split("bad files (1):\n", 1)[1].split("bad tensors (1):\n")
    assert str(broken) in files and files.count("\n") == 1
    assert str(p) in tensors and tensors.count("\n") == 1
    _consistent(doc, err)


# ---- table cells --------------------------------------------------------------------------------
def test_control_characters_in_names_stay_in_one_table_row(tmp_path, capsys):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    odd = ["new\nline", "tab\there", "esc\x1b[31mred", "cr\rret"]
    for n in odd:
        np.save(d / "sub" / f"{n}.npy", np.ones(8, np.float32))
    np.savez(d / "ints.npz", **{"i\nj": np.arange(3)})  # an integer tensor: a note names it
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", d, "--format", "e4m3", "--json", js)
    assert rc == 0, err
    assert sorted(r["name"] for r in json.loads(js.read_text())["records"]) == sorted(odd)  # raw
    rc, out, err = run(capsys, "analyze", d, "--format", "e4m3")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2 + len(odd)  # header, rule, one line per tensor
    assert all(line.startswith("ok ") for line in lines[2:])
    for shown in ("new\\nline", "tab\\there", "esc\\x1b[31mred", "cr\\rret"):
        assert shown in out
    assert "\x1b" not in out and "\r" not in out and "\t" not in out
    (note,) = [line for line in err.splitlines() if line.startswith("note:")]
    assert "i\\nj" in note and "int64" in note


def test_cell_escapes_like_the_error_lines():
    from fp8sim.analysis.report import escape_cell
    from fp8sim.commands.output import one_line

    assert escape_cell("a\nb\rc") == one_line("a\nb\rc") == "a\\nb\\rc"
    assert escape_cell(" lead\u2028x\u202ey\x7f") == " lead\\u2028x\\u202ey\\x7f"
    assert escape_cell("plain.name@step3") == "plain.name@step3"


def test_same_names_from_different_files_are_told_apart(tmp_path, capsys):
    np.savez(tmp_path / "a.npz", w=np.ones(8, np.float32), u=np.ones(8, np.float32))
    np.savez(tmp_path / "b.npz", w=np.ones(8, np.float32))
    for sub in ("x", "y"):
        (tmp_path / sub).mkdir()
        np.save(tmp_path / sub / "m.npy", np.ones(8, np.float32))  # same base name too
    js = tmp_path / "r.json"
    rc, out, err = run(capsys, "analyze", tmp_path, "--format", "e4m3", "--json", js)
    assert rc == 0, err
    assert sorted(r["name"] for r in json.loads(js.read_text())["records"]) == ["m", "m", "u", "w", "w"]
    rc, out, err = run(capsys, "analyze", tmp_path, "--format", "e4m3")
    cells = sorted(line[line.index(" ") :].strip().split("  ")[0] for line in out.splitlines()[2:])
    assert cells == sorted(["w (a.npz)", "w (b.npz)", "u", f"m ({tmp_path / 'x' / 'm.npy'})",
                            f"m ({tmp_path / 'y' / 'm.npy'})"])  # fmt: skip
    # one file alone: plain names
    rc, out, err = run(capsys, "analyze", tmp_path / "a.npz", "--format", "e4m3")
    assert "(a.npz)" not in out
