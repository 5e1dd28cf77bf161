"""FP8 checkpoints with companion scales (``analyze --fp8-scales apply``): the dequantized values
are checked against torch's own dequantization of the same checkpoint (``q.float() * scale``
expanded over its groups), for DeepSeek-style 128 x 128 block scales, per-row and per-tensor
scales, stacked experts, sharded checkpoints, config.json block sizes and the refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fp8sim.analysis.dumps import open_dump
from fp8sim.analysis.dumps import ScaledSource, link_fp8_scales, parse_block
from fp8sim.analysis.stats import parse_variants, tensor_stats


def quantize_blocks(w: torch.Tensor, r: int, c: int, dtype=torch.float8_e4m3fn):
    """Block-quantize the last two dims of ``w`` (ragged last blocks): (codes, scale_inv) with
    scale_inv = block amax / 448, as DeepSeek-V3's checkpoints hold them."""
    *lead, m, n = w.shape
    gr, gc = -(-m // r), -(-n // c)
    s = torch.zeros(*lead, gr, gc)
    q = torch.empty(w.shape, dtype=dtype)
    for i in range(gr):
        for j in range(gc):
            blk = w[..., i * r : (i + 1) * r, j * c : (j + 1) * c]
            si = blk.abs().amax(dim=(-2, -1)).clamp_min(1e-12) / 448.0
            s[..., i, j] = si
            q[..., i * r : (i + 1) * r, j * c : (j + 1) * c] = (blk / si[..., None, None]).to(dtype)
    return q, s


def torch_dequant_blocks(q, s, r, c):
    """torch's dequantization: every code's float32 value times its block's scale (float32)."""
    m, n = q.shape[-2:]
    full = s.float().repeat_interleave(r, dim=-2)[..., :m, :].repeat_interleave(c, dim=-1)[..., :n]
    return (q.float() * full).numpy()


def weights(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    w[..., :3, :] *= 300  # outlier rows: the block scales differ a lot
    return w


def analyze(*args):
    out = subprocess.run([sys.executable, "-m", "cli", "analyze", *map(str, args)],
                         capture_output=True, text=True)  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def scaled(path, name, mode="apply", block=None):
    dumps = [open_dump(path)]
    errors = []
    notes = link_fp8_scales(dumps, mode, block, lambda p, e: errors.append(str(e)))
    return {t.name: t for d in dumps for t in d.tensors}, notes, errors


def same_stats(x_ours, x_ref, variants):
    a, b = tensor_stats(x_ours, variants), tensor_stats(x_ref, variants)
    assert a.amax == b.amax and a.log2_counts.tolist() == b.log2_counts.tolist()
    for va, vb in zip(a.variants, b.variants):
        assert (va.overflow, va.underflow, va.subnormal, va.err2) == (vb.overflow, vb.underflow,
                                                                      vb.subnormal, vb.err2)


def test_deepseek_block_scales_ragged(tmp_path):
    w = weights((300, 200))
    q, s = quantize_blocks(w, 128, 128)
    f = tmp_path / "model.safetensors"
    save_file({"l.weight": q, "l.weight_scale_inv": s, "l.bias": torch.ones(300)}, str(f))
    t, notes, errors = scaled(f, "l.weight")
    assert not errors and "l.weight_scale_inv" not in t  # consumed, not analyzed on its own
    src = t["l.weight"]
    assert isinstance(src, ScaledSource) and src.kind == "block" and src.block == (128, 128)
    ref = torch_dequant_blocks(q, s, 128, 128)
    np.testing.assert_array_equal(src.read_all(), ref)
    np.testing.assert_array_equal(src.read(12_345, 40_001), ref.ravel()[12_345:40_001])
    assert "l.weight_scale_inv: 128x128 block scales (default)" in notes[0]["note"]
    v = parse_variants(["e4m3", "e5m2"], ["tensor", "block:1x128"])
    same_stats(src, ref, v)
    # chunk boundaries anywhere (a chunk ends inside a row and inside a block)
    a = tensor_stats(src, v, chunk=997)
    b = tensor_stats(ref, v)
    assert [x.underflow for x in a.variants] == [x.underflow for x in b.variants]


def test_cli_apply_vs_stored(tmp_path):
    w = weights((256, 384), seed=1)
    q, s = quantize_blocks(w, 128, 128)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "m.safetensors"))
    rc, out, err = analyze(tmp_path, "--format", "e4m3", "--json", "-")
    recs = json.loads(out)["records"]
    assert rc == 0 and {r["name"] for r in recs} == {"w", "w_scale_inv"}
    w_rec = next(r for r in recs if r["name"] == "w")
    assert w_rec["amax"] <= 448 and w_rec["dequantized_with"] is None
    assert "w_scale_inv was not applied" in err
    rc, out, err = analyze(tmp_path, "--format", "e4m3", "--fp8-scales", "apply", "--json", "-")
    recs = json.loads(out)["records"]
    assert rc == 0 and [r["name"] for r in recs] == ["w"]
    ref = torch_dequant_blocks(q, s, 128, 128)
    assert recs[0]["amax"] == float(np.abs(ref).max())
    assert recs[0]["dequantized_with"].startswith("w_scale_inv: 128x128 block scales")
    assert recs[0]["dtype"] == "float8_e4m3fn"


def test_row_and_tensor_scales_bf16_scale(tmp_path):
    w = weights((64, 96), seed=2)
    rows = (w.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.bfloat16)  # compressed-tensors
    q_row = (w / rows.float()).to(torch.float8_e4m3fn)
    one = (w.abs().max() / 57344.0).reshape(1)
    q_one = (w / one).to(torch.float8_e5m2)
    save_file({"a.weight": q_row, "a.weight_scale": rows, "b.weight": q_one, "b.weight_scale": one,
               "c.weight": q_row.clone(), "c.weight_scale": rows.reshape(64).clone()}, str(tmp_path / "m.safetensors"))  # fmt: skip
    t, notes, errors = scaled(tmp_path / "m.safetensors", None)
    assert not errors and sorted(t) == ["a.weight", "b.weight", "c.weight"]
    ref_row = (q_row.float() * rows.float()).numpy()
    assert t["a.weight"].kind == "row" and t["c.weight"].kind == "row"
    np.testing.assert_array_equal(t["a.weight"].read_all(), ref_row)
    np.testing.assert_array_equal(t["c.weight"].read(100, 3000), ref_row.ravel()[100:3000])
    assert t["b.weight"].kind == "tensor"
    np.testing.assert_array_equal(t["b.weight"].read_all(), (q_one.float() * one).numpy())


def test_stacked_experts(tmp_path):
    w = weights((3, 100, 70), seed=3)
    q, s = quantize_blocks(w, 32, 32)
    save_file({"experts.w": q, "experts.w_scale_inv": s}, str(tmp_path / "m.safetensors"))
    t, _, errors = scaled(tmp_path / "m.safetensors", None, block=(32, 32))
    assert not errors
    np.testing.assert_array_equal(t["experts.w"].read_all(), torch_dequant_blocks(q, s, 32, 32))


def test_block_from_config_json_and_override(tmp_path):
    w = weights((128, 128), seed=4)
    q, s = quantize_blocks(w, 64, 32)  # scale grid (2, 4)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "m.safetensors"))
    rc, _, err = analyze(tmp_path, "--fp8-scales", "apply")  # 128x128 would need a (1, 1) grid
    assert rc == 2 and "w_scale_inv shape [2, 4] does not fit w shape [128, 128]" in err
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}))  # fmt: skip
    t, notes, errors = scaled(tmp_path / "m.safetensors", None)
    assert not errors and "64x32 block scales (config.json)" in notes[0]["note"]
    np.testing.assert_array_equal(t["w"].read_all(), torch_dequant_blocks(q, s, 64, 32))
    # --fp8-block wins over config.json: 32x128 does not fit the (2, 4) grid
    rc, _, err = analyze(tmp_path, "--fp8-scales", "apply", "--fp8-block", "32x128")
    assert rc == 2 and "32x128 blocks [4, 1] (--fp8-block)" in err
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"weight_block_size": [64, "32"]}}))  # fmt: skip
    rc, _, err = analyze(tmp_path, "--fp8-scales", "apply")
    assert rc == 2 and "weight_block_size" in err and "not two positive ints" in err


def test_sharded_checkpoint(tmp_path):
    w = weights((130, 260), seed=5)
    q, s = quantize_blocks(w, 128, 128)
    save_file({"w": q}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"w_scale_inv": s, "other": torch.ones(4)},
              str(tmp_path / "model-00002-of-00002.safetensors"))  # fmt: skip
    rc, out, err = analyze(tmp_path, "--fp8-scales", "apply", "--format", "e4m3", "--json", "-")
    recs = json.loads(out)["records"]
    assert rc == 0 and sorted(r["name"] for r in recs) == ["other", "w"]
    w_rec = next(r for r in recs if r["name"] == "w")
    assert w_rec["amax"] == float(np.abs(torch_dequant_blocks(q, s, 128, 128)).max())


def test_refusals_name_the_tensors(tmp_path):
    q, s = quantize_blocks(weights((64, 64), seed=6), 64, 64)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"w": q, "w_scale_inv": torch.ones(3)}, str(bad / "m.safetensors"))
    rc, _, err = analyze(bad, "--fp8-scales", "apply")
    assert rc == 2 and "w_scale_inv shape [3] does not fit w shape [64, 64]" in err
    amb = tmp_path / "amb"
    amb.mkdir()
    save_file({"w": q, "w_scale_inv": s, "w_scale": s.clone()}, str(amb / "m.safetensors"))
    rc, _, err = analyze(amb, "--fp8-scales", "apply")
    assert rc == 2 and "both w_scale_inv and w_scale" in err
    ints = tmp_path / "ints"
    ints.mkdir()
    save_file({"w": q, "w_scale_inv": torch.ones(1, 1, dtype=torch.int32)}, str(ints / "m.safetensors"))
    rc, _, err = analyze(ints, "--fp8-scales", "apply")
    assert rc == 2 and "has dtype int32; a scale must be" in err
    # --keep-going: the good file is still analyzed, the bad one listed
    good = tmp_path / "good.safetensors"
    save_file({"v": q, "v_scale_inv": s}, str(good))
    rc, out, err = analyze(bad, good, "--fp8-scales", "apply", "--keep-going", "--json", "-")
    assert rc == 2 and [r["name"] for r in json.loads(out)["records"]] == ["v"] * 2
    assert "does not fit" in err
    one_d = tmp_path / "oned"
    one_d.mkdir()
    save_file({"b": q[0].clone(), "b_scale": torch.ones(3)}, str(one_d / "m.safetensors"))
    rc, _, err = analyze(one_d, "--fp8-scales", "apply")
    assert rc == 2 and "b_scale shape [3] does not fit b shape [64]: a 1-D weight takes one" in err
    rc, _, err = analyze(good, "--fp8-block", "0x128")
    assert rc == 2 and "--fp8-block '0x128'" in err


def test_pt_checkpoint_and_no_companion_note(tmp_path):
    q, s = quantize_blocks(weights((128, 256), seed=7), 128, 128)
    torch.save({"layer": {"w": q, "w_scale_inv": s}, "lone": q.clone()}, tmp_path / "m.pt")
    t, notes, errors = scaled(tmp_path / "m.pt", None)
    assert not errors
    np.testing.assert_array_equal(t["layer.w"].read_all(), torch_dequant_blocks(q, s, 128, 128))
    assert any(n["name"] == "lone" and "no companion" in n["note"] for n in notes)


def test_parse_block():
    assert parse_block("128x128") == (128, 128) and parse_block("1X32") == (1, 32)
    for bad in ("128", "x", "0x1", "1x-2", "axb", "1x2x3", f"{2**62 + 1}x1"):
        with pytest.raises(ValueError, match="--fp8-block"):
            parse_block(bad)


def test_stored_mode_never_refuses(tmp_path):
    q, s = quantize_blocks(weights((64, 64), seed=8), 64, 64)
    save_file({"w": q, "w_scale_inv": s, "w_scale": s.clone()}, str(tmp_path / "m.safetensors"))
    rc, _, err = analyze(tmp_path)  # --fp8-scales stored: ambiguity is a note, not an error
    assert rc == 0 and "FP8 codes analyzed as stored; it has both w_scale_inv and w_scale" in err


def test_unrelated_files_are_not_paired_but_shards_are(tmp_path):
    q, s = quantize_blocks(weights((128, 128), seed=9), 128, 128)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "a.safetensors"))
    save_file({"w": q.clone()}, str(tmp_path / "b.safetensors"))  # another checkpoint's w
    t, notes, errors = scaled(tmp_path / "b.safetensors", None)
    assert not errors and not isinstance(t["w"], ScaledSource)
    assert "no companion" in notes[0]["note"]
    # a shard set with an index naming the companion's shard: found though only shard 1 is given
    sh = tmp_path / "sharded"
    sh.mkdir()
    save_file({"w": q}, str(sh / "model-00001-of-00003.safetensors"))
    save_file({"x": torch.ones(2)}, str(sh / "model-00002-of-00003.safetensors"))
    save_file({"w_scale_inv": s}, str(sh / "model-00003-of-00003.safetensors"))
    (sh / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00003.safetensors", "x": "model-00002-of-00003.safetensors",
        "w_scale_inv": "model-00003-of-00003.safetensors"}}))  # fmt: skip
    t, notes, errors = scaled(sh / "model-00001-of-00003.safetensors", None)
    assert not errors and "(in " in notes[0]["note"] and "model-00003-of-00003" in notes[0]["note"]
    np.testing.assert_array_equal(t["w"].read_all(), torch_dequant_blocks(q, s, 128, 128))
    # an index that points outside the directory is not followed: the weight's file is refused
    (sh / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w_scale_inv": "../a.safetensors"}}))  # fmt: skip
    t, notes, errors = scaled(sh / "model-00001-of-00003.safetensors", None)
    assert not t and "'../a.safetensors' by" in errors[0] and "not a file of that directory" in errors[0]


def test_compressed_tensors_block_and_group_configs(tmp_path):
    w = weights((200, 200), seed=10)
    q, s = quantize_blocks(w, 100, 100)  # grid (2, 2): the 128x128 default would fit too
    save_file({"l.weight": q, "l.weight_scale": s}, str(tmp_path / "m.safetensors"))
    cfg = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"strategy": "block", "block_structure": [100, 100]}}}}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t, notes, errors = scaled(tmp_path / "m.safetensors", None)
    assert not errors and "100x100 block scales (config.json)" in notes[0]["note"]
    np.testing.assert_array_equal(t["l.weight"].read_all(), torch_dequant_blocks(q, s, 100, 100))
    qg, sg = quantize_blocks(w, 1, 40)  # group_size 40: scales (200, 5)
    save_file({"l.weight": qg, "l.weight_scale": sg}, str(tmp_path / "m.safetensors"))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"] = {"strategy": "group",
                                                                         "group_size": 40}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t, _, errors = scaled(tmp_path / "m.safetensors", None)
    assert not errors
    np.testing.assert_array_equal(t["l.weight"].read_all(), torch_dequant_blocks(qg, sg, 1, 40))
    cfg["quantization_config"]["weight_block_size"] = [128, 128]  # two shapes: the one that fits
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t, notes, errors = scaled(tmp_path / "m.safetensors", None)
    assert not errors and "1x40 block scales (config.json)" in notes[0]["note"]
    save_file({"l.weight": q, "l.weight_scale": s}, str(tmp_path / "m.safetensors"))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"] = {
        "strategy": "block", "block_structure": [100, 100]}  # and 128x128: both give a (2, 2) grid
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, _, errors = scaled(tmp_path / "m.safetensors", None)
    assert errors and "it fits several block shapes (100x100 blocks [2, 2], 128x128" in errors[0]


def test_e8m0_float64_and_bad_scale_values(tmp_path):
    q, _ = quantize_blocks(weights((128, 256), seed=11), 128, 128)
    e8 = torch.tensor([[120, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2**-7, 2**3
    s64 = torch.tensor([[0.1, 3.0]], dtype=torch.float64)
    bad = torch.tensor([[float("nan"), -1.0]])
    save_file({"a": q, "a_scale_inv": e8, "b": q.clone(), "b_scale_inv": s64, "c": q.clone(),
               "c_scale_inv": bad}, str(tmp_path / "m.safetensors"))  # fmt: skip
    torch.save({"a": q, "a_scale_inv": e8}, tmp_path / "m.pt")
    for f in ("m.safetensors", "m.pt"):
        t, notes, errors = scaled(tmp_path / f, None)
        assert not errors
        np.testing.assert_array_equal(t["a"].read_all(),
                                      torch_dequant_blocks(q, e8.float(), 128, 128))  # fmt: skip
    b = scaled(tmp_path / "m.safetensors", None)[0]["b"].read_all()
    assert b.dtype == np.float64  # as torch computes q.float() * s64
    ref = (q.double() * s64.repeat_interleave(128, 0).repeat_interleave(128, 1)).numpy()
    np.testing.assert_array_equal(b, ref)
    _, notes, _ = scaled(tmp_path / "m.safetensors", None)
    c_note = next(n["note"] for n in notes if n["name"] == "c")
    assert "it holds 1 NaN/inf and 1 zero or negative scales" in c_note
    # E8M0 tensors are not analyzed on their own: listed as skipped
    save_file({"z": e8}, str(tmp_path / "z.safetensors"))
    rc, _, err = analyze(tmp_path / "z.safetensors")  # nothing left to analyze: a gate must not pass
    assert rc == 2 and "no data analyzed" in err and "z: skipped: float8_e8m0fnu tensor" in err
    rc, _, err = analyze(tmp_path / "z.safetensors", "--allow-empty")
    assert rc == 0 and "z: skipped: float8_e8m0fnu tensor" in err


def test_keep_going_leaves_companions_of_bad_files(tmp_path):
    q, s = quantize_blocks(weights((128, 128), seed=12), 128, 128)
    save_file({"v": q, "w": q.clone(), "w_scale_inv": torch.ones(3)},
              str(tmp_path / "m-00001-of-00002.safetensors"))  # fmt: skip
    save_file({"v_scale_inv": s}, str(tmp_path / "m-00002-of-00002.safetensors"))
    rc, out, err = analyze(tmp_path, "--fp8-scales", "apply", "--keep-going", "--format", "e4m3",
                           "--json", "-")  # fmt: skip
    doc = json.loads(out)
    assert rc == 2 and [r["name"] for r in doc["records"]] == ["v_scale_inv"]
    assert not any("dequantized" in n["note"] for n in doc["notes"])
    rc, _, err = analyze(tmp_path / "m-00001-of-00002.safetensors", "--fp8-scales", "apply")
    assert rc == 2 and "a 1-D" not in err and "w_scale_inv shape [3] does not fit" in err


def test_hugging_face_cache_symlinks_and_bad_indexes(tmp_path):
    q, s = quantize_blocks(weights((256, 128), seed=13), 128, 128)  # a (2, 1) grid
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    save_file({"w": q}, str(blobs / "aaa"))
    save_file({"w_scale_inv": s}, str(blobs / "bbb"))
    (blobs / "ccc").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00002.safetensors", "w_scale_inv": "model-00002-of-00002.safetensors"}}))  # fmt: skip
    for name, blob in (("model-00001-of-00002.safetensors", "aaa"),
                       ("model-00002-of-00002.safetensors", "bbb"), ("model.safetensors.index.json", "ccc")):  # fmt: skip
        (snap / name).symlink_to(blobs / blob)
    rc, out, err = analyze(snap, "--fp8-scales", "apply", "--format", "e4m3", "--json", "-")
    assert rc == 0 and [r["name"] for r in json.loads(out)["records"]] == ["w"]
    assert "dequantized with w_scale_inv (in " in err
    # an index nested too deeply for the parser is malformed: the shard set is searched instead
    (snap / "model.safetensors.index.json").unlink()
    (snap / "model.safetensors.index.json").write_text("[" * 100_000)
    rc, _, err = analyze(snap / "model-00001-of-00002.safetensors", "--fp8-scales", "apply")
    assert rc == 0 and "dequantized with w_scale_inv (in " in err
    (snap / "config.json").write_text("{" * 100_000)  # unreadable config: the default block
    rc, _, err = analyze(snap, "--fp8-scales", "apply")
    assert rc == 0 and "128x128 block scales (default; config.json not JSON" in err
    # an index naming a shard that is not there: refused in apply mode, a note when stored
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w_scale_inv": "model-00009-of-00002.safetensors"}}))  # fmt: skip
    rc, _, err = analyze(snap / "model-00001-of-00002.safetensors", "--fp8-scales", "apply")
    assert rc == 2 and "w has its companion in 'model-00009-of-00002.safetensors' by" in err
    rc, _, err = analyze(snap / "model-00001-of-00002.safetensors")
    assert rc == 0 and "FP8 codes analyzed as stored; it has its companion in" in err


def test_several_declared_shapes_string_blocks_and_fp8_companions(tmp_path):
    w = weights((256, 256), seed=14)
    qb, sb = quantize_blocks(w, 128, 128)
    qg, sg = quantize_blocks(w, 1, 128)
    s8 = (sg * 64).to(torch.float8_e4m3fn)  # an FP8 companion (decoded exactly)
    save_file({"q.weight": qb, "q.weight_scale": sb, "lm_head.weight": qg, "lm_head.weight_scale": sg,
               "o.weight": qg.clone(), "o.weight_scale": s8}, str(tmp_path / "model.safetensors"))  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": {
        "g0": {"weights": {"strategy": "block", "block_structure": "128x128"}},
        "g1": {"weights": {"strategy": "group", "group_size": 128}}}}}))  # fmt: skip
    t, notes, errors = scaled(tmp_path / "model.safetensors", None)
    assert not errors
    np.testing.assert_array_equal(t["q.weight"].read_all(), torch_dequant_blocks(qb, sb, 128, 128))
    np.testing.assert_array_equal(t["lm_head.weight"].read_all(), torch_dequant_blocks(qg, sg, 1, 128))
    np.testing.assert_array_equal(t["o.weight"].read_all(), torch_dequant_blocks(qg, s8, 1, 128))
    assert sorted(t) == ["lm_head.weight", "o.weight", "q.weight"]
    assert not any(n["name"] == "o.weight_scale" for n in notes)  # taken: no note of its own


def test_zero_dim_float64_scale_and_long_rows(tmp_path):
    import tracemalloc

    q, _ = quantize_blocks(weights((8, 64), seed=15), 8, 64)
    s0 = torch.tensor(0.1, dtype=torch.float64)
    row = (torch.randn(1, 1 << 22) * 100).to(torch.float8_e4m3fn)
    srow = torch.rand(1, 1 << 22) + 0.5  # 1x1 blocks: one scale per element
    save_file({"w": q, "w_scale": s0, "r": row, "r_scale_inv": srow}, str(tmp_path / "m.safetensors"))
    t, _, errors = scaled(tmp_path / "m.safetensors", None, block=(1, 1))
    assert not errors
    w = t["w"].read_all()
    ref = (q.float() * s0).numpy()  # torch keeps float32 for a 0-dim scale
    assert w.dtype == ref.dtype == np.float32
    np.testing.assert_array_equal(w, ref)
    tracemalloc.start()
    part = t["r"].read(3_000_000, 3_001_000)  # 1000 elements inside one 4M-element row
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    np.testing.assert_array_equal(part, (row.float() * srow).numpy().ravel()[3_000_000:3_001_000])
    assert peak < 1 << 20  # in proportion to the read, not to the row (was 2 GiB for 2**26)


def test_requantizing_with_the_checkpoint_blocks_is_near_lossless(tmp_path):
    # the dequantized weights are e4m3 codes times one scale per 128x128 block: re-quantizing
    # them to e4m3 over the same blocks gives back (nearly) the same values, over other blocks
    # not -- a check of the block mapping that needs no reference values at all
    q, s = quantize_blocks(weights((300, 200), seed=16), 128, 128)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "m.safetensors"))
    rc, out, _ = analyze(tmp_path, "--fp8-scales", "apply", "--format", "e4m3", "--scaling",
                         "block:128x128,block:1x32", "--json", "-")  # fmt: skip
    by = {r["scaling"]: r for r in json.loads(out)["records"]}
    assert rc == 0 and by["block:128x128"]["overflow"] == 0
    assert by["block:128x128"]["sqnr_db"] > 100 > by["block:1x32"]["sqnr_db"]


def test_a_file_given_twice_is_analyzed_once(tmp_path):
    # the scales' shard given twice (by name, then inside its directory): its companion is
    # taken by the weight once and never analyzed as a tensor of its own; the repeat is noted
    w = weights((130, 260), seed=6)
    q, s = quantize_blocks(w, 128, 128)
    save_file({"w": q}, str(tmp_path / "model-00001-of-00002.safetensors"))
    second = tmp_path / "model-00002-of-00002.safetensors"
    save_file({"w_scale_inv": s, "other": torch.ones(4)}, str(second))
    (tmp_path / "link.safetensors").symlink_to(second)
    rc, out, err = analyze(second, tmp_path, "--fp8-scales", "apply", "--format", "e4m3",
                           "--json", "-")  # fmt: skip
    doc = json.loads(out)
    assert rc == 0 and sorted(r["name"] for r in doc["records"]) == ["other", "w"]
    repeats = [n for n in doc["notes"] if "analyzed once" in n["note"]]
    # the shard by its name in the directory, and the link to it
    assert sorted(n["file"] for n in repeats) == sorted([str(tmp_path / "link.safetensors"), str(second)])
    rc, out, err = analyze(second, second, "--format", "e4m3")
    assert rc == 0 and f"note: {second}: the same file as {second}: analyzed once" in err
    assert out.count("other") == 1


def test_a_scale_that_overflows_float32_is_a_figure_not_a_warning(tmp_path):
    # 448 x 3e37 is beyond float32: inf values (counted), and no RuntimeWarning on stderr
    q = torch.full((4, 4), 448.0).to(torch.float8_e4m3fn)
    save_file({"w": q, "w_scale": torch.tensor(3e37)}, str(tmp_path / "m.safetensors"))
    rc, out, err = analyze(tmp_path / "m.safetensors", "--fp8-scales", "apply", "--json", "-")
    assert rc == 0 and "Warning" not in err, err
    (rec,) = [r for r in json.loads(out)["records"] if r["format"] == "e4m3"]
    assert rec["inf"] == 16
