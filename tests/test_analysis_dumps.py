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

from fp8sim.analysis.dumps import expand_paths, iter_dumps, open_dump
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
    from fp8sim.analysis.dumps import open_dump
    from fp8sim.analysis.stats import parse_variants, tensor_stats

    def status_mb(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024

    vs = parse_variants(["e4m3"], ["tensor", "block:1x128"])
    # imports and compiled code in place: the parallel kernels too (4 parts; a tensor of one
    # part would take their serial twins)
    tensor_stats(np.ones((4, 1 << 16), np.float32), vs)
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


# ------------------------------------------------------------------------------------------
# strided data (Fortran order, non-contiguous and legacy-format tensors): exact values, and the
# memory bound (no read maps or copies more than a window / the read-ahead, never the tensor)
# ------------------------------------------------------------------------------------------
def _small_windows(monkeypatch, window=256, ahead=512):
    """Shrink the strided-copy window and read-ahead so small arrays take many pieces; record
    the byte span of every dropped piece and the element count of every strided copy."""
    import fp8sim.analysis.dumps.strided as ds

    monkeypatch.setattr(ds, "WINDOW_BYTES", window)
    monkeypatch.setattr(ds, "READAHEAD_BYTES", ahead)
    seen = {"drops": [], "copies": []}
    drop, copy = ds.drop_pages, ds.copy_c_range

    def drop_rec(addr, nbytes, bounds=None):
        seen["drops"].append(nbytes)
        return drop(addr, nbytes, bounds)

    def copy_rec(arr, start, stop, **kw):
        seen["copies"].append(stop - start)
        return copy(arr, start, stop, **kw)

    import fp8sim.analysis.dumps.torch_reader as dt_mod

    for mod in (ds, dt_mod):
        monkeypatch.setattr(mod, "drop_pages", drop_rec)
        monkeypatch.setattr(mod, "copy_c_range", copy_rec)
    return seen


def _check_ranges(open_src, want, seen):
    """read_all, and on a fresh source a sweep of odd ranges (forwards, then backwards), equal
    ``want`` exactly; ``seen`` then holds what the sweep (not read_all) copied."""
    flat = want.ravel()
    np.testing.assert_array_equal(open_src().read_all(), want)
    src = open_src()
    for v in seen.values():
        v.clear()
    for start in list(range(0, flat.size, 37)) + list(range(flat.size - 1, -1, -53)):
        np.testing.assert_array_equal(src.read(start, start + 29), flat[start : start + 29])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_fortran_arrays_read_exactly_and_bounded(tmp_path, monkeypatch, dtype):
    seen = _small_windows(monkeypatch)
    isz = np.dtype(dtype).itemsize
    a = np.asfortranarray(RNG.standard_normal((7, 6, 9)).astype(dtype))
    np.save(tmp_path / "f.npy", a)
    np.savez(tmp_path / "s.npz", a=a, b=a[:, :, 0])  # stored members
    np.savez_compressed(tmp_path / "z.npz", a=a)  # a deflated member: a stream, no mmap
    import fp8sim.analysis.dumps.core as dumps_mod

    fetched = []
    stream = dumps_mod._stream_reader

    def stream_rec(*args):
        read = stream(*args)

        def rec(lo, hi):
            fetched.append(hi - lo)
            return read(lo, hi)

        return rec

    monkeypatch.setattr(dumps_mod, "_stream_reader", stream_rec)
    for f in ("f.npy", "s.npz", "z.npz"):
        def open_src():
            return _by_name(open_dump(tmp_path / f))["a" if f != "f.npy" else "f"]

        assert open_src().shape == a.shape
        _check_ranges(open_src, a.astype(np.float64 if dtype == np.float64 else np.float32), seen)
        # the bound, for reads smaller than the read-ahead: each mapped piece spans at most the
        # window, each strided copy is at most the read-ahead, each stream fetch the window
        assert seen["drops"] and max(seen["drops"]) < 256 + isz  # z.npz: its spilled copy
        assert seen["copies"] and max(seen["copies"]) <= 512 // isz < a.size
    assert not fetched  # the deflated Fortran member is inflated once into a file, not streamed
    b = _by_name(open_dump(tmp_path / "s.npz"))["b"]
    np.testing.assert_array_equal(b.read_all(), a[:, :, 0].astype(b.read_all().dtype))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_strided_pt_tensors_read_exactly_and_bounded(tmp_path, monkeypatch, legacy):
    base = torch.from_numpy(RNG.standard_normal((6, 5, 7)))
    obj = {}
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        b = base.to(dt)
        tag = str(dt).replace("torch.", "")
        obj[tag] = {
            "t": b.transpose(0, 2),
            "perm": b.permute(1, 2, 0),
            "step": b[1:5, ::2, 3:],
            "expand": b[0, 0, :1].expand(4, 6),
            "offset": b.reshape(-1)[7:47].reshape(5, 8).t(),
            "c": b.clone(),
        }
    f = tmp_path / "m.pt"
    torch.save(obj, f, _use_new_zipfile_serialization=not legacy)
    want = torch.load(f, weights_only=True)
    seen = _small_windows(monkeypatch, window=256, ahead=64)

    def refuse(*a, **k):
        raise AssertionError("a whole tensor was materialized")

    monkeypatch.setattr(torch.Tensor, "contiguous", refuse)
    if legacy:  # laid out from the file, never loaded whole by torch.load
        monkeypatch.setattr(torch, "load", refuse)
    d = open_dump(f)
    assert len(d.tensors) == 24
    for src in d.tensors:
        dt, name = src.name.split(".")
        ref = want[dt][name]
        assert src.dtype == dt and src.shape == tuple(ref.shape)
        _check_ranges(lambda: _by_name(open_dump(f))[src.name],
                      ref.double().numpy().astype(np.float64 if dt == "float64" else np.float32),
                      seen)  # fmt: skip
        if name != "c":  # contiguous tensors are plain slices; the others strided copies
            isz = ref.element_size()
            assert seen["copies"] and max(seen["copies"]) <= max(29, 64 // isz)
            assert seen["drops"] and max(seen["drops"]) < 256 + isz


def test_legacy_pt_that_cannot_be_laid_out_is_loaded_whole_with_a_note(tmp_path, monkeypatch, capsys):
    import fp8sim.analysis.dumps.torch_reader as dt_mod

    x = torch.from_numpy(RNG.standard_normal((3, 4)))
    f = tmp_path / "old.pt"
    torch.save({"x": x.t()}, f, _use_new_zipfile_serialization=False)

    def cannot(path):
        raise dt_mod._NotLegacy("storage views")

    monkeypatch.setattr(dt_mod, "_load_legacy_layout", cannot)
    (src,) = open_dump(f).tensors
    np.testing.assert_array_equal(src.read_all(), x.t().numpy())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "old.pt: loaded whole into memory" in err and "storage views" in err


def test_truncated_legacy_pt_is_named(tmp_path):
    f = tmp_path / "old.pt"
    torch.save({"x": torch.ones(1000)}, f, _use_new_zipfile_serialization=False)
    (tmp_path / "cut.pt").write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cut\.pt: truncated legacy \.pt"):
        open_dump(tmp_path / "cut.pt")


_STRIDED_RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from fp8sim.analysis.dumps import open_dump

    def status_mb(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024

    if sys.argv[1].endswith(".pt"):
        import torch  # noqa: F401  (imported before the baseline)
    base = status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    (t,) = open_dump(sys.argv[1]).tensors  # opening counts too: nothing may be loaded whole
    check, chunk = 0.0, 1 << 20  # the chunk tensor_stats reads
    for start in range(0, t.numel, chunk):
        x = t.read(start, min(t.numel, start + chunk)).astype(np.float64)
        check += float(x @ (np.arange(start, start + x.size) % 13 + 1))
    print(t.numel, base, status_mb("VmHWM"), repr(check))
    """
)


@pytest.mark.parametrize("kind", ["fortran.npy", "fortran.npz", "fortran_z.npz", "transposed.pt",
                                  "legacy.pt"])  # fmt: skip
def test_strided_large_file_memory_is_bounded(tmp_path, kind):
    """Opening a 256 MiB Fortran-ordered / transposed / legacy-format dump and reading it in C
    order, chunk by chunk, adds well under its size to the peak resident memory of a subprocess
    (expected: the 32 MiB read-ahead, an 8 MiB window of mapped pages, the chunk and the script's
    float64 copies; loading it whole would add 256 MiB or more). The position-weighted checksum
    proves the values came in C order."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to measure a peak")
    n = 8192
    a = np.arange(n, dtype=np.float32) * 7 % 1000  # c[r, j] = a[r] + b[j]: small ints, exact
    b = np.arange(n, dtype=np.float32) * 13 % 997
    ct = np.add.outer(b, a)  # C-contiguous c.T: its transpose is c in Fortran order
    # the checksum sum_p c.flat[p] * (p % 13 + 1), with p = r * n + j and n % 13 == 2
    wq = (np.arange(13)[:, None] + np.arange(n)[None, :]) % 13 + 1  # weights of a row, by 2r % 13
    q = 2 * np.arange(n) % 13
    want = float(a.astype(np.float64) @ wq.sum(1)[q] + (wq @ b.astype(np.float64))[q].sum())
    path = tmp_path / kind
    if kind.endswith(".npy"):
        np.save(path, ct.T)
    elif kind.endswith("_z.npz"):  # deflated: inflated once into a temporary file
        np.savez_compressed(path, x=ct.T)
    elif kind.endswith(".npz"):
        np.savez(path, x=ct.T)
    else:  # stored transposed: the C-order tensor is the transpose of the storage
        torch.save({"x": torch.from_numpy(ct).t()}, path,
                   _use_new_zipfile_serialization=kind != "legacy.pt")  # fmt: skip
    del ct
    assert os.path.getsize(path) >= (256 << 20 if "_z" not in kind else 1 << 20)
    out = subprocess.run(
        [sys.executable, "-c", _STRIDED_RSS_SCRIPT, str(path)], capture_output=True, text=True,
        env=dict(os.environ), cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded whole" not in out.stderr
    numel, base, peak, check = out.stdout.split()
    assert int(numel) == n * n and float(check) == want
    print(f"RSS {kind}: {base} MiB before, peak {peak} MiB while reading a 256 MiB file")
    assert int(peak) - int(base) < 96, (base, peak)


def test_a_damaged_deflated_fortran_member_is_refused(tmp_path):
    a = np.asfortranarray(RNG.standard_normal((300, 200)).astype(np.float32))
    p = tmp_path / "z.npz"
    np.savez_compressed(p, a=a)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the deflated data
    p.write_bytes(bytes(raw))
    src = _by_name(open_dump(p))["a"]
    with pytest.raises(ValueError, match=r"z\.npz: corrupt \.npz member a\.npy"):
        src.read(0, 10)
