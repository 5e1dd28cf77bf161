"""``analyze --jobs N`` and ``fp8sim merge``: on a small sharded checkpoint (FP8 weights whose
scales sit in the next shard by the index, packed NVFP4 and MXFP4 weights, bfloat16, an int64
tensor, an empty one, one holding inf, and a damaged .npz member read past with --keep-going),
N worker processes give the one-process result byte for byte (JSON, table, messages, every PNG),
and the results of two shard lists, merged, are the result of one run over all shards. A worker
killed mid-tensor is one error line, never a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fp8sim.analysis import analyze, merge_results
from fp8sim.errors import ArgumentError
from fp8sim.nvfp4 import pack_e2m1, quantize_nvfp4_2d
from tests.sparse_checkpoint import nvfp4_entries, write_sparse_safetensors

SHARDS = 4
FAIL_ON = "overflow>0,amax>4"


def shard(d, k):
    return d / f"model-{k:05d}-of-{SHARDS:05d}.safetensors"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    g = torch.Generator().manual_seed(0)
    wmap = {}
    for k in range(1, SHARDS + 1):
        t = {f"l{k}.attn.weight": (torch.randn(96, 80, generator=g) * 0.02).bfloat16(),
             f"l{k}.mlp.weight": (torch.randn(64, 128, generator=g) * 4).to(torch.float8_e4m3fn),
             f"l{k}.steps": torch.arange(5)}  # fmt: skip
        if k > 1:  # the previous shard's FP8 weight's scale lives here
            t[f"l{k - 1}.mlp.weight_scale_inv"] = torch.tensor([[0.5]])
        if k == 2:  # packed NVFP4 (compressed-tensors), MXFP4 (gpt-oss), an empty and an inf
            p = quantize_nvfp4_2d(np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32),
                                  "1x16", "compressed-tensors")  # fmt: skip
            t["q.weight_packed"] = torch.from_numpy(pack_e2m1(p.codes))
            t["q.weight_scale"] = torch.from_numpy(p.block_codes).view(torch.float8_e4m3fn)
            t["q.weight_global_scale"] = torch.tensor([p.tensor_scale], dtype=torch.float32)
            t["e.down_proj_blocks"] = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8, generator=g)
            t["e.down_proj_scales"] = torch.randint(118, 130, (2, 3, 2), dtype=torch.uint8, generator=g)
            t["empty"] = torch.zeros(4, 0)
            t["spiky"] = torch.tensor([1.0, float("inf"), -3.0, 0.25])
        save_file(t, str(shard(d, k)))
        wmap.update({n: shard(d, k).name for n in t})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    # a stored .npz member whose data is damaged: a bad tensor, the file's other one analyzed
    npz = d / "zz-extra.npz"
    np.savez(npz, good=np.linspace(-1, 1, 300, dtype=np.float32), bad=np.ones(100_000, np.float32))  # > zipfile's read-ahead
    with zipfile.ZipFile(npz) as zf:
        info = zf.getinfo("bad.npy")
    raw = bytearray(npz.read_bytes())
    raw[info.header_offset + 30 + len("bad.npy") + info.file_size - 8] ^= 0xFF
    npz.write_bytes(bytes(raw))
    return d


def cli(*args):
    out = subprocess.run([sys.executable, "-m", "cli", *map(str, args)], capture_output=True,
                         text=True)  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def run_analyze(paths, out, *extra, plots=False):
    out.mkdir()
    rc, stdout, stderr = cli("analyze", *paths, "--scales", "apply", "--format", "e4m3,e5m2",
                             "--scaling", "tensor,block:1x32", "--keep-going", "--fail-on", FAIL_ON,
                             "--json", out / "r.json", *(["--plot", out / "plots"] if plots else []), *extra)  # fmt: skip
    return rc, stdout, stderr


def test_jobs_give_the_one_process_result_byte_for_byte(checkpoint, tmp_path):
    rc1, out1, err1 = run_analyze([checkpoint], tmp_path / "one", plots=True)
    rc2, out2, err2 = run_analyze([checkpoint], tmp_path / "two", "--jobs", "2", plots=True)
    assert rc1 == rc2 == 2, err1  # the damaged member: listed, the rest analyzed
    assert (out1, err1) == (out2, err2)
    a, b = tmp_path / "one", tmp_path / "two"
    assert (a / "r.json").read_bytes() == (b / "r.json").read_bytes()
    pngs = sorted(p.name for p in (a / "plots").iterdir())
    assert pngs == sorted(p.name for p in (b / "plots").iterdir()) and len(pngs) >= 10
    assert all((a / "plots" / n).read_bytes() == (b / "plots" / n).read_bytes() for n in pngs)
    doc = json.loads((a / "r.json").read_text())
    names = {r["name"] for r in doc["records"]}
    assert {"q.weight_packed", "e.down_proj_blocks", "l1.mlp.weight", "good"} <= names
    assert not any(n.endswith(("_scale_inv", "_scales", "global_scale")) for n in names)
    assert [e["name"] for e in doc["errors"]] == ["bad"] and doc["fail_on"]
    notes = [n["note"] for n in doc["notes"]]
    assert "empty tensor, shape [4, 0]" in notes and any("fell back to 1" in n for n in notes)


def test_merged_shard_lists_are_the_single_run(checkpoint, tmp_path):
    rc, out, err = run_analyze([checkpoint], tmp_path / "all")
    parts = [[shard(checkpoint, 1), shard(checkpoint, 2)],
             [shard(checkpoint, 3), shard(checkpoint, 4), checkpoint / "zz-extra.npz"]]  # fmt: skip
    for k, paths in enumerate(parts):
        run_analyze(paths, tmp_path / f"part{k}")
    part_files = [tmp_path / f"part{k}" / "r.json" for k in range(2)]
    # the node holding shard 3 does not analyze l2's scale: shard 2's weight takes it
    assert "l2.mlp.weight_scale_inv" not in {r["name"] for r in json.loads(part_files[1].read_text())["records"]}
    rcm, outm, errm = cli("merge", *part_files, "--json", tmp_path / "merged.json")
    assert (tmp_path / "merged.json").read_bytes() == (tmp_path / "all" / "r.json").read_bytes()
    assert outm == out and rcm == rc == 2  # the table; exit 2: the parts list a bad tensor
    assert "bad inputs in the parts (1):" in errm
    # the library: the same result object (records, notes, errors, crossings)
    merged = merge_results(part_files)
    assert merged.to_json().strip() == (tmp_path / "all" / "r.json").read_text().strip()


def test_merge_refuses_parts_of_different_jobs(checkpoint, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    analyze([shard(checkpoint, 1)], formats="e4m3").to_json(a)
    analyze([shard(checkpoint, 2)], formats="e5m2").to_json(b)
    rc, out, err = cli("merge", a, b)
    assert rc == 2 and out == "" and "different formats x scalings" in err and err.count("\n") == 1
    analyze([shard(checkpoint, 1), shard(checkpoint, 2)], formats="e5m2").to_json(a)
    rc, _, err = cli("merge", a, b)
    assert rc == 2 and f"{shard(checkpoint, 2)} was analyzed by both {a} and {b}" in err
    analyze([shard(checkpoint, 3)], formats="e5m2", underflow_warning=0.1).to_json(a)
    rc, _, err = cli("merge", a, b)
    assert rc == 2 and "different settings (thresholds" in err
    (tmp_path / "x.json").write_text('{"records": []}')
    rc, _, err = cli("merge", tmp_path / "x.json", b)
    assert rc == 2 and "not an fp8sim analyze result: its 'run' is missing" in err
    rc, _, err = cli("merge", checkpoint, b)
    assert rc == 2 and "a directory without rank traces (rank0/, rank1/, ... each an fp8sim trace)" in err
    rc, _, err = cli("merge", b, "--json", b)
    assert rc == 2 and err.count("\n") == 1


@pytest.mark.parametrize("jobs", [0, -1, 1.5, "2", True])
def test_jobs_argument_is_checked(checkpoint, jobs):
    with pytest.raises(ArgumentError, match="jobs"):
        analyze([shard(checkpoint, 1)], jobs=jobs)


def test_jobs_flag_is_checked(checkpoint):
    rc, out, err = cli("analyze", shard(checkpoint, 1), "--jobs", "0")
    assert rc == 2 and out == "" and "--jobs must be an integer >= 1, got 0" in err and err.count("\n") == 1


def _children(pid: int) -> list[int]:
    """The process ids whose parent is ``pid`` (from /proc: Linux)."""
    kids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(d))
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_killed_worker_is_an_error_not_a_hang(tmp_path):
    for k in range(1, 5):  # 4 sparse NVFP4 shards of 256 M values: each worker is busy for seconds
        write_sparse_safetensors(tmp_path / f"model-{k:05d}-of-00004.safetensors", nvfp4_entries(f"l{k}", 8192, 32768))
    p = subprocess.Popen([sys.executable, "-m", "cli", "analyze", tmp_path, "--scales", "apply", "--jobs", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(600):  # the workers started (spawned: a fresh interpreter each)
            kids = [c for c in _children(p.pid) if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
            if len(kids) == 2 or p.poll() is not None:
                break
            time.sleep(0.1)
        assert len(kids) == 2
        time.sleep(3)  # busy with their first tensors
        os.kill(kids[0], signal.SIGKILL)
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("fp8sim analyze: error: a worker process of --jobs died (killed, or out of memory")
    assert "first tensor not analyzed: " in err and not any(os.path.exists(f"/proc/{c}") for c in kids)
