"""Emulate FP8 (and FP4) casts bit for bit: codes, rounding modes, overflow rules, scaled casts.

1. One value, every rounding mode, in E4M3 (``fp8sim.encode`` / ``decode``): the code and what
   it decodes to.
2. Overflow: E4M3 saturates to 448 or gives NaN (``saturate=False``); E5M2 has an infinity.
3. A tensor with an outlier under three scalings (``fp8sim.scaling.quantize_scaled``): one scale
   per tensor, one per 1x32 block, and NVFP4 (E2M1 with an E4M3 scale per 16 values and a float32
   tensor scale): the relative error each leaves. With a 2**20 outlier one tensor scale flushes
   the other rows' values, a 1x32 block scale keeps them, and NVFP4's E4M3 block scales -- relative
   to a tensor scale set by the outlier -- fall into E4M3's subnormals and lose most of them.

Run: ``python examples/emulate_casts.py [--size N] [--seed S]``
"""

from __future__ import annotations

import argparse

import numpy as np

import fp8sim
from fp8sim.scaling import dequantize, quantize_scaled


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="tensor elements, a multiple of 32 (default 4096)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print("1. 0.3 in e4m3 under each rounding mode")
    for mode in ("rne", "rna", "rtz", "up", "down", "odd"):
        code = int(fp8sim.encode(np.float32([0.3]), "e4m3", rounding=mode)[0])
        value = float(fp8sim.decode(np.uint8([code]), "e4m3", dtype=np.float64)[0])
        print(f"   {mode:5s} code 0x{code:02x} -> {value!r}")

    print("2. 70000.0, past both formats' max (448, 57344)")
    for fmt, saturate in (("e4m3", True), ("e4m3", False), ("e5m2", False)):
        code = int(fp8sim.encode(np.float32([70000.0]), fmt, saturate=saturate)[0])
        value = float(fp8sim.decode(np.uint8([code]), fmt, dtype=np.float64)[0])
        print(f"   {fmt} saturate={saturate!s:5s} code 0x{code:02x} -> {value!r}")

    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.size // 32, 32)).astype(np.float32)
    x[0, 0] = 2.0**20  # one outlier
    print(f"3. a {x.shape[0]}x32 tensor with one outlier of {x[0, 0]:g}: relative RMS error of the round trip")
    for fmt, gran in (("e4m3", "tensor"), ("e4m3", "block:1x32"), ("e2m1", "nvfp4")):
        st = quantize_scaled(x, fmt, gran)
        err = dequantize(st) - x
        rel = float(np.sqrt(np.sum(err.astype(np.float64) ** 2) / np.sum(x.astype(np.float64) ** 2)))
        rest = float(np.sqrt(np.sum(err[1:].astype(np.float64) ** 2) / np.sum(x[1:].astype(np.float64) ** 2)))
        print(f"   {fmt} {gran:10s} whole tensor {rel:.3e}; rows without the outlier {rest:.3e}")


if __name__ == "__main__":
    main()
