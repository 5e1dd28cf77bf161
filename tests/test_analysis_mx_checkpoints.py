"""MX checkpoints (``analyze --scales apply``): compressed-tensors' MXFP4A16 / MXFP6A16 / MXFP8A16
presets written by compressed-tensors itself (``ModelCompressor``) and dequantized by its own
decompressors; gpt-oss ``*_blocks`` / ``*_scales`` against transformers'
``convert_moe_packed_tensors``; ModelOpt's MXFP8 export layout (``MXFP8QTensor``: FP8 weight,
uint8 E8M0 ``weight_scale`` per 32) against its dequantize arithmetic in torch. Values are also
checked against an independent decode (ml_dtypes' float4_e2m1fn / float6_e2m3fn / float8_e4m3fn
/ float8_e8m0fnu, packing undone by hand). E8M0 0xFF is NaN (OCP MX spec) where the libraries
give inf: those blocks are the only difference, and the note counts them."""

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

if sys.version_info < (3, 11):  # compressed-tensors needs Python 3.11 (the test extra's marker)
    pytest.skip("compressed-tensors needs Python >= 3.11", allow_module_level=True)

F32 = np.float32
PRESET_FORMAT = {"MXFP4A16": "mxfp4-pack-quantized", "MXFP6A16": "mxfp6-pack-quantized",
                 "MXFP8A16": "mxfp8-quantized"}  # fmt: skip


def weights(m, n, seed=0):
    """Rows spread over 2**-40 .. 2**30: E8M0 scales far apart; a zero block."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, n)).astype(F32) * np.exp2(np.linspace(-40, 30, m)).astype(F32)[:, None]
    w[1, 32:64] = 0
    return w


class Net(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        self.proj.weight.data = torch.from_numpy(w.copy())


def ct_checkpoint(path, w, preset, edit_codes=None):
    """A checkpoint compressed-tensors writes for ``preset`` (its scales from its own
    ``calculate_qparams``, compressed by ``ModelCompressor``), the compressed tensors, and
    compressed-tensors' own dequantization of them (its decompressor for the format).
    ``edit_codes(scale_codes)`` may change E8M0 codes before saving (0xFF, 0)."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = Net(w)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}))
    mod = model.proj
    groups = mod.weight.unflatten(-1, (-1, 32))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), mod.quantization_scheme.weights)
    mod.weight_scale.data = scale
    compressor = ModelCompressor.from_pretrained_model(model)
    assert compressor.quantization_config.format == PRESET_FORMAT[preset]
    compressor.compress_model(model)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if edit_codes is not None:
        edit_codes(sd["proj.weight_scale"])
    save_file(sd, str(path))
    local = {k.split(".", 1)[1]: v for k, v in sd.items()}
    codec = BaseCompressor.get_value_from_registry(PRESET_FORMAT[preset])
    deq = codec.decompress(local, mod.quantization_scheme)["weight"]
    return sd, deq


def e8m0(codes):
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def independent(element_values, scale_codes):
    """float32(value * 2**(e - 127)) per 32 along the last axis, in float64 then rounded once
    (exact: the products fit float32), NaN where the code is 0xFF."""
    s = np.repeat(e8m0(scale_codes), 32, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.asarray(element_values, np.float64) * s).astype(F32)


def unpack_fp4(packed):
    p = np.asarray(packed, np.uint8)
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    return codes.view(ml_dtypes.float4_e2m1fn).astype(F32)


def unpack_fp6(packed):
    p = np.asarray(packed, np.uint8).astype(np.uint32).reshape(*packed.shape[:-1], -1, 3)
    word = p[..., 0] | p[..., 1] << 8 | p[..., 2] << 16
    codes = np.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], axis=-1).astype(np.uint8)
    return codes.reshape(*packed.shape[:-1], -1).view(ml_dtypes.float6_e2m3fn).astype(F32)


def linked(path, mode="apply"):
    dumps = [open_dump(str(path))]
    errors = []
    notes = link_fp8_scales(dumps, mode, None, lambda p, e: errors.append(str(e)))
    return {t.name: t for d in dumps for t in d.tensors}, notes, errors


def bits(a):
    return np.asarray(a, F32).view(np.uint32)


def bf16_bits(a):
    return torch.from_numpy(np.ascontiguousarray(a, F32)).to(torch.bfloat16).view(torch.int16).numpy()


def set_edge_codes(s):
    s[2, 0] = 0xFF  # E8M0 NaN: OCP NaN, compressed-tensors inf
    s[3, 1] = 0  # 2**-127, the smallest E8M0 scale


@pytest.mark.parametrize("preset", ["MXFP4A16", "MXFP6A16", "MXFP8A16"])
def test_compressed_tensors_mx_presets_read_exactly(tmp_path, preset):
    f = tmp_path / "model.safetensors"
    w = weights(12, 96)
    sd, ct = ct_checkpoint(f, w, preset, set_edge_codes)
    packed = preset != "MXFP8A16"
    name = "proj.weight_packed" if packed else "proj.weight"
    t, notes, errors = linked(f)
    assert not errors and "proj.weight_scale" not in t  # taken as the weight's scale
    src = t[name]
    assert src.shape == (12, 96) and src.is_float
    got = src.read_all()
    codes = sd["proj.weight_scale"].numpy()
    if preset == "MXFP4A16":
        elems = unpack_fp4(sd[name].numpy())
    elif preset == "MXFP6A16":
        elems = unpack_fp6(sd[name].numpy())
    else:
        elems = sd[name].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(F32)
    ref = independent(elems, codes)
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got[2, :32]).all()
    ok = ~np.isnan(ref)
    assert np.array_equal(bits(got)[ok], bits(ref)[ok])
    # compressed-tensors' own decompressor (bfloat16): our float32 values rounded to bfloat16,
    # bit for bit, except the 0xFF block, which it decodes as 2**128 = inf
    ct = ct.to(torch.bfloat16).view(torch.int16).numpy()
    mask = np.ones_like(ok)
    mask[2, :32] = False
    assert np.array_equal(bf16_bits(got)[mask], ct[mask])
    assert np.isinf(torch.from_numpy(ct[2, :32].copy()).view(torch.bfloat16).float().numpy()[
        elems[2, :32] != 0]).all()
    rows = [4, 5, 6, 7, 8, 9, 10, 11]  # no edited code: the weight, quantized
    assert (np.linalg.norm(got[rows] - w[rows], axis=1) < 0.2 * np.linalg.norm(w[rows], axis=1)).all()
    (note,) = [n["note"] for n in notes if n["name"] == name]
    assert "; 1 E8M0 NaN " in note and "(code 0xFF: NaN by the OCP MX spec" in note
    assert ("MXFP8: 1x32 E8M0" if not packed else "1x32 block scales") in note
    # a chunked read from an odd offset: the same values
    flat = ref.reshape(-1)
    part = src.read(37, 37 + 300)
    assert np.array_equal(bits(part)[~np.isnan(flat[37:337])], bits(flat[37:337])[~np.isnan(flat[37:337])])


def test_mx_stored_mode_notes_the_packed_weight(tmp_path):
    f = tmp_path / "model.safetensors"
    ct_checkpoint(f, weights(4, 64), "MXFP4A16")
    t, notes, errors = linked(f, "stored")
    assert not errors and t["proj.weight_packed"].dtype == "uint8"
    (note,) = [n["note"] for n in notes if n["name"] == "proj.weight_packed"]
    assert "packed MXFP4 weight (compressed-tensors MXFP4) skipped as uint8" in note


def gpt_oss_tensors(prefix, experts=3, rows=5, groups=4, seed=3):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (experts, rows, groups), dtype=np.uint8)
    scales[0, 0, 0], scales[1, 2, 3], scales[2, 4, 1] = 0xFF, 0, 254  # NaN, 2**-127, 2**127
    return {f"{prefix}_blocks": torch.from_numpy(blocks), f"{prefix}_scales": torch.from_numpy(scales),
            f"{prefix}_bias": torch.zeros(experts, rows)}  # fmt: skip


@pytest.mark.parametrize("spelling", ["_", "."])
def test_gpt_oss_blocks_match_transformers(tmp_path, spelling):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    p = "model.layers.0.mlp.experts.gate_up_proj"
    tensors = gpt_oss_tensors(p)
    if spelling == ".":  # OpenAI's original checkpoint: block.0.mlp.mlp1_weight.blocks
        tensors = {k.replace("_blocks", ".blocks").replace("_scales", ".scales"): v
                   for k, v in tensors.items()}  # fmt: skip
    f = tmp_path / "model.safetensors"
    save_file(tensors, str(f))
    t, notes, errors = linked(f)
    blocks, scales = tensors[f"{p}{spelling}blocks"], tensors[f"{p}{spelling}scales"]
    assert not errors and f"{p}{spelling}scales" not in t
    got = t[f"{p}{spelling}blocks"].read_all()
    assert got.shape == (3, 5, 128)
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        ref = ref.transpose(1, 2).contiguous()  # transformers' forward layout -> stored
        mine = torch.from_numpy(got).to(dtype)
        nan_block = torch.zeros(got.shape, dtype=torch.bool)
        nan_block[0, 0, :32] = True
        assert torch.equal(mine[~nan_block].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           ref[~nan_block].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        # transformers multiplies the 0xFF block by 2**128 (ldexp): 0.5 -> 2**127, larger -> inf
        e2m1 = torch.from_numpy(unpack_fp4(blocks.numpy()[0, 0, 0]).astype(np.float64))
        assert torch.equal(ref[0, 0, :32], (e2m1 * 2.0**128).to(torch.float32).to(dtype))
    assert np.isnan(got[0, 0, :32]).all()
    ref = independent(unpack_fp4(blocks.numpy().reshape(3, 5, 64)), scales.numpy())
    ok = ~np.isnan(ref)
    assert np.array_equal(bits(got)[ok], bits(ref)[ok]) and np.isinf(got[2, 4, 32:64][
        np.abs(unpack_fp4(blocks.numpy()[2, 4, 1])) >= 2]).all()  # 2 * 2**127 overflows float32
    (note,) = [n["note"] for n in notes if n["name"] == f"{p}{spelling}blocks"]
    assert "MXFP4 (gpt-oss MXFP4)" in note and "; 1 E8M0 NaN block scales" in note


def test_modelopt_mxfp8_matches_its_dequantize(tmp_path):
    """ModelOpt's MXFP8 export (``MXFP8QTensor``): weight float8_e4m3fn (..., M, N), weight_scale
    uint8 (..., M, N / 32); dequantize = ``q.float() * exp2(e - 127)`` per 32, in float32."""
    rng = np.random.default_rng(5)
    q = torch.from_numpy(rng.integers(0, 256, (2, 6, 64), dtype=np.uint8)).view(torch.float8_e4m3fn)
    q = torch.where(q.float().isnan(), torch.zeros((), dtype=torch.float8_e4m3fn), q)
    e = torch.from_numpy(rng.integers(0, 255, (2, 6, 2), dtype=np.uint8))
    e[0, 0, 0], e[1, 5, 1] = 0xFF, 0
    p = "model.layers.0.mlp.experts.down_proj"
    f = tmp_path / "model.safetensors"
    save_file({f"{p}.weight": q, f"{p}.weight_scale": e, f"{p}.input_scale": torch.tensor(1.0)}, str(f))
    t, notes, errors = linked(f)
    assert not errors and f"{p}.input_scale" in t
    got = t[f"{p}.weight"].read_all()
    descale = torch.exp2(e.float() - 127)
    ref = (q.float().view(2, 6, 2, 32) * descale.unsqueeze(-1)).view(2, 6, 64).numpy()
    ok = np.ones(got.shape, bool)
    ok[0, 0, :32] = False
    assert np.array_equal(bits(got)[ok], bits(ref)[ok])
    assert np.isnan(got[0, 0, :32]).all() and not np.isfinite(ref[0, 0, :32]).any()
    assert any("MXFP8: 1x32 E8M0 block scales; 1 E8M0 NaN" in n["note"] for n in notes)


def analyze(*args):
    out = subprocess.run([sys.executable, "-m", "cli", "analyze", *map(str, args)],
                         capture_output=True, text=True)  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def test_analyze_mx_stats_are_those_of_the_dequantized_weights(tmp_path):
    f = tmp_path / "model.safetensors"
    sd, _ = ct_checkpoint(f, weights(8, 64), "MXFP4A16")
    ref = independent(unpack_fp4(sd["proj.weight_packed"].numpy()), sd["proj.weight_scale"].numpy())
    rc, out, err = analyze(f, "--format", "e4m3", "--scaling", "tensor,mx", "--scales", "apply",
                           "--json", "-")  # fmt: skip
    assert rc == 0, err
    recs = [r for r in json.loads(out)["records"] if r["name"] == "proj.weight_packed"]
    want = tensor_stats(ref, parse_variants(["e4m3"], ["tensor", "mx"])).records()
    keys = ("format", "scaling", "amax", "overflow", "underflow", "sqnr_db", "numel")
    assert sorted({k: r[k] for k in keys}.items() for r in recs) == \
        sorted({k: r[k] for k in keys}.items() for r in want)  # fmt: skip
    assert all(r["dtype"] == "float4_e2m1fn" for r in recs)


@pytest.mark.parametrize("tensors, message", [
    # MXFP8 with a ragged last block (N = 40): no library writes one, OCP MX has none
    ({"l.weight": torch.zeros(4, 40, dtype=torch.float8_e4m3fn),
      "l.weight_scale": torch.zeros(4, 2, dtype=torch.uint8)}, "40 is not a multiple of 32"),
    ({"l.weight": torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
      "l.weight_scale": torch.zeros(4, 3, dtype=torch.uint8)}, "expected [4, 2] (MXFP8)"),
    # packed width fitting neither MXFP4 (K = 16 G) nor MXFP6 (K = 24 G)
    ({"l.weight_packed": torch.zeros(4, 20, dtype=torch.uint8),
      "l.weight_scale": torch.zeros(4, 1, dtype=torch.uint8)}, "MX blocks are never ragged"),
    ({"l.weight_packed": torch.zeros(4, 16, dtype=torch.uint8),
      "l.weight_scale": torch.zeros(3, 1, dtype=torch.uint8)}, "expected [4, G]"),
    ({"e.gate_up_proj_blocks": torch.zeros(2, 4, 3, 8, dtype=torch.uint8),
      "e.gate_up_proj_scales": torch.zeros(2, 4, 3, dtype=torch.uint8)}, "(..., rows, G, 16)"),
    ({"e.gate_up_proj_blocks": torch.zeros(2, 4, 3, 16, dtype=torch.uint8),
      "e.gate_up_proj_scales": torch.zeros(2, 4, 2, dtype=torch.uint8)}, "(..., rows, G, 16)"),
])  # fmt: skip
def test_ragged_and_hostile_mx_layouts_are_refused(tmp_path, tensors, message):
    f = tmp_path / "model.safetensors"
    save_file(tensors, str(f))
    _, _, errors = linked(f)
    assert len(errors) == 1 and message in errors[0]
    rc, out, err = analyze(f, "--scales", "apply")
    assert rc == 2 and message in err and err.count("\n") == 1 and out == ""
