"""analyze with NVFP4 scalings: the streaming figures equal quantize_scaled + dequantize on the
whole tensor (counts exactly, sums to float64 rounding), also across chunks; the CLI spellings."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import fp8sim
from fp8sim.analysis.stats import parse_variants, tensor_stats
from fp8sim.scaling import dequantize, quantize_scaled


def reference(x, spec):
    st = quantize_scaled(x, "e2m1", spec)
    deq = dequantize(st).astype(np.float64)
    x64 = np.asarray(x, np.float64)
    fin = np.isfinite(x64)
    lost = fin & np.isnan(deq)
    ok = fin & ~lost
    dec = np.abs(fp8sim.decode(st.codes, "e2m1", dtype=np.float64))
    return {
        "underflow": int((ok & (x64 != 0) & (deq == 0)).sum()),
        "subnormal": int((ok & (deq != 0) & (dec < 1)).sum()),
        "lost": int(lost.sum()),
        "err2": math.fsum(((deq[ok] - x64[ok]) ** 2).tolist()),
    }


def data(seed, shape=(40, 72)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, (shape[0], 1)))
    x[3, :16] = 0.0
    x[5, 16:32] *= 1e-9  # a block whose TE scale rounds to 0 (all of it underflows)
    return x.astype(np.float32)


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4:16x1", "nvfp4:2d", "nvfp4:torchao",
                                  "nvfp4:2d:torchao-block"])  # fmt: skip
@pytest.mark.parametrize("chunk", [None, 333])
def test_figures_equal_the_emulator(spec, chunk):
    x = data(1)
    x[7, 40] = np.nan  # a lost block
    stats = tensor_stats(x, parse_variants(["e4m3"], [spec]), chunk=chunk)
    (v,) = stats.variants
    assert v.format == "e2m1" and v.scaling == fp8sim.scaling.parse_granularity(spec).spec
    ref = reference(x, spec)
    assert (v.underflow, v.subnormal, v.lost) == (ref["underflow"], ref["subnormal"], ref["lost"])
    assert v.err2 == pytest.approx(ref["err2"], rel=1e-12)


def test_te_zero_scale_block_counts_as_underflow():
    x = data(2)
    (v,) = tensor_stats(x, parse_variants(["e2m1"], ["nvfp4"])).variants
    assert v.underflow >= 16 and v.overflow == 0


def test_parse_rules():
    vs = parse_variants(["e4m3", "e5m2"], ["tensor", "nvfp4", "block:1x128"])
    assert [(v.fmt.name, v.scaling) for v in vs] == [
        ("e4m3", "tensor"), ("e2m1", "nvfp4"), ("e4m3", "block:1x128"),
        ("e5m2", "tensor"), ("e5m2", "block:1x128")]  # fmt: skip
    with pytest.raises(ValueError, match="compressed-tensors"):
        parse_variants(["e4m3"], ["nvfp4:ct"])
    with pytest.raises(ValueError, match="nvfp4"):
        parse_variants(["e4m3"], ["nvfp4"], pow2=True)


def test_cli_analyze_nvfp4(tmp_path, capsys):
    from fp8sim.cli import main

    np.save(tmp_path / "a.npy", data(3))
    out = tmp_path / "r.json"
    rc = main(["analyze", str(tmp_path / "a.npy"), "--scaling", "nvfp4,nvfp4:2d,block:1x128",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    text = out.read_text()
    for spec in ("nvfp4", "nvfp4:2d", "block:1x128"):
        assert f'"scaling": "{spec}"' in text
    assert '"format": "e2m1"' in text
    json.loads(text)
