"""Throughput of analysis.stats (two formats x tensor scaling) against a straightforward multi-pass
numpy implementation of the same figures and against a numpy copy of the same data.

Ratios in one process on the same float32 data, median of several runs (never absolute claims):

    .venv/bin/python benchmarks/bench_analysis.py [--n 16777216] [--repeat 5] [--threads N]

Targets (issue 4): >= 5x the numpy implementation, >= 40% of the copy element rate.
The numpy implementation is checked against ours first (same counts), so it is a fair opponent.

Needs only fp8sim's base install.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numba
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fp8sim.analysis.stats import parse_variants, tensor_stats  # noqa: E402
from fp8sim.formats import get_format  # noqa: E402


def numpy_stats(x: np.ndarray, fmt_names: list[str]) -> list[dict]:
    """The same figures with plain numpy, pass after pass (RNE via frexp/rint/ldexp)."""
    x64 = x.astype(np.float64)
    fin = np.isfinite(x)
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    zero = int((x == 0).sum())
    ax = np.abs(np.where(fin, x, 0))
    amax = np.float32(ax.max())
    _, ex = np.frexp(ax[ax > 0])
    log2 = np.bincount(ex - 1 + 150, minlength=279)
    sig2 = float(np.sum(x64[fin] ** 2))
    out = []
    for name in fmt_names:
        f = get_format(name)
        scale = np.float32(np.float32(f.max) / amax)
        p = (x * scale).astype(np.float32).astype(np.float64)
        a = np.abs(p)
        m, e = np.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
        e = np.maximum(e - 1, f.emin)  # the quantum's exponent, subnormals included
        q = np.ldexp(np.rint(np.ldexp(a, f.mantissa_bits - e)), e - f.mantissa_bits)
        over = fin & (q > f.max)
        q = np.minimum(q, f.max)
        under = fin & (x != 0) & (q == 0)
        sub = fin & (q > 0) & (q < f.min_normal)
        deq = (np.copysign(q, p) * np.float64(np.float32(1) / scale)).astype(np.float32)
        err2 = float(np.sum((deq[fin].astype(np.float64) - x64[fin]) ** 2))
        out.append(dict(overflow=int(over.sum()), underflow=int(under.sum()),
                        subnormal=int(sub.sum()), err2=err2, sig2=sig2, nan=nan, inf=inf,
                        zero=zero, log2=log2))  # fmt: skip
    return out


def median_time(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def interleaved_times(fns, repeat: int) -> list[list[float]]:
    """Seconds of each function in every repetition, the functions run in turn within each."""
    for fn in fns:
        fn()  # warm-up (numba compile, first page faults)
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 24, help="elements (float32)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(args.n) * np.exp2(rng.integers(-12, 4, args.n))).astype(np.float32)
    fmts = ["e4m3", "e5m2"]
    variants = parse_variants(fmts, ["tensor"])

    # correctness first: the numpy implementation must agree
    small = x[: 1 << 18]
    ours = tensor_stats(small, variants)
    ref = numpy_stats(small, fmts)
    for v, r in zip(ours.variants, ref):
        assert (v.overflow, v.underflow, v.subnormal) == (r["overflow"], r["underflow"], r["subnormal"])
        assert abs(v.err2 / r["err2"] - 1) < 1e-9

    # ours, the copy and ours on one thread in turn within every repetition (about the same
    # machine state for all: this machine is shared and noisy); the slow numpy implementation on
    # its own
    dst = np.empty_like(x)
    threads = numba.get_num_threads()

    def ours_one_thread() -> None:
        numba.set_num_threads(1)
        try:
            tensor_stats(x, variants)
        finally:
            numba.set_num_threads(threads)

    ts_ours, ts_copy, ts_one = interleaved_times(
        [lambda: tensor_stats(x, variants), lambda: np.copyto(dst, x), ours_one_thread], args.repeat
    )
    t_ours, t_copy = statistics.median(ts_ours), statistics.median(ts_copy)
    # the share within each repetition (ours and the copy back to back): how much noise moves it
    shares = sorted(100 * c / o for o, c in zip(ts_ours, ts_copy))
    t_np = median_time(lambda: numpy_stats(x, fmts), max(1, args.repeat // 2))

    rate = lambda t: args.n / t / 1e9  # noqa: E731
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, numba threads "
          f"{numba.get_num_threads()}, python {platform.python_version()}, numpy {np.__version__}")  # fmt: skip
    print(f"data: {args.n} float32 elements ({args.n * 4 / 2**20:.0f} MiB); 2 formats x tensor scaling")
    print(f"fp8sim.analysis.stats  : {rate(t_ours):7.3f} Gelem/s  (median {t_ours * 1e3:.1f} ms)")
    print(f"numpy multi-pass: {rate(t_np):7.3f} Gelem/s  (median {t_np * 1e3:.1f} ms)")
    print(f"numpy copy      : {rate(t_copy):7.3f} Gelem/s  (median {t_copy * 1e3:.1f} ms)")
    print(f"speed-up vs numpy implementation: {t_np / t_ours:.1f}x   (target >= 5x)")
    print(f"share of the copy element rate  : {100 * t_copy / t_ours:.0f}%   (target >= 40%)")
    print(f"  per repetition ({len(shares)}): min {shares[0]:.0f}%, median "
          f"{statistics.median(shares):.0f}%, max {shares[-1]:.0f}%; "
          f"{sum(v >= 40 for v in shares)} of {len(shares)} at 40% or more")  # fmt: skip
    if threads > 1:  # what the other threads gave on this (shared) machine, in this run
        ups = sorted(a / b for a, b in zip(ts_one, ts_ours))
        print(f"  {threads} threads vs 1 (analysis.stats, interleaved): median "
              f"{statistics.median(ups):.2f}x (min {ups[0]:.2f}x, max {ups[-1]:.2f}x); "
              f"1 thread median {statistics.median(ts_one) * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
