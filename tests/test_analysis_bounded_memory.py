"""Scale grids are read per chunk, never whole: a 4.6 GiB NVFP4 checkpoint (a sparse file: its
data reads as zeros, quickly, and takes no disk) is linked -- its 553 M-entry block-scale grid
read through once for the note's counts -- and read at its start, middle and end within 512 MiB
of resident memory, measured in a fresh process (its peak, ``VmHWM``, restarted once a small file
of the same layout has loaded the imports and compiled kernels). Reading the whole
grid at once took 2.3 GiB on a 1.1 GiB file. The full analysis of this file, and of a sharded
checkpoint of >= 20 GB, with --jobs, is benchmarks/bench_checkpoint_scale.py (minutes, not CI)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.sparse_checkpoint import nvfp4_entries, write_sparse_safetensors

ROWS, COLS = 67584, 131072  # 4.13 GiB of packed codes, 0.52 GiB of E4M3 block scales
LIMIT_MIB = 512

PROBE = """
import sys
import numpy as np
from fp8sim.analysis.dumps import link_fp8_scales, open_dump

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024

small = open_dump(sys.argv[2])  # the same layout, small: imports and compiled kernels loaded
link_fp8_scales([small], "apply", None, lambda p, e: sys.exit(f"refused: {e}"))
start = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here
dumps = [open_dump(sys.argv[1])]
notes = link_fp8_scales(dumps, "apply", None, lambda p, e: sys.exit(f"refused: {e}"))
src = {t.name: t for t in dumps[0].tensors}["w.weight_packed"]
n = src.numel
for start_at in (0, n // 2 - 12345, n - (1 << 20)):
    x = src.read(start_at, start_at + (1 << 20))
    assert x.size == 1 << 20 and not x.any()
print(notes[0]["note"])
print(start, status("VmHWM"))
"""


def test_a_4_6_gib_nvfp4_file_is_linked_and_read_within_512_mib(tmp_path):
    f = tmp_path / "model.safetensors"
    size = write_sparse_safetensors(f, nvfp4_entries("w", ROWS, COLS))
    assert size > 4.6 * 2**30
    # a fresh process with a plain environment: what other tests set in this one (threads, caches)
    # is not what a user's worker runs with
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "NUMBA_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    small = tmp_path / "small.safetensors"
    write_sparse_safetensors(small, nvfp4_entries("w", 256, 1024))
    out = subprocess.run([sys.executable, "-c", PROBE, str(f), str(small)], capture_output=True, text=True,
                         env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    note, figures = out.stdout.strip().splitlines()
    ready_mib, peak_mib = map(int, figures.split())
    assert "NVFP4 (compressed-tensors)" in note
    assert f"0 NaN/inf and {ROWS * COLS // 16} zero or negative block factors" in note  # all read
    # the worker's peak while it links and reads the 4.6 GiB file, from a process that has its
    # imports and compiled kernels (a small file of the same layout read first)
    assert peak_mib <= LIMIT_MIB, f"peak RSS {peak_mib} MiB (resident before the big file: {ready_mib} MiB)"
