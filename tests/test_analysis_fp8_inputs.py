"""FP8 tensors in dumps (an FP8 checkpoint): read as the exact values of their codes, checked
against ml_dtypes' decoding of the same bytes (an independent library), then analyzed."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import save_file as st_save_torch

from fp8sim.analysis.dumps import open_dump
from fp8sim.analysis.stats import parse_variants, tensor_stats

#: torch dtype name -> (torch dtype, ml_dtypes type)
FP8 = {
    "float8_e4m3fn": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    "float8_e5m2": (torch.float8_e5m2, ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": (torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": (torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz),
}


def every_code(name, shape=(16, 16)):
    """All 256 codes (NaN codes, both zeros, subnormals, max) as a torch FP8 tensor."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(shape)
    return codes.view(FP8[name][0])


def independent(t):
    """The values of a torch FP8 tensor's codes, decoded by ml_dtypes (float64)."""
    codes = t.contiguous().view(torch.uint8).numpy()
    return codes.view(FP8[str(t.dtype).replace("torch.", "")][1]).astype(np.float64)


def same(a, b):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b))


def test_safetensors_fp8_codes_read_as_their_values(tmp_path):
    f = tmp_path / "ckpt.safetensors"
    data = {"w4": every_code("float8_e4m3fn"), "w5": every_code("float8_e5m2"),
            "w4_scale_inv": torch.ones(1)}  # fmt: skip
    st_save_torch(data, str(f))
    t = {s.name: s for s in open_dump(f).tensors}
    for name, dtype in (("w4", "float8_e4m3fn"), ("w5", "float8_e5m2")):
        src = t[name]
        assert src.dtype == dtype and src.is_float and src.shape == (16, 16)
        x = src.read_all()
        assert x.dtype == np.float32
        same(x.astype(np.float64), independent(data[name]))
        same(src.read(37, 201).astype(np.float64), independent(data[name]).ravel()[37:201])


def test_pt_fp8_tensors_incl_fnuz_and_strided(tmp_path):
    # (torch's legacy non-zip format cannot hold FP8 storages: torch.load itself fails on one)
    obj = {name: every_code(name) for name in FP8}
    obj["t"] = every_code("float8_e5m2", (32, 8)).t()  # not contiguous
    f = tmp_path / "m.pt"
    torch.save(obj, f)
    t = {s.name: s for s in open_dump(f).tensors}
    for name, tensor in obj.items():
        assert t[name].is_float and t[name].shape == tuple(tensor.shape)
        same(t[name].read_all().astype(np.float64), independent(tensor))


def test_fp8_checkpoint_figures(tmp_path):
    """Stored E4M3 values re-cast to E4M3 unscaled lose nothing (exact, no overflow) and their
    counts are the codes' own: NaN codes counted as NaN, subnormal codes as subnormal."""
    f = tmp_path / "ckpt.safetensors"
    w = every_code("float8_e4m3fn")
    st_save_torch({"w": w}, str(f))
    src = open_dump(f).tensors[0]
    st = tensor_stats(src, parse_variants(["e4m3", "e5m2"], ["none"]))
    ref = independent(w)
    fin = np.isfinite(ref)
    assert st.dtype == "float8_e4m3fn"
    assert (st.nan, st.inf, st.zero) == (int(np.isnan(ref).sum()), 0, int((ref == 0).sum()))
    assert st.amax == float(np.abs(ref[fin]).max()) == 448.0
    e4, e5 = st.variants
    assert (e4.overflow, e4.underflow, e4.err2) == (0, 0, 0.0)
    assert e4.subnormal == int(((ref != 0) & (np.abs(ref) < 2.0**-6)).sum()) == 14
    # E5M2 has one mantissa bit less: the E4M3 values it cannot hold carry an error
    assert e5.err2 > 0 and e5.overflow == 0

    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "cli", "analyze", str(f), "--format", "e4m3",
                           "--scaling", "none", "--json", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())["records"][0]
    assert rec["dtype"] == "float8_e4m3fn" and rec["rel_mse"] == 0 and rec["sqnr_db"] is None
