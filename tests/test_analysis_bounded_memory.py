"""Scale grids are read per chunk, never whole: a 4.6 GiB NVFP4 checkpoint (a sparse file: its
data reads as zeros, quickly, and takes no disk) is linked -- its 553 M-entry block-scale grid
read through once for the note's counts -- and read at its start, middle and end within 512 MiB
of resident memory, measured in a fresh process (its own peak, ``ru_maxrss``). Reading the whole
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
import resource, sys
import numpy as np
from fp8sim.analysis.dumps import link_fp8_scales, open_dump
dumps = [open_dump(sys.argv[1])]
notes = link_fp8_scales(dumps, "apply", None, lambda p, e: sys.exit(f"refused: {e}"))
src = {t.name: t for t in dumps[0].tensors}["w.weight_packed"]
n = src.numel
for start in (0, n // 2 - 12345, n - (1 << 20)):
    x = src.read(start, start + (1 << 20))
    assert x.size == 1 << 20 and not x.any()
print(notes[0]["note"])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def test_a_4_6_gib_nvfp4_file_is_linked_and_read_within_512_mib(tmp_path):
    f = tmp_path / "model.safetensors"
    size = write_sparse_safetensors(f, nvfp4_entries("w", ROWS, COLS))
    assert size > 4.6 * 2**30
    # a fresh process with a plain environment: what other tests set in this one (threads, caches)
    # is not what a user's worker runs with
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "NUMBA_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    out = subprocess.run([sys.executable, "-c", PROBE, str(f)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    note, peak_mib = out.stdout.strip().splitlines()
    assert "NVFP4 (compressed-tensors)" in note
    assert f"0 NaN/inf and {ROWS * COLS // 16} zero or negative block factors" in note  # all read
    assert int(peak_mib) <= LIMIT_MIB, f"peak RSS {peak_mib} MiB"
