"""Old against new, in one process: the emulator of an earlier commit beside today's.

    python benchmarks/ab_emulator.py COMMIT [--log2n 26] [--runs 9]

The earlier commit's ``fp8sim/`` is unpacked (``git archive``) into a temporary folder and imported
as ``fp8sim_old``; both cast the same float32 array (``randn * 100``) to E4M3 into fresh memory, and
decode the codes back, taking turns (the order flips every run), after checking they give the
same bits. Prints the medians and new/old. Set ``FP8SIM_RESULT_CACHE_MB`` to give a commit that
still had the result cache its cache (default here: off, ``0``).

Needs only fp8sim's base install and git.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def unpack(commit: str, dest: Path) -> None:
    """``fp8sim/`` of ``commit`` as the package ``fp8sim_old`` in ``dest``."""
    root = Path(__file__).resolve().parents[1]
    tar = subprocess.run(["git", "-C", str(root), "archive", commit, "fp8sim"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    (dest / "fp8sim").rename(dest / "fp8sim_old")
    for path in (dest / "fp8sim_old").rglob("*.py"):
        if path.is_symlink():
            path.unlink()
            continue
        text = path.read_text()
        text = re.sub(r"\bfp8sim\.", "fp8sim_old.", text)
        text = re.sub(r"from fp8sim import", "from fp8sim_old import", text)
        path.write_text(re.sub(r"^import fp8sim$", "import fp8sim_old", text, flags=re.M))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commit")
    ap.add_argument("--log2n", type=int, default=26)
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    os.environ.setdefault("FP8SIM_RESULT_CACHE_MB", "0")
    tmp = Path(tempfile.mkdtemp(prefix="fp8sim-ab-"))
    unpack(args.commit, tmp)
    sys.path.insert(0, str(tmp))
    import numpy as np

    import fp8sim
    import fp8sim_old

    x = (np.random.default_rng(0).standard_normal(1 << args.log2n) * 100).astype(np.float32)
    codes = fp8sim.encode(x, "e4m3")
    assert np.array_equal(codes, fp8sim_old.encode(x, "e4m3")), "the two encodes differ"
    assert np.array_equal(fp8sim.decode(codes, "e4m3").view(np.uint32),
                          fp8sim_old.decode(codes, "e4m3").view(np.uint32)), "the decodes differ"

    def timed(fn) -> float:
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        del result  # fresh memory for the next call
        return dt

    cases = [("encode f32->e4m3", lambda m: m.encode(x, "e4m3")),
             ("decode e4m3->f32", lambda m: m.decode(codes, "e4m3"))]
    times = {(name, who): [] for name, _ in cases for who in ("old", "new")}
    for run in range(args.runs):
        order = [("old", fp8sim_old), ("new", fp8sim)][:: 1 if run % 2 == 0 else -1]
        for name, fn in cases:
            for who, mod in order:
                times[name, who].append(timed(lambda: fn(mod)))
    print(f"old {args.commit} vs new, 2**{args.log2n} values, medians of {args.runs} interleaved runs"
          f" (old result cache MB: {os.environ['FP8SIM_RESULT_CACHE_MB']})")
    for name, _ in cases:
        old, new = (statistics.median(times[name, w]) * 1e3 for w in ("old", "new"))
        print(f"{name:18s} old {old:7.1f} ms  new {new:7.1f} ms  new/old {new / old:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
