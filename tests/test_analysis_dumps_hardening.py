"""Dump loaders on inputs a tester found them wrong on: .pt files with deflated zip members,
FIFOs and other non-regular files, safetensors with duplicate keys or bytes no tensor holds,
.npz members that come to one dotted name, and the reasons given for random bytes in a .pt
and a damaged .npz member."""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8sim import cli
from fp8sim.analysis.dumps import open_dump

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def analyze_json(capsys, tmp_path, *paths, extra=()):
    """(exit code, stderr, the JSON document) of ``analyze PATHS --json``."""
    js = tmp_path / f"r{len(list(tmp_path.glob('r*.json')))}.json"
    rc, _, err = run(capsys, "analyze", *paths, "--format", "e4m3,e5m2", "--scaling",
                     "none,tensor,row", "--json", js, *extra)  # fmt: skip
    return rc, err, (json.loads(js.read_text()) if js.exists() else None)


def _rezip(src: Path, dst: Path, method: int) -> None:
    """Copy a zip's members into a new zip, each compressed with ``method``."""
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", method) as zo:
        for info in zi.infolist():
            zo.writestr(info.filename, zi.read(info.filename))


# ---- 1. a .pt whose zip members are deflated ----------------------------------------------------
def test_a_pt_with_deflated_members_gives_the_figures_of_the_stored_one(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    obj = {"a": torch.randn(1000, generator=g) * 300,
           "t": torch.randn(40, 30, generator=g).t(),  # non-contiguous
           "h": torch.randn(64, generator=g).to(torch.bfloat16),
           "f8": torch.randn(50, generator=g).to(torch.float8_e4m3fn)}  # fmt: skip
    ok, defl = tmp_path / "ok.pt", tmp_path / "defl.pt"
    torch.save(obj, ok)
    _rezip(ok, defl, zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(defl) as zf:
        assert any(i.compress_type == zipfile.ZIP_DEFLATED and i.compress_size < i.file_size
                   for i in zf.infolist())  # fmt: skip
    for name, src in {t.name: t for t in open_dump(defl).tensors}.items():
        want = obj[name].float() if name in ("h", "f8") else obj[name]
        np.testing.assert_array_equal(src.read_all(), want.numpy())
    rc, err, stored = analyze_json(capsys, tmp_path, ok)
    assert rc == 0, err
    rc, err, deflated = analyze_json(capsys, tmp_path, defl)
    assert rc == 0, err
    assert "loaded whole" not in err  # inflated into a mapped temporary file, not into memory
    strip = lambda doc: [{k: v for k, v in r.items() if k != "file"} for r in doc["records"]]  # noqa: E731
    assert len(strip(stored)) == 4 * 2 * 3 and strip(deflated) == strip(stored)


@pytest.mark.parametrize("method, says", [(zipfile.ZIP_BZIP2, "bzip2"), (zipfile.ZIP_LZMA, "LZMA")],
                         ids=["bzip2", "lzma"])
def test_a_pt_with_members_torch_cannot_inflate_is_refused_by_name(tmp_path, capsys, method, says):
    ok, bad = tmp_path / "ok.pt", tmp_path / "bad.pt"
    torch.save({"a": torch.ones(10)}, ok)
    _rezip(ok, bad, method)
    rc, out, err = run(capsys, "analyze", bad)
    assert rc == 2 and err.count("\n") == 1
    assert f"{bad}: zip members compressed with {says}" in err


# ---- 2. FIFOs, sockets and other files that are no regular files --------------------------------
def _cli_in_subprocess(*argv, timeout=300):
    """``fp8sim ARGV`` in a child process: a loader that opened a FIFO would block forever, and
    the timeout turns that into a failed test instead of a hung suite."""
    code = "import sys, cli; sys.exit(cli.main(sys.argv[1:]))"
    try:
        p = subprocess.run([sys.executable, "-c", code, *map(str, argv)], cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"fp8sim {' '.join(map(str, argv))} blocked (it opened a FIFO?)")
    return p.returncode, p.stdout, p.stderr


def test_a_fifo_is_refused_by_name_never_opened(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "good.npy", np.array([0.5, 2.0], np.float32))
    os.mkfifo(d / "f.npy")
    os.mkfifo(tmp_path / "g.safetensors")
    js = tmp_path / "r.json"
    # given as a PATH: one line, exit 2
    rc, out, err = _cli_in_subprocess("analyze", d / "f.npy")
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{d / 'f.npy'}: a named pipe (FIFO), not a regular file or a directory" in err
    # --keep-going: listed as bad, the others analyzed; found in a directory: the same
    rc, out, err = _cli_in_subprocess("analyze", d, tmp_path / "g.safetensors", "--keep-going",
                                      "--format", "e4m3", "--scaling", "none", "--json", js)  # fmt: skip
    doc = json.loads(js.read_text())
    assert rc == 2, err
    assert [r["name"] for r in doc["records"]] == ["good"]
    assert sorted(e["file"] for e in doc["errors"]) == [str(d / "f.npy"), str(tmp_path / "g.safetensors")]
    assert all("named pipe (FIFO)" in e["reason"] for e in doc["errors"])


def test_a_socket_is_refused_and_a_link_to_a_file_still_read(tmp_path, capsys):
    """A socket is never a regular file (unlike a FIFO, opening it fails at once: in-process)."""
    good = tmp_path / "good.npy"
    np.save(good, np.array([0.5, 2.0], np.float32))
    (tmp_path / "link.npy").symlink_to(good)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.pt"))
    try:
        with pytest.raises(ValueError, match=r"s\.pt: a socket, not a regular file or a directory"):
            open_dump(tmp_path / "s.pt")
        rc, out, err = run(capsys, "analyze", tmp_path / "s.pt")
        assert rc == 2 and err.count("\n") == 1 and "a socket, not a regular file" in err
    finally:
        sock.close()
    (src,) = open_dump(tmp_path / "link.npy").tensors
    np.testing.assert_array_equal(src.read_all(), [0.5, 2.0])


# ---- 3. safetensors the safetensors library refuses ---------------------------------------------
def _st(path: Path, header: bytes | dict, data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _f32(n, at):
    return {"dtype": "F32", "shape": [n], "data_offsets": [at, at + 4 * n]}


DATA = np.arange(6, dtype=np.float32).tobytes()  # 24 bytes


def test_a_safetensors_key_given_twice_is_refused(tmp_path, capsys):
    header = (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
              b'"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}')  # fmt: skip
    p = _st(tmp_path / "dup.safetensors", header, DATA)
    with pytest.raises(ValueError) as ei:
        open_dump(p)
    assert str(ei.value).startswith(f"{p}: corrupt safetensors header: the key 'a' is given twice")
    rc, out, err = run(capsys, "analyze", p)
    assert rc == 2 and err.count("\n") == 1 and "given twice" in err


#: name -> (header, data, what the refusal says)
UNCLAIMED = {
    "trailing": ({"a": _f32(4, 0)}, DATA, "8 bytes after the last tensor ('a') belong to no tensor"),
    "gap": ({"a": _f32(2, 0), "b": _f32(2, 16)}, DATA, "bytes 8..16 after 'a' belong to no tensor"),
    "lead": ({"a": _f32(4, 8)}, DATA, "bytes 0..8 at the start of the data section belong to no tensor"),
    "none": ({"__metadata__": {"k": "v"}}, DATA[:4], "4 bytes of data, but no tensor holds any"),
    "empty": ({"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}, DATA[:8],
              "8 bytes of data, but no tensor holds any"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(UNCLAIMED))
def test_safetensors_bytes_no_tensor_holds_are_refused(tmp_path, capsys, name):
    header, data, says = UNCLAIMED[name]
    p = _st(tmp_path / f"{name}.safetensors", header, data)
    with pytest.raises(ValueError) as ei:
        open_dump(p)
    assert str(ei.value) == f"{p}: corrupt safetensors: {says}"
    rc, out, err = run(capsys, "analyze", p)
    assert rc == 2 and err.count("\n") == 1 and says in err


def test_genuine_safetensors_files_still_load(tmp_path):
    from safetensors.numpy import save_file as save_np
    from safetensors.torch import save_file as save_torch

    t = {"w": torch.randn(3, 4), "e": torch.zeros(0, 3), "e2": torch.zeros(0), "s": torch.tensor(2.0),
         "h": torch.randn(5).to(torch.bfloat16), "f8": torch.randn(7).to(torch.float8_e4m3fn),
         "i": torch.arange(3)}  # fmt: skip
    save_torch(t, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    save_np({"e": np.zeros(0), "a": np.ones(3, np.float16), "z": np.zeros((2, 0))},
            str(tmp_path / "n.safetensors"), metadata={"k": "v"})  # fmt: skip
    save_np({}, str(tmp_path / "nothing.safetensors"))
    got = {s.name: s for s in open_dump(tmp_path / "t.safetensors").tensors}
    assert sorted(got) == sorted(t)
    for name in ("w", "h", "f8", "s"):
        np.testing.assert_array_equal(got[name].read_all(), t[name].float().numpy())
    got = {s.name: s.shape for s in open_dump(tmp_path / "n.safetensors").tensors}
    assert got == {"e": (0,), "a": (3,), "z": (2, 0)}
    assert open_dump(tmp_path / "nothing.safetensors").tensors == []
    # an entry of a dtype the analysis skips still holds its bytes (they are no gap)
    p = _st(tmp_path / "c.safetensors", {"c": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]},
                                         "b": _f32(2, 16)}, DATA)  # fmt: skip
    d = open_dump(p)
    assert [s.name for s in d.tensors] == ["b"] and d.skipped == [("c", "unsupported dtype C64")]


# ---- 4. .npz members that come to one dotted name -----------------------------------------------
def _npy_bytes(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED], ids=["stored", "deflated"])
def test_npz_members_of_one_dotted_name_stay_distinct(tmp_path, capsys, method):
    p = tmp_path / "m.npz"
    with warnings.catch_warnings(), zipfile.ZipFile(p, "w", method) as zf:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it writes
        zf.writestr("model/layer.0/w.npy", _npy_bytes(np.full(4, 1.0, np.float32)))
        zf.writestr("model/layer/0.w.npy", _npy_bytes(np.full(4, 2.0, np.float32)))
        zf.writestr("a.npy", _npy_bytes(np.full(3, 3.0, np.float32)))
        zf.writestr("a.npy", _npy_bytes(np.full(3, 4.0, np.float32)))  # one name twice
        zf.writestr("model.layer.0.w#2.npy", _npy_bytes(np.full(2, 5.0, np.float32)))
    values = {s.name: s.read_all().tolist() for s in open_dump(p).tensors}
    assert values == {"model.layer.0.w": [1.0] * 4, "model.layer.0.w#3": [2.0] * 4,
                      "a": [3.0] * 3, "a#2": [4.0] * 3, "model.layer.0.w#2": [5.0] * 2}  # fmt: skip
    rc, err, doc = analyze_json(capsys, tmp_path, p)
    assert rc == 0, err
    names = [r["name"] for r in doc["records"] if r["format"] == "e4m3" and r["scaling"] == "none"]
    assert sorted(names) == sorted(values)


def test_files_of_one_name_in_a_directory_are_told_apart_by_file(tmp_path, capsys):
    for sub, v in (("a", 1.0), ("b", 2.0)):
        (tmp_path / "d" / sub).mkdir(parents=True)
        np.save(tmp_path / "d" / sub / "x.npy", np.full(3, v, np.float32))
    rc, err, doc = analyze_json(capsys, tmp_path, tmp_path / "d")
    assert rc == 0, err
    seen = {(r["file"], r["name"], r["amax"]) for r in doc["records"]}
    assert seen == {(str(tmp_path / "d" / "a" / "x.npy"), "x", 1.0),
                    (str(tmp_path / "d" / "b" / "x.npy"), "x", 2.0)}  # fmt: skip


# ---- 5. the reasons given ------------------------------------------------------------------------
def test_random_bytes_in_a_pt_are_not_called_code(tmp_path, capsys):
    p = tmp_path / "garbage.pt"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError) as ei:
        open_dump(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: not a valid PyTorch file (corrupt or not a torch.save pickle: ")
    assert "run code" not in msg and "Unsupported operand" in msg and "\n" not in msg
    rc, out, err = run(capsys, "analyze", p)
    assert rc == 2 and err.count("\n") == 1 and "run code" not in err


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("what, says", [("evil", "GLOBAL os.makedirs"),
                                        ("decimal", "GLOBAL decimal.Decimal")])
def test_a_pickle_that_imports_code_is_still_called_code(tmp_path, legacy, what, says):
    """Both ways torch words it: a blocked module (os), a global not allowed (decimal.Decimal,
    inside torch's "WeightsUnpickler error:" line); zip-format and legacy files."""
    import decimal

    marker = tmp_path / "PWNED"
    p = tmp_path / "evil.pt"
    obj = _Evil(str(marker)) if what == "evil" else decimal.Decimal(1)
    torch.save({"w": torch.ones(2), "x": obj}, p, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(ValueError) as ei:
        open_dump(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: refused: the pickle wants to run code") and says in msg
    assert "\n" not in msg and not marker.exists()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _damage(path: Path, member: str, back: int) -> None:
    """Flip one byte ``back`` bytes before the end of a member's stored data."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + info.compress_size - back] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_damaged_data_byte_of_a_small_npz_member_is_no_header_fault(tmp_path, capsys):
    p = tmp_path / "s.npz"
    np.savez(p, a=np.ones(10, np.float32), b=np.ones(10, np.float32))  # stored, small
    _damage(p, "a.npy", back=4)  # in the data, not the header
    with pytest.raises(ValueError) as ei:
        open_dump(p)
    assert str(ei.value) == f"{p}: corrupt .npz member a.npy (CRC-32 mismatch: the stored data is damaged)"
    rc, out, err = run(capsys, "analyze", p)
    assert rc == 2 and err.count("\n") == 1 and "header" not in err and "CRC-32 mismatch" in err


def test_a_damaged_small_deflated_npz_member_is_no_header_fault(tmp_path):
    p = tmp_path / "z.npz"
    np.savez_compressed(p, a=np.arange(200, dtype=np.float32), b=np.ones(3, np.float32))
    _damage(p, "a.npy", back=3)
    with pytest.raises(ValueError) as ei:
        open_dump(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: corrupt .npz member a.npy") and ".npy header" not in msg


def test_a_fifo_named_config_json_is_never_opened(tmp_path):
    # read_json (config.json, *.index.json next to an FP8 checkpoint) only stats it: no hang
    from fp8sim.analysis.dumps.fp8_companions import read_json

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    assert read_json(str(fifo)) == (None, "is not a regular file")
    assert read_json(str(tmp_path / "missing.json")) == (None, "")
