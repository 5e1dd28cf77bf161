"""Packed NVFP4 checkpoints (``analyze --scales apply``) as compressed-tensors (``nvfp4-pack-quantized``:
``weight_packed`` uint8, ``weight_scale`` float8_e4m3fn, ``weight_global_scale`` float32 (1,)) and
NVIDIA ModelOpt (``weight`` uint8, ``weight_scale`` float8_e4m3fn, ``weight_scale_2`` float32 (),
``input_scale``) write them, built with fp8sim.nvfp4 + pack_e2m1 and saved with safetensors. The
dequantized values are checked bit for bit against an independent decode (numpy + ml_dtypes'
float4_e2m1fn / float8_e4m3fn, nibbles unpacked by hand) and against the libraries' own torch
arithmetic; analyze's per-tensor stats against tensor_stats of those reference values."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fp8sim.analysis.dumps import link_fp8_scales, open_dump
from fp8sim.analysis.stats import parse_variants, tensor_stats
from fp8sim.nvfp4 import pack_e2m1, quantize_nvfp4_2d

F32 = np.float32


def weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(F32)
    w[..., :2, :] *= 40  # outlier rows: block scales spread over many binades
    if shape[-2] > 5:
        w[..., 5, 16:32] = 0  # a zero block
    return w


def nvfp4_parts(w: np.ndarray, variant: str):
    """(packed uint8, E4M3 block-scale codes, per-tensor float32) per leading index of ``w``
    (1x16 blocks along the last axis, ragged last block)."""
    lead = w.shape[:-2]
    flat = w.reshape(-1, *w.shape[-2:])
    parts = [quantize_nvfp4_2d(x, "1x16", variant) for x in flat]
    packed = np.stack([pack_e2m1(p.codes) for p in parts]).reshape(*lead, w.shape[-2], -1)
    scales = np.stack([p.block_codes for p in parts]).reshape(*lead, w.shape[-2], -1)
    return packed, scales, np.array([p.tensor_scale for p in parts], F32)


def compressed_tensors_file(path, w, prefix="model.layers.0.mlp.down_proj"):
    packed, scales, g = nvfp4_parts(w, "compressed-tensors")
    tensors = {
        f"{prefix}.weight_packed": torch.from_numpy(packed),
        f"{prefix}.weight_scale": torch.from_numpy(scales).view(torch.float8_e4m3fn),
        f"{prefix}.weight_global_scale": torch.from_numpy(g[:1].copy()),  # float32 (1,)
        f"{prefix}.input_global_scale": torch.tensor([123.0]),
    }
    save_file(tensors, str(path))
    return tensors


def modelopt_file(path, w, prefix="model.layers.0.mlp.down_proj", per_expert=False):
    packed, scales, p = nvfp4_parts(w, "torchao")  # P = amax / 2688: ModelOpt's weight_scale_2
    s2 = torch.from_numpy(p.copy()) if per_expert else torch.tensor(float(p[0]), dtype=torch.float32)
    tensors = {
        f"{prefix}.weight": torch.from_numpy(packed),
        f"{prefix}.weight_scale": torch.from_numpy(scales).view(torch.float8_e4m3fn),
        f"{prefix}.weight_scale_2": s2,  # float32, 0-dim (per expert: (E,))
        f"{prefix}.input_scale": torch.tensor(0.01, dtype=torch.float32),
    }
    save_file(tensors, str(path))
    return tensors


def reference(packed, scale, tensor_scale, library: str, n: int) -> np.ndarray:
    """Independent decode: nibbles unpacked by hand (element 2k low, 2k+1 high), E2M1 and E4M3
    through ml_dtypes, the block factor float32(b / G) or float32(b * s2), one float32 product."""
    packed = np.asarray(packed, np.uint8)
    codes = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(F32)[..., :n]
    b = np.asarray(scale, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
    t = np.asarray(tensor_scale, F32).reshape(-1, *([1] * (b.ndim - 1)))
    if t.size > 1:
        t = t.reshape(-1, 1, 1)
    factor = (b / t if library == "compressed-tensors" else b * t).astype(F32)
    full = np.repeat(factor, 16, axis=-1)[..., :n]
    return (e2m1 * full).astype(F32)


def torch_dequant(tensors, prefix, library):
    """The libraries' own arithmetic in torch: compressed-tensors' ``_dequantize``
    (``x_q.to(float32) * (scale.to(float32) / global_scale)``) and ModelOpt's
    (``e2m1_values[code] * (scale.to(float32) * weight_scale_2)``), before their cast to the
    model dtype."""
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    ct = library == "compressed-tensors"
    packed = tensors[f"{prefix}.weight_packed" if ct else f"{prefix}.weight"]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    x_q = e2m1[codes.long()]
    s = tensors[f"{prefix}.weight_scale"].to(torch.float32)
    if ct:
        blk = s / tensors[f"{prefix}.weight_global_scale"]
    else:
        s2 = tensors[f"{prefix}.weight_scale_2"]
        blk = s * (s2.view(-1, 1, 1) if s2.dim() else s2)
    n = x_q.shape[-1]
    return (x_q * blk.repeat_interleave(16, dim=-1)[..., :n]).numpy()


def linked(path, mode="apply"):
    dumps = [open_dump(str(path))]
    errors = []
    notes = link_fp8_scales(dumps, mode, None, lambda p, e: errors.append(str(e)))
    return {t.name: t for d in dumps for t in d.tensors}, notes, errors


def bits(a):
    return np.asarray(a, F32).view(np.uint32)


@pytest.mark.parametrize("shape", [(37, 40), (16, 64), (3, 2)])  # ragged blocks; one short block
def test_compressed_tensors_values_bit_exact(tmp_path, shape):
    p = "model.layers.0.mlp.down_proj"
    f = tmp_path / "model.safetensors"
    w = weights(shape)
    tensors = compressed_tensors_file(f, w, p)
    t, notes, errors = linked(f)
    assert not errors
    assert f"{p}.weight_scale" not in t and f"{p}.weight_global_scale" not in t  # consumed
    assert f"{p}.input_global_scale" in t  # an activation's scale: an ordinary tensor
    src = t[f"{p}.weight_packed"]
    assert src.shape == shape and src.dtype == "float4_e2m1fn" and src.is_float
    got = src.read_all()
    ref = reference(tensors[f"{p}.weight_packed"].numpy(),
                    tensors[f"{p}.weight_scale"].view(torch.uint8).numpy(),
                    tensors[f"{p}.weight_global_scale"].numpy(), "compressed-tensors", shape[-1])
    assert np.array_equal(bits(got), bits(ref))
    assert np.array_equal(bits(got), bits(torch_dequant(tensors, p, "compressed-tensors")))
    # ...and it is the weight NVFP4 rounded, not something else
    assert np.abs(got - w).max() <= np.abs(w).max() / 6 * 2  # within one E2M1 step of 2 at the block's max
    assert any("compressed-tensors" in n["note"] and "weight_global_scale" in n["note"] for n in notes)
    # a chunked read (odd start: a high nibble first) is the same values
    assert np.array_equal(bits(src.read(3, 3 + min(src.numel - 3, 45))), bits(ref.reshape(-1)[3:48]))


def test_modelopt_values_bit_exact_and_stacked_experts(tmp_path):
    p = "model.layers.0.mlp.experts.gate_up_proj"
    f = tmp_path / "model.safetensors"
    w = weights((3, 20, 48), seed=1)
    w[1] *= 50  # one expert far larger: its own weight_scale_2
    tensors = modelopt_file(f, w, p, per_expert=True)
    t, notes, errors = linked(f)
    assert not errors and f"{p}.input_scale" in t and f"{p}.weight_scale_2" not in t
    got = t[f"{p}.weight"].read_all()
    assert got.shape == (3, 20, 48)
    ref = reference(tensors[f"{p}.weight"].numpy(),
                    tensors[f"{p}.weight_scale"].view(torch.uint8).numpy(),
                    tensors[f"{p}.weight_scale_2"].numpy(), "modelopt", 48)
    assert np.array_equal(bits(got), bits(ref))
    assert np.array_equal(bits(got), bits(torch_dequant(tensors, p, "modelopt")))
    f2 = tmp_path / "plain.safetensors"
    w2 = weights((33, 80), seed=2)
    tensors = modelopt_file(f2, w2, "lm.proj")
    got = linked(f2)[0]["lm.proj.weight"].read_all()
    assert np.array_equal(bits(got), bits(torch_dequant(tensors, "lm.proj", "modelopt")))


def test_nan_block_scale_makes_its_block_nan(tmp_path):
    f = tmp_path / "m.safetensors"
    w = weights((4, 32))
    tensors = compressed_tensors_file(f, w, "l")
    sc = tensors["l.weight_scale"].view(torch.uint8).clone()
    sc[2, 1] = 0x7F  # E4M3 NaN
    tensors["l.weight_scale"] = sc.view(torch.float8_e4m3fn)
    save_file(tensors, str(f))
    t, notes, _ = linked(f)
    got = t["l.weight_packed"].read_all()
    assert np.isnan(got[2, 16:32]).all()
    assert not np.isnan(np.delete(got.reshape(-1), np.arange(80, 96))).any()
    assert any("1 NaN/inf" in n["note"] for n in notes)


def analyze(*args):
    out = subprocess.run([sys.executable, "-m", "cli", "analyze", *map(str, args)],
                         capture_output=True, text=True)  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def test_analyze_stats_are_those_of_the_dequantized_weights(tmp_path):
    f = tmp_path / "model.safetensors"
    w = weights((37, 40))
    tensors = compressed_tensors_file(f, w, "l")
    ref = torch_dequant(tensors, "l", "compressed-tensors")
    rc, out, err = analyze(f, "--format", "e4m3,e5m2", "--scaling", "tensor,block:1x32,nvfp4",
                           "--scales", "apply", "--json", "-")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    recs = [r for r in doc["records"] if r["name"] == "l.weight_packed"]
    variants = parse_variants(["e4m3", "e5m2"], ["tensor", "block:1x32", "nvfp4"])
    want = tensor_stats(ref, variants, name="l.weight_packed").records()
    assert len(recs) == len(want) == 5  # e4m3 x 2, e5m2 x 2, nvfp4 once (always e2m1)
    keys = ("format", "scaling", "amax", "scale", "overflow", "underflow", "subnormal", "zero",
            "sqnr_db", "rel_mse", "numel", "shape")  # fmt: skip
    by = {(r["format"], r["scaling"]): r for r in recs}
    for r in want:
        assert {k: by[(r["format"], r["scaling"])][k] for k in keys} == {k: r[k] for k in keys}
    assert all(r["dtype"] == "float4_e2m1fn" for r in recs)
    assert all("weight_global_scale" in r["dequantized_with"] for r in recs)
    names = {r["name"] for r in doc["records"]}
    assert "l.weight_scale" not in names and "l.weight_global_scale" not in names
    # the old option name is the same option
    rc2, out2, _ = analyze(f, "--format", "e4m3,e5m2", "--scaling", "tensor,block:1x32,nvfp4",
                           "--fp8-scales", "apply", "--json", "-")  # fmt: skip
    assert rc2 == 0 and json.loads(out2)["records"] == doc["records"]


def test_stored_mode_notes_and_skips_the_packed_weight(tmp_path):
    f = tmp_path / "model.safetensors"
    modelopt_file(f, weights((8, 32)), "l")
    t, notes, errors = linked(f, "stored")
    assert not errors and t["l.weight"].dtype == "uint8" and not t["l.weight"].is_float
    assert "l.weight_scale" in t and "l.weight_scale_2" in t  # nothing taken
    (note,) = [n["note"] for n in notes if n["name"] == "l.weight"]
    assert "packed NVFP4 weight (modelopt) skipped" in note and "--scales apply" in note
    rc, out, err = analyze(f, "--json", "-")
    assert rc == 0 and "l.weight" not in {r["name"] for r in json.loads(out)["records"]}


def test_sharded_modelopt_checkpoint_finds_scales_by_index(tmp_path):
    w = weights((16, 32))
    tensors = modelopt_file(tmp_path / "tmp.safetensors", w, "l")
    (tmp_path / "tmp.safetensors").unlink()
    a, b = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"l.weight": tensors["l.weight"]}, str(tmp_path / a))
    save_file({k: v for k, v in tensors.items() if k != "l.weight"}, str(tmp_path / b))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"l.weight": a, "l.weight_scale": b, "l.weight_scale_2": b, "l.input_scale": b}}))
    t, notes, errors = linked(tmp_path / a)
    assert not errors
    want = torch_dequant(tensors, "l", "modelopt")
    assert np.array_equal(bits(t["l.weight"].read_all()), bits(want))
    assert any(f"(in {tmp_path / b})" in n["note"] for n in notes)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("l.weight_global_scale"), "no l.weight_global_scale"),
    (lambda d: d.update({"l.weight_global_scale": d["l.weight_global_scale"].half()}), "dtype float16"),
    (lambda d: d.update({"l.weight_global_scale": torch.ones(2)}), "expected one element"),
    (lambda d: d.update({"l.weight_scale": d["l.weight_scale"][:, :1].contiguous()}), "expected [8, 2]"),
])  # fmt: skip
def test_malformed_nvfp4_companions_are_refused(tmp_path, change, message):
    f = tmp_path / "model.safetensors"
    tensors = compressed_tensors_file(f, weights((8, 32)), "l")
    tensors.pop("l.input_global_scale")
    change(tensors)
    save_file(tensors, str(f))
    _, _, errors = linked(f)
    assert len(errors) == 1 and message in errors[0] and "l.weight_packed" in errors[0]
    rc, out, err = analyze(f, "--scales", "apply")
    assert rc == 2 and message in err and err.count("\n") == 1 and out == ""


def test_uint8_with_a_scale_neither_e4m3_nor_e8m0_is_not_read(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"l.weight_packed": torch.zeros(4, 16, dtype=torch.uint8),
               "l.weight_scale": torch.ones(4, 1, dtype=torch.float16),  # an INT4 checkpoint's scales
               "mask.weight": torch.ones(3, dtype=torch.uint8)}, str(f))  # fmt: skip
    t, notes, errors = linked(f)
    assert not errors and t["l.weight_packed"].dtype == "uint8" and "l.weight_scale" in t
    (note,) = [n["note"] for n in notes if n["name"] == "l.weight_packed"]
    assert "has dtype float16, not float8_e4m3fn (NVFP4) nor E8M0 (MX)" in note
    assert not [n for n in notes if n["name"] == "mask.weight"]  # no companion: an ordinary uint8


def test_empty_packed_weight_is_an_empty_tensor_not_a_bad_file(tmp_path):
    """A packed NVFP4 weight (4, 0) with its (4, 0) block scale is an empty tensor: noted as
    such, the file's other tensors analyzed, with or without --keep-going (it once refused the
    whole file)."""
    f = tmp_path / "model.safetensors"
    save_file({"l.weight_packed": torch.zeros(4, 0, dtype=torch.uint8),
               "l.weight_scale": torch.zeros(4, 0, dtype=torch.float8_e4m3fn),
               "l.weight_global_scale": torch.ones(1),
               "other": torch.linspace(-1, 1, 64)}, str(f))  # fmt: skip
    t, notes, errors = linked(f)
    assert not errors and t["l.weight_packed"].shape == (4, 0) and t["l.weight_packed"].numel == 0
    for extra in ([], ["--keep-going"]):
        rc, out, err = analyze(f, "--scales", "apply", "--format", "e4m3", "--json", "-", *extra)
        doc = json.loads(out)
        assert rc == 0 and not doc["errors"], err
        assert [r["name"] for r in doc["records"]] == ["other"]
        assert {"file": str(f), "name": "l.weight_packed", "note": "empty tensor, shape [4, 0]"} \
            in doc["notes"]  # fmt: skip
