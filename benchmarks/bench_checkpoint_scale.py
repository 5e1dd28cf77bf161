"""``fp8sim analyze --jobs N`` on sharded checkpoints (issue 33; not a test, minutes to hours).

Two measurements, each running the installed ``fp8sim analyze`` as a user would (a fresh process
per run, so start-up and the workers' spawn are included):

* ``speedup``: a checkpoint of ``--shards`` safetensors shards (default 8) of random data --
  per shard a bfloat16 weight and a DeepSeek-style FP8 weight with 128x128 float32 block scales,
  ``--mvalues`` million values per shard -- analyzed with ``--scales apply`` by ``--jobs 1`` and
  ``--jobs 2``, with ``NUMBA_NUM_THREADS=1`` and with numba's default threads, the four
  configurations taking turns ``--rounds`` times; medians, and the JSON results checked equal
  byte for byte. Goals: ``--jobs 2`` >= 1.7x ``--jobs 1`` with one numba thread, never slower
  with the default threads.
* ``big``: a sparse checkpoint (``tests/sparse_checkpoint.py``: headers and scales written, the
  data a hole that reads as zeros and takes no disk) of ``--gb`` GB apparent size in
  ``--shards`` NVFP4 shards (compressed-tensors layout: packed E2M1 codes, E4M3 block scales,
  float32 global scale), analyzed with ``--scales apply --jobs J``: wall time, values per second
  and the peak resident memory (``VmHWM``) of the main process and of each worker, polled from
  /proc every 0.2 s (Linux).

    python benchmarks/bench_checkpoint_scale.py speedup [--shards 8] [--mvalues 8] [--rounds 3]
    python benchmarks/bench_checkpoint_scale.py big [--gb 20] [--shards 8] [--jobs 2]

The files go to ``--dir`` (default: a temporary folder, removed at the end). Needs only
fp8sim's base install and this checkout (tests/sparse_checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.sparse_checkpoint import nvfp4_entries, write_sparse_safetensors  # noqa: E402

FP8SIM = [sys.executable, "-m", "fp8sim"]


def _hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def run_analyze(args: list[str], env: dict | None = None, watch: bool = False) -> dict:
    """One ``fp8sim analyze`` run: wall seconds, return code, and with ``watch`` the peak RSS
    (MiB) of the main process and of its largest worker."""
    t0 = time.perf_counter()
    p = subprocess.Popen(FP8SIM + ["analyze", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, **(env or {})}, text=True)  # fmt: skip
    main_peak, worker_peak = 0, 0
    while p.poll() is None:
        if watch:
            main_peak = max(main_peak, _hwm_kib(p.pid) or 0)
            for c in _children(p.pid):
                worker_peak = max(worker_peak, _hwm_kib(c) or 0)
        time.sleep(0.2)
    err = p.stderr.read()
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"fp8sim analyze {' '.join(args)} exited {p.returncode}: {err[-2000:]}")
    return {"wall": wall, "main_mib": main_peak / 1024, "worker_mib": worker_peak / 1024}


def build_dense(d: str, shards: int, mvalues: float) -> int:
    """``shards`` shards of random data: a bfloat16 weight and an FP8 block-scaled one, half of
    the values each; returns the values in the checkpoint."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    cols = 4096
    rows = max(128, int(mvalues * 1e6 / 2 / cols) // 128 * 128)
    total = 0
    wmap = {}
    for k in range(1, shards + 1):
        name = f"model-{k:05d}-of-{shards:05d}.safetensors"
        w = (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()
        q = (torch.randn(rows, cols, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(rows // 128, cols // 128, generator=g) * 1e-3
        t = {f"layers.{k}.attn.weight": w, f"layers.{k}.mlp.weight": q, f"layers.{k}.mlp.weight_scale_inv": s}
        save_file(t, os.path.join(d, name))
        wmap.update({n: name for n in t})
        total += w.numel() + q.numel()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wmap}, f)
    return total


def speedup(ns: argparse.Namespace, d: str) -> None:
    values = build_dense(d, ns.shards, ns.mvalues)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"checkpoint: {ns.shards} shards, {values / 1e6:.0f} M values, {size / 2**20:.0f} MiB; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    configs = [("1 thread", {"NUMBA_NUM_THREADS": "1"}), ("default threads", {})]
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(ns.rounds):
        for label, env in configs:
            for jobs in (1, 2):
                out = os.path.join(d, f"r-{jobs}-{label[0]}.json")
                if os.path.exists(out):
                    os.remove(out)
                res = run_analyze([d, "--scales", "apply", "--jobs", str(jobs), "--json", out], env)
                times.setdefault((label, jobs), []).append(res["wall"])
                print(f"  round {r + 1}: {label}, --jobs {jobs}: {res['wall']:.1f} s", flush=True)
        ref = open(os.path.join(d, "r-1-1.json"), "rb").read()
        assert all(open(os.path.join(d, f"r-{j}-{c}.json"), "rb").read() == ref for j in (1, 2) for c in "1d"), \
            "results differ between --jobs 1 and --jobs 2"
    print(f"results byte-identical across --jobs and threads; medians of {ns.rounds} (load now "
          f"{os.getloadavg()[0]:.1f}):")  # fmt: skip
    for label, _ in configs:
        t1, t2 = statistics.median(times[(label, 1)]), statistics.median(times[(label, 2)])
        print(f"  {label}: --jobs 1 {t1:.1f} s, --jobs 2 {t2:.1f} s: {t1 / t2:.2f}x "
              f"({values / t2 / 1e6:.1f} M values/s with --jobs 2)")  # fmt: skip


def big(ns: argparse.Namespace, d: str) -> None:
    per_shard = ns.gb * 1e9 / ns.shards
    cols = 131072
    rows = int(per_shard / (cols / 2 + cols / 16)) // 16 * 16  # packed codes + E4M3 scales
    apparent = 0
    for k in range(1, ns.shards + 1):
        path = os.path.join(d, f"model-{k:05d}-of-{ns.shards:05d}.safetensors")
        apparent += write_sparse_safetensors(path, nvfp4_entries(f"layers.{k}.mlp.down_proj", rows, cols))
    values = ns.shards * rows * cols
    print(f"sparse NVFP4 checkpoint: {ns.shards} shards, {apparent / 1e9:.1f} GB apparent, "
          f"{values / 1e9:.1f} G values; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    out = os.path.join(d, "result.json")
    res = run_analyze([d, "--scales", "apply", "--jobs", str(ns.jobs), "--json", out], watch=True)
    doc = json.load(open(out))
    assert len(doc["records"]) == 2 * ns.shards and not doc["errors"], "unexpected result"
    print(f"--jobs {ns.jobs}: {res['wall']:.0f} s, {values / res['wall'] / 1e6:.0f} M values/s; peak RSS: "
          f"main process {res['main_mib']:.0f} MiB, largest worker {res['worker_mib']:.0f} MiB "
          f"(load now {os.getloadavg()[0]:.1f})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("speedup", "big"))
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--mvalues", type=float, default=8.0, help="speedup: million values per shard")
    ap.add_argument("--rounds", type=int, default=3, help="speedup: rounds of the four configurations")
    ap.add_argument("--gb", type=float, default=20.0, help="big: apparent size in GB (1e9 bytes)")
    ap.add_argument("--jobs", type=int, default=2, help="big: --jobs")
    ap.add_argument("--dir", help="where the checkpoint goes (default: a temporary folder)")
    ns = ap.parse_args()
    if ns.dir:
        os.makedirs(ns.dir, exist_ok=False)
        (speedup if ns.what == "speedup" else big)(ns, ns.dir)
        return
    with tempfile.TemporaryDirectory(prefix="fp8sim-bench-ckpt-") as d:
        (speedup if ns.what == "speedup" else big)(ns, d)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
