"""Emulator throughput as ratios measured in one process, on the same data.

    python benchmarks/bench_emulator.py [--log2n 26] [--reps 7] [--markdown]

Needs ml_dtypes besides fp8sim (``pip install ml_dtypes``; the test extra has it).

Rows: float32 -> e4m3 / e5m2 encode (rne, saturating; a fresh result every time, its pages
faulted in by the kernel, as torch's ``.to()`` does), the e4m3 encode again into a preallocated
``out=`` (against torch's ``copy_`` into a preallocated float8 tensor: neither side pays for the
zeroed pages of a fresh 64 MiB result), decode e4m3 -> float32, float64 -> e4m3 encode,
stochastic encode (Philox), and a floor: reading the float32 input once (a parallel max over its
bits, no output) against torch's ``.to()`` -- no encode of that input can beat that ratio. Columns:
time of each contender (median of --reps runs after three warm-up rounds; the emulator, its
contenders and the copy run in turn within every repetition, the order reversed every other one,
so all meet the same machine state) and the emulator's speed relative to it (> 1 means the
emulator is faster): the median of the per-repetition ratios, paired within a repetition.
Contenders: torch's CPU cast (``.to(torch.float8_e4m3fn)`` / ``.to(torch.float32)``), ml_dtypes
``astype``, and a numpy copy of the same array (the memory-bandwidth yardstick; "element rate"
= elements per second, so 100% means as many elements per second as the copy).
Absolute times depend on the machine and its load; only the ratios are meant to be read.

Needs ml_dtypes beside fp8sim's install (a contender): pip install ml_dtypes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np


def _read_once_kernel():
    """A numba kernel that reads every element once (a max over the uint32 bits, parallel)."""
    import numba

    @numba.njit(parallel=True, nogil=True, cache=False)
    def read_once(bits):
        top = np.uint32(0)
        for i in numba.prange(bits.size):
            top = max(top, bits[i])
        return top

    return read_once


def _median_time(fn, reps: int) -> float:
    for _ in range(WARMUP):
        fn()  # warm-up (numba compile, page faults, the allocator's steady state)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: warm-up rounds before timing: the first calls compile (numba) and fault pages in, and the
#: allocator needs a few rounds of 64 MiB results before it returns them at a steady cost
WARMUP = 3


def _interleaved_times(fns: dict, reps: int) -> dict:
    """Per-repetition seconds of each function: after :data:`WARMUP` rounds, every repetition
    runs each function once, in turn, the order reversed every other repetition (no contender
    always runs after the same one), so all meet the same machine state."""
    for _ in range(WARMUP):
        for fn in fns.values():
            fn()
    times: dict = {k: [] for k in fns}
    keys = list(fns)
    for i in range(reps):
        for k in keys if i % 2 == 0 else keys[::-1]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def _paired_ratio(contender: list, emu: list) -> float:
    """The median over repetitions of contender time / emulator time, paired within each
    repetition (a load spike hits both sides of a pair, so the pairs' ratios are steadier than
    the ratio of the two medians)."""
    return statistics.median(c / e for c, e in zip(contender, emu))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=26)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()

    try:
        import ml_dtypes
    except ImportError:
        raise SystemExit("bench_emulator.py compares against ml_dtypes, which is not installed: "
                         "pip install ml_dtypes") from None
    import torch

    import fp8sim

    n = 1 << args.log2n
    rng = np.random.default_rng(0)
    x32 = (rng.standard_normal(n, dtype=np.float32) * 100).astype(np.float32)
    x64 = x32.astype(np.float64)
    t32 = torch.from_numpy(x32)
    copy_dst = np.empty_like(x32)
    codes = fp8sim.encode(x32, "e4m3")
    tcodes = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    # ml_dtypes is slow: time it on 1/8 of the data and scale (its cost is linear in n)
    sub = x32[: n // 8]

    r = args.reps
    rows = []

    def row(name, fns, ml=None):
        """Time the emulator (key "emu") and its contenders interleaved: every repetition runs
        each once, in turn, so all of them meet the same machine state (load, free huge pages)."""
        fns = {**fns, "numpy copy": lambda: np.copyto(copy_dst, x32)}
        runs = _interleaved_times(fns, r)
        emu = runs.pop("emu")
        t_emu = statistics.median(emu)
        times = {k: statistics.median(v) for k, v in runs.items()}
        ratios = {k: _paired_ratio(v, emu) for k, v in runs.items()}
        if ml is not None:  # ml_dtypes is slow: 1/8 of the data, scaled (its cost is linear in n)
            times["ml_dtypes"] = 8 * _median_time(ml, max(3, r // 2))
            ratios["ml_dtypes"] = times["ml_dtypes"] / t_emu
        rows.append((name, t_emu, times, ratios))

    row("f32->e4m3 rne sat, fresh memory", {"emu": lambda: fp8sim.encode(x32, "e4m3"),
                                            "torch": lambda: t32.to(torch.float8_e4m3fn)},
        ml=lambda: sub.astype(ml_dtypes.float8_e4m3fn))
    # the same cast into preallocated outputs on both sides (no page zeroing of a fresh result)
    out8 = np.empty(n, np.uint8)
    t8 = torch.empty(n, dtype=torch.float8_e4m3fn)
    row("f32->e4m3 rne sat, into out=", {"emu": lambda: fp8sim.encode(x32, "e4m3", out=out8),
                                         "torch": lambda: t8.copy_(t32)})
    row("f32->e5m2 rne sat", {"emu": lambda: fp8sim.encode(x32, "e5m2"),
                              "torch": lambda: t32.to(torch.float8_e5m2)},
        ml=lambda: sub.astype(ml_dtypes.float8_e5m2))
    row("decode e4m3->f32", {"emu": lambda: fp8sim.decode(codes, "e4m3"),
                             "torch": lambda: tcodes.to(torch.float32)},
        ml=lambda: codes[: n // 8].view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    row("f64->e4m3 rne sat", {"emu": lambda: fp8sim.encode(x64, "e4m3"),
                              "torch": lambda: torch.from_numpy(x64).to(torch.float8_e4m3fn)})
    row("f32->e4m3 stochastic", {"emu": lambda: fp8sim.encode(x32, "e4m3", rounding="stochastic", seed=1)})
    read_once = _read_once_kernel()
    row("floor: read the f32 input once", {"emu": lambda: read_once(x32.view(np.uint32)),
                                           "torch": lambda: t32.to(torch.float8_e4m3fn)})

    names = ["torch", "ml_dtypes", "numpy copy"]
    header = ["operation", "emulator ms"] + [f"{c} ms" for c in names] + [
        "speed vs torch", "vs ml_dtypes", "element rate vs copy"]
    lines = []
    for name, t_emu, cont, ratio in rows:
        cells = [name, f"{t_emu * 1e3:.1f}"]
        for c in names:
            cells.append(f"{cont[c] * 1e3:.1f}" if c in cont else "-")
        for c in names:
            cells.append(f"{ratio[c]:.2f}x" if c in ratio else "-")
        cells[-1] = f"{100 * ratio['numpy copy']:.0f}%"
        lines.append(cells)
    info = (f"n = 2**{args.log2n} elements, {WARMUP} warm-up rounds, median of {r} interleaved runs (ratios: "
            f"median of the runs' paired ratios); {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, numba threads {__import__('numba').get_num_threads()}, "
            f"torch threads {torch.get_num_threads()}")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for cells in lines:
            print("| " + " | ".join(cells) + " |")
        print(f"\n{info}")
    else:
        widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for cells in lines:
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
        print(info)


if __name__ == "__main__":
    main()
