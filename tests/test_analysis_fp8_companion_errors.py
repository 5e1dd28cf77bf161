"""A companion scale that is expected but cannot be looked at (``analyze --fp8-scales apply``):
in a shard that cannot be read, named by a stale index entry, or in a missing shard of a set
without an index. The weight's file is refused naming the shard or the entry, never analyzed
as its bare FP8 codes with a "no companion" note; where no companion can exist, that note
stays."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import save_file

from fp8sim.analysis.dumps import open_dump
from fp8sim.analysis.dumps import ScaledSource, link_fp8_scales

NO_COMPANION = "FP8 codes analyzed as stored (no companion w_scale_inv or w_scale)"


def analyze(*args):
    out = subprocess.run([sys.executable, "-m", "cli", "analyze", *map(str, args)],
                         capture_output=True, text=True)  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def linked(*paths, mode="apply"):
    """(tensors by name, notes, errors) of ``link_fp8_scales`` over ``paths``."""
    dumps = [open_dump(p) for p in paths]
    errors = []
    notes = link_fp8_scales(dumps, mode, None, lambda p, e: errors.append(str(e)))
    return {t.name: t for d in dumps for t in d.tensors}, notes, errors


def fp8_and_scale(seed=0):
    """A 128 x 256 weight as e4m3 codes and its (1, 2) grid of 128 x 128 block scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(128, 256, generator=g)
    s = torch.stack([w[:, :128].abs().max(), w[:, 128:].abs().max()]).reshape(1, 2) / 448
    q = (w / s.repeat_interleave(128, dim=1)).to(torch.float8_e4m3fn)
    return q, s


def shard(d, k, n=3):
    return d / f"model-{k:05d}-of-{n:05d}.safetensors"


def three_shards(d, scale_in=2):
    """model-0000K-of-00003: w in 1, w_scale_inv in ``scale_in`` (None: nowhere), x in 3."""
    d.mkdir()
    q, s = fp8_and_scale()
    parts = {1: {"w": q}, 2: {"y": torch.ones(2)}, 3: {"x": torch.ones(3)}}
    if scale_in is not None:
        parts[scale_in]["w_scale_inv"] = s
    for k, tensors in parts.items():
        save_file(tensors, str(shard(d, k)))
    return d


def write_index(d, wmap):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))


def truncate(path, cut=4):
    """Cut the last ``cut`` bytes off a file (a download cut short)."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - cut)


def test_companion_in_an_unreadable_shard(tmp_path):
    d = three_shards(tmp_path / "ckpt")
    truncate(shard(d, 2))
    # (a) without an index: shard 2 may hold it, and cannot be read
    rc, out, err = analyze(shard(d, 1), "--fp8-scales", "apply", "--json", "-")
    assert rc == 2 and out == "" and "no companion" not in err
    assert f"{shard(d, 1)}: w may have its companion in {shard(d, 2)}, a shard" in err
    assert "cannot be read" in err and len(err.strip().splitlines()) == 1
    # with an index naming shard 2 for it: the entry and the shard are named
    write_index(d, {"w": shard(d, 1).name, "w_scale_inv": shard(d, 2).name})
    _, _, errors = linked(shard(d, 1))
    assert len(errors) == 1 and f"w has its companion w_scale_inv in {shard(d, 2)} by " in errors[0]
    assert "which cannot be read" in errors[0]
    # --keep-going: the weight's file is listed as bad, another file still analyzed
    q, s = fp8_and_scale(seed=1)
    save_file({"v": q, "v_scale_inv": s}, str(tmp_path / "good.safetensors"))
    rc, out, err = analyze(shard(d, 1), tmp_path / "good.safetensors", "--fp8-scales", "apply",
                           "--keep-going", "--format", "e4m3", "--json", "-")  # fmt: skip
    doc = json.loads(out)
    assert rc == 2 and [r["name"] for r in doc["records"]] == ["v"]
    assert [e["file"] for e in doc["errors"]] == [str(shard(d, 1))]
    assert "which cannot be read" in doc["errors"][0]["reason"]
    assert not any("no companion" in n["note"] for n in doc["notes"])


def test_corrupt_shard_given_too_keep_going(tmp_path):
    d = three_shards(tmp_path / "ckpt")
    truncate(shard(d, 2))
    rc, out, err = analyze(d, "--fp8-scales", "apply", "--keep-going", "--format", "e4m3",
                           "--json", "-")  # fmt: skip
    doc = json.loads(out)
    # shard 2 bad on its own, shard 1 bad for its weight's companion; shard 3 still analyzed
    assert rc == 2 and [r["name"] for r in doc["records"]] == ["x"]
    assert sorted(e["file"] for e in doc["errors"]) == [str(shard(d, 1)), str(shard(d, 2))]
    assert not any("no companion" in n["note"] for n in doc["notes"])


def test_stale_index_entry(tmp_path):
    # (b) the index names shard 2 for w_scale_inv; it is in shard 3
    d = three_shards(tmp_path / "ckpt", scale_in=3)
    write_index(d, {"w": shard(d, 1).name, "w_scale_inv": shard(d, 2).name})
    rc, out, err = analyze(shard(d, 1), "--fp8-scales", "apply")
    assert rc == 2 and "no companion" not in err and len(err.strip().splitlines()) == 1
    assert (f"w has its companion w_scale_inv in '{shard(d, 2).name}' by "
            f"{d / 'model.safetensors.index.json'}, which does not hold it") in err  # fmt: skip
    # the index names the weight's own shard, which lacks it
    write_index(d, {"w": shard(d, 1).name, "w_scale_inv": shard(d, 1).name})
    t, notes, errors = linked(shard(d, 1))
    assert not t and not notes and len(errors) == 1
    assert f"w_scale_inv in '{shard(d, 1).name}' by " in errors[0] and "stale index" in errors[0]
    # an up-to-date index: applied
    write_index(d, {"w": shard(d, 1).name, "w_scale_inv": shard(d, 3).name})
    t, notes, errors = linked(shard(d, 1))
    assert not errors and isinstance(t["w"], ScaledSource)


def test_missing_shard_without_an_index(tmp_path):
    # (c) no index, shard 2 of 3 (which held the scales) is not there
    d = three_shards(tmp_path / "ckpt")
    shard(d, 2).unlink()
    rc, out, err = analyze(shard(d, 1), "--fp8-scales", "apply")
    assert rc == 2 and "no companion" not in err and len(err.strip().splitlines()) == 1
    assert f"w may have its companion in {shard(d, 2)}, a shard of its set that is not " in err
    # two missing: the first named, the count given
    shard(d, 3).unlink()
    _, _, errors = linked(shard(d, 1))
    assert len(errors) == 1 and str(shard(d, 2)) in errors[0]
    assert "that is not there (2 of 3 shards missing)" in errors[0]
    # --fp8-scales stored never refuses: the note says why nothing was found
    t, notes, errors = linked(shard(d, 1), mode="stored")
    assert not errors and "w" in t
    assert "FP8 codes analyzed as stored; it may have its companion in" in notes[0]["note"]


def test_no_companion_where_none_can_be(tmp_path):
    # a complete, readable shard set without an index, no companion anywhere: the note stays
    d = three_shards(tmp_path / "ckpt", scale_in=None)
    rc, out, err = analyze(shard(d, 1), "--fp8-scales", "apply", "--format", "e4m3", "--json", "-")
    doc = json.loads(out)
    assert rc == 0 and [r["name"] for r in doc["records"]] == ["w"]
    assert [n["note"] for n in doc["notes"] if n["name"] == "w"] == [NO_COMPANION]
    # an index that names no companion is believed, though a shard is missing
    shard(d, 2).unlink()
    write_index(d, {"w": shard(d, 1).name, "x": shard(d, 3).name})
    t, notes, errors = linked(shard(d, 1))
    assert not errors and notes[0]["note"] == NO_COMPANION
    # unsharded: nothing else to search
    q, _ = fp8_and_scale()
    save_file({"w": q}, str(tmp_path / "model.safetensors"))
    t, notes, errors = linked(tmp_path / "model.safetensors")
    assert not errors and notes[0]["note"] == NO_COMPANION
    np.testing.assert_array_equal(t["w"].read_all(), q.float().numpy())


def test_incomplete_set_without_fp8_or_with_fp8_scales(tmp_path):
    # shards with no FP8 tensor, and an FP8 scale (not expected to have one of its own), in a
    # set missing a shard: nothing refused
    d = tmp_path / "ckpt"
    d.mkdir()
    q, s = fp8_and_scale()
    s8 = (s * 64).to(torch.float8_e4m3fn)
    save_file({"a": torch.ones(4), "w": q, "w_scale": s8}, str(shard(d, 1)))
    t, notes, errors = linked(shard(d, 1))
    assert not errors and sorted(t) == ["a", "w"] and isinstance(t["w"], ScaledSource)
    ref = (q.float() * s8.float().repeat_interleave(128, 1)).numpy()
    np.testing.assert_array_equal(t["w"].read_all(), ref)
    save_file({"b": torch.ones(4)}, str(shard(d, 3)))
    rc, _, err = analyze(shard(d, 3), "--fp8-scales", "apply")
    assert rc == 0
