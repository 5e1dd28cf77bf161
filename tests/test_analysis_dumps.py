"""analysis.dumps: every supported container, dotted names, refusal of code-running pickles,
corrupt/truncated files named, and bounded memory on a large file (RSS of a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as st_save_np
from safetensors.torch import save_file as st_save_torch

from analysis.dumps import expand_paths, iter_dumps, open_dump
from fp8sim.trace import TraceWriter

RNG = np.random.default_rng(11)


def _by_name(dump):
    return {t.name: t for t in dump.tensors}


def test_safetensors_all_dtypes(tmp_path):
    f = tmp_path / "a.safetensors"
    data = {
        "h": torch.from_numpy(RNG.standard_normal((5, 7))).half(),
        "b": torch.from_numpy(RNG.standard_normal((3, 4, 5))).bfloat16(),
        "f": torch.from_numpy(RNG.standard_normal(9)).float(),
        "d": torch.from_numpy(RNG.standard_normal((2, 2))),
        "i": torch.arange(6),
    }
    st_save_torch(data, str(f))
    d = open_dump(f)
    t = _by_name(d)
    assert d.kind == "safetensors" and set(t) == set(data)
    for k in ("h", "b", "f", "d"):
        assert t[k].shape == tuple(data[k].shape) and t[k].is_float
        np.testing.assert_array_equal(t[k].read_all(), data[k].double().numpy())
    assert t["b"].dtype == "bfloat16" and t["b"].read(3, 8).dtype == np.float32
    np.testing.assert_array_equal(t["b"].read(3, 8), data["b"].float().numpy().ravel()[3:8])
    assert not t["i"].is_float and t["i"].dtype == "int64"


def test_bad_safetensors_are_named(tmp_path):
    good = tmp_path / "g.safetensors"
    st_save_np({"w": np.ones((64, 64), np.float32)}, str(good))
    raw = good.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(ValueError, match=r"trunc\.safetensors: truncated"):
        open_dump(tmp_path / "trunc.safetensors")
    (tmp_path / "hdr.safetensors").write_bytes(raw[:8] + b"{not json" + raw[17:])
    with pytest.raises(ValueError, match=r"hdr\.safetensors: corrupt safetensors header"):
        open_dump(tmp_path / "hdr.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="tiny.safetensors"):
        open_dump(tmp_path / "tiny.safetensors")
    with pytest.raises(ValueError, match="unknown dump type"):
        (tmp_path / "x.txt").write_text("hi")
        open_dump(tmp_path / "x.txt")


def test_pt_nested_names_and_legacy_format(tmp_path):
    obj = {
        "model": {"layers": [{"w": torch.randn(3, 4)}, {"w": torch.randn(2).bfloat16()}]},
        "pair": (torch.ones(2, dtype=torch.float64), torch.zeros(1, dtype=torch.int32)),
        "step": 7,
    }
    for legacy in (False, True):
        f = tmp_path / f"m{int(legacy)}.pt"
        torch.save(obj, f, _use_new_zipfile_serialization=not legacy)
        d = open_dump(f)
        t = _by_name(d)
        assert set(t) == {"model.layers.0.w", "model.layers.1.w", "pair.0", "pair.1"}
        np.testing.assert_array_equal(t["model.layers.0.w"].read_all(), obj["model"]["layers"][0]["w"].numpy())
        np.testing.assert_array_equal(
            t["model.layers.1.w"].read(0, 2), obj["model"]["layers"][1]["w"].float().numpy()
        )
        assert t["pair.1"].dtype == "int32" and not t["pair.1"].is_float
        assert d.skipped == [("step", "not a tensor (int)")]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_pickle_with_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "PWNED"
    f = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil(str(marker))}, f)
    with pytest.raises(ValueError, match=r"evil\.pt: refused: the pickle wants to run code"):
        open_dump(f)
    assert not marker.exists()
    (tmp_path / "cut.pt").write_bytes(f.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cut\.pt: corrupt or truncated"):
        open_dump(tmp_path / "cut.pt")


def test_npy_npz(tmp_path):
    a = RNG.standard_normal((6, 5))
    np.save(tmp_path / "c.npy", a)
    np.save(tmp_path / "fort.npy", np.asfortranarray(a.astype(np.float32)))
    np.save(tmp_path / "h.npy", a.astype(np.float16))
    for name, want in (("c", a), ("fort", a.astype(np.float32)), ("h", a.astype(np.float16).astype(np.float32))):
        (t,) = open_dump(tmp_path / f"{name}.npy").tensors
        assert t.name == name and t.shape == (6, 5)
        np.testing.assert_array_equal(t.read_all(), want)
        np.testing.assert_array_equal(t.read(7, 19), want.ravel()[7:19])
    # numpy stores an ml_dtypes bfloat16 array as raw 2-byte voids: reported, never guessed
    np.save(tmp_path / "bf.npy", a.astype(ml_dtypes.bfloat16))
    (t,) = open_dump(tmp_path / "bf.npy").tensors
    assert t.dtype == "void16" and not t.is_float
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="object arrays are refused"):
        open_dump(tmp_path / "obj.npy")
    raw = (tmp_path / "c.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[:-8])
    with pytest.raises(ValueError, match=r"cut\.npy: truncated"):
        open_dump(tmp_path / "cut.npy")

    big = RNG.standard_normal(50_000).astype(np.float16)
    np.savez_compressed(tmp_path / "z.npz", **{"a": big, "n/s": a, "i": np.arange(3)})
    np.savez(tmp_path / "s.npz", a=big)
    for f in ("z.npz", "s.npz"):
        t = _by_name(open_dump(tmp_path / f))
        src = t["a"]
        # sequential chunks, then a backwards read (reopens a deflate stream)
        got = np.concatenate([src.read(i, i + 7000) for i in range(0, big.size, 7000)])
        np.testing.assert_array_equal(got, big.astype(np.float32))
        np.testing.assert_array_equal(src.read(10, 20), big[10:20].astype(np.float32))
    t = _by_name(open_dump(tmp_path / "z.npz"))
    assert "n.s" in t and not t["i"].is_float
    (tmp_path / "bad.npz").write_bytes((tmp_path / "z.npz").read_bytes()[:300])
    with pytest.raises(ValueError, match=r"bad\.npz: corrupt"):
        open_dump(tmp_path / "bad.npz")


def test_corrupt_deflate_stream_fails_on_read_with_file_name(tmp_path):
    big = RNG.standard_normal(200_000).astype(np.float32)
    np.savez_compressed(tmp_path / "z.npz", a=big)
    raw = bytearray((tmp_path / "z.npz").read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 64] = bytes(64)  # damage the compressed data, keep the directory
    (tmp_path / "z.npz").write_bytes(bytes(raw))
    (src,) = open_dump(tmp_path / "z.npz").tensors
    with pytest.raises(ValueError, match=r"z\.npz"):
        src.read(0, big.size)


def test_directories_and_traces(tmp_path):
    (tmp_path / "sub").mkdir()
    np.save(tmp_path / "sub" / "b.npy", np.ones(3))
    np.save(tmp_path / "a.npy", np.ones(3))
    (tmp_path / "notes.txt").write_text("x")
    with TraceWriter(tmp_path / "sub" / "trace") as tw:
        tw.add_tensor("w", "weight", "e4m3", (4,))
        tw.record(0, "w", np.ones(4, np.float32), scale=1.0)
        tw.save_tensor(0, "w", np.arange(4, dtype=np.float32))
    paths = expand_paths([tmp_path])
    assert [os.path.relpath(p, tmp_path) for p in paths] == ["a.npy", "sub/trace", "sub/b.npy"]
    d = open_dump(tmp_path / "sub" / "trace")
    assert d.kind == "trace" and d.trace is not None
    (t,) = d.tensors
    assert t.name == "w@step0"
    np.testing.assert_array_equal(t.read_all(), np.arange(4))
    with pytest.raises(ValueError, match="no such file"):
        expand_paths([tmp_path / "missing.pt"])
    res = dict(iter_dumps([tmp_path / "a.npy", tmp_path / "notes.txt"]))
    assert isinstance(res[str(tmp_path / "notes.txt")], ValueError)


_RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from analysis.dumps import open_dump
    from analysis.stats import parse_variants, tensor_stats

    def status_mb(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024

    vs = parse_variants(["e4m3"], ["tensor", "block:1x128"])
    tensor_stats(np.ones((4, 256), np.float32), vs)  # imports and compiled code in place
    d = open_dump(sys.argv[1])
    (t,) = d.tensors
    t.read(0, 1)
    base = status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    st = tensor_stats(t, vs)
    print(st.numel, base, status_mb("VmHWM"))
    """
)


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_large_file_memory_is_bounded(tmp_path, kind):
    """A 64 MiB dump is analyzed with well under its size of extra resident memory (peak RSS
    during the analysis minus RSS before it, in a subprocess): data is read in 4 MiB chunks
    (pread, or torch's mmap with the pages dropped after each chunk)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to measure a peak")
    n = 16 << 20  # float32 elements: 64 MiB
    path = tmp_path / f"big.{kind}"
    x = torch.empty((n // 4096, 4096), dtype=torch.float32)
    x.normal_()
    if kind == "safetensors":
        st_save_torch({"x": x}, str(path))
    else:
        torch.save({"x": x}, path)
    del x
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True,
        env=dict(os.environ), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    numel, base, peak = (int(v) for v in out.stdout.split())
    assert numel == n
    print(f"RSS {kind}: {base} MiB before, peak {peak} MiB while analyzing a 64 MiB file")
    assert peak - base < 40, (base, peak)


def test_pt_shared_references_reported_once_and_capped(tmp_path):
    # a few KB describing 2**40 paths: must not be walked path by path
    t = torch.arange(3, dtype=torch.float32)
    dag = [t]
    for _ in range(40):
        dag = [dag, dag]
    f = tmp_path / "dag.pt"
    torch.save(dag, f)
    d = open_dump(f)
    assert [s.name for s in d.tensors] == ["0." * 40 + "0"]
    assert np.array_equal(d.tensors[0].read_all(), [0, 1, 2])
    # a shared tensor under two names: reported once, under its first name
    f2 = tmp_path / "shared.pt"
    torch.save({"a": t, "b": t}, f2)
    d2 = open_dump(f2)
    assert [s.name for s in d2.tensors] == ["a"] and d2.skipped[0][0] == "b"
    # many distinct entries: refused with one line naming the file
    f3 = tmp_path / "wide.pt"
    torch.save([[i] for i in range(60_000)], f3)
    with pytest.raises(ValueError, match="wide.pt.*entries"):
        open_dump(f3)


def _patch_central_dir(path, flag_or=0, method=None):
    raw = bytearray(path.read_bytes())
    i = raw.find(b"PK\x01\x02")
    while i >= 0:
        raw[i + 8] |= flag_or
        if method is not None:
            raw[i + 10 : i + 12] = method.to_bytes(2, "little")
        i = raw.find(b"PK\x01\x02", i + 4)
    path.write_bytes(bytes(raw))


def test_odd_bad_files_give_one_line_valueerror(tmp_path):
    st = tmp_path / "deep.safetensors"
    header = b"[" * 200_000
    st.write_bytes(len(header).to_bytes(8, "little") + header)
    enc, meth = tmp_path / "enc.npz", tmp_path / "meth.npz"
    for f in (enc, meth):
        np.savez(f, a=np.ones(3, np.float32))
    _patch_central_dir(enc, flag_or=1)  # "encrypted"
    _patch_central_dir(meth, method=99)  # an unknown compression method
    for f in (st, enc, meth):
        with pytest.raises(ValueError) as ei:
            open_dump(f)
        msg = str(ei.value)
        assert msg.startswith(str(f)) and "\n" not in msg


def test_pt_sparse_tensor_is_skipped_with_a_note(tmp_path):
    f = tmp_path / "sp.pt"
    torch.save({"s": torch.eye(3).to_sparse(), "d": torch.ones(2)}, f)
    d = open_dump(f)
    assert [t.name for t in d.tensors] == ["d"]
    assert d.skipped[0][0] == "s" and "sparse" in d.skipped[0][1]


def _st_raw(path, entry, data=b""):
    import json as _json

    header = _json.dumps({"x": entry}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize(
    "shape, offsets",
    [([2**32, 2**32], [0, 0]),  # 2**64 elements: np.prod in int64 wraps to 0
     ([2.7], [0, 8]), ([True], [0, 4]), ([-1, -1], [0, 4])],
)  # fmt: skip
def test_safetensors_bad_shapes_are_corrupt(tmp_path, shape, offsets):
    f = tmp_path / "s.safetensors"
    _st_raw(f, {"dtype": "F32", "shape": shape, "data_offsets": offsets}, b"\0" * 8)
    with pytest.raises(ValueError, match=r"s\.safetensors.*corrupt"):
        open_dump(f)


def test_npy_shape_overflowing_int64_is_corrupt(tmp_path):
    f = tmp_path / "big.npy"
    with open(f, "wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<f4", "fortran_order": False, "shape": (2**32, 2**32)}
        )
        fh.write(b"\0" * 16)
    with pytest.raises(ValueError, match=r"big\.npy: corrupt"):
        open_dump(f)


def test_raw_pickle_with_code_is_refused_without_warnings(tmp_path):
    import pickle
    import warnings

    marker = tmp_path / "PWNED2"
    f = tmp_path / "raw.pt"
    f.write_bytes(pickle.dumps({"x": _Evil(str(marker))}, protocol=4))  # not torch's own 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"raw\.pt: "):
            open_dump(f)
    assert not marker.exists()
    assert [str(w.message) for w in caught] == []
