"""One-shot correctness check of the Triton kernels on a GPU against the emulator.

    python benchmarks/gpu_check.py [--log2n 24] [--json PATH] [--only nvfp4]   # on a CUDA GPU
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --smoke      # the same checks, tiny, on CPU

Checks, each PASS/FAIL with a count of mismatches:
* quantize e4m3/e5m2 (rne, saturating) with the native hardware cast and with the software
  cast, both == ``fp8sim.encode`` on 2**log2n random values of many binades plus every edge
  value (ties, max and just above, subnormals, inf, NaN of both signs), at three scales;
* the software cast in every rounding mode and both overflow rules, several formats;
* cast_transpose (stochastic), dequantize (bf16 out), block/MX quantize vs fp8sim.scaling;
* scaled_mm native fp8 dot and float16 path vs a float64 product: worst error over the bound;
* the fused Adam step bit for bit against the emulator backend;
* NVFP4 quantize (1x16, 16x1, 16x16 tiles; te, torchao, torchao-block, compressed-tensors rules;
  round to nearest even and stochastic; a given tensor amax) against ``fp8sim.nvfp4``: packed
  E2M1 codes, E4M3 block-scale codes and values, block amaxes, tensor scale, bitwise, on a
  ragged 2-D array of the random values with NaN, inf, zero and tiny tiles and tiles on the E2M1
  rounding boundaries; the RHT (both directions, two axes) against ``fp8sim.hadamard.rht``.
Exit status: 0 all passed (or no GPU: says so), 1 a check failed.

Needs Triton (pip install -e '.[gpu]' from a checkout) and a CUDA GPU, or TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _device() -> str | None:
    import torch

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def run_checks(dev: str, log2n: int, only: str = "all") -> list[dict]:
    import torch

    import fp8sim
    from fp8sim.backends import get
    from fp8sim.backends.cases import edge_values, random_values
    from fp8sim.backends.triton_backend import TritonBackend
    from fp8sim.emulator import ROUNDING_MODES, decode_table
    from fp8sim.scaling import quantize_scaled

    soft, native = TritonBackend(native=False), TritonBackend(native=True)
    n = 1 << log2n
    results: list[dict] = []

    def record(name: str, bad: int, total: int, **extra) -> None:
        results.append({"check": name, "ok": bad == 0, "mismatches": int(bad), "n": int(total), **extra})
        print(f"{'PASS' if bad == 0 else 'FAIL'} {name}: {bad} of {total} differ "
              f"{extra if extra else ''}", file=sys.stderr)

    def codes_diff(got: torch.Tensor, want) -> int:
        return int((got.cpu() != torch.as_tensor(want)).sum())

    rand = random_values(n, seed=11, spread=40.0)
    if only == "nvfp4":
        _nvfp4_checks(dev, rand, record)
        return results
    for fmt in ("e4m3", "e5m2"):
        x = torch.from_numpy(np.concatenate([edge_values(fmt), rand]))
        xd = x.to(dev)
        for scale in (1.0, 3.0e-3, 1024.0):
            want = fp8sim.encode(x.numpy() * np.float32(scale), fmt)
            for be, label in ((native, "native"), (soft, "software")):
                codes, _ = be.quantize(xd, fmt, scale)
                record(f"quantize {fmt} rne sat {label} scale={scale}", codes_diff(codes, want), x.numel())

    sub = torch.from_numpy(rand[: max(n // 16, 4096)])
    for fmt in ("e4m3", "e5m2", "e4m3fnuz", "e3m4", "fp16", "bf16"):
        x = torch.cat([torch.from_numpy(edge_values(fmt)), sub])
        xd = x.to(dev)
        for rounding in ROUNDING_MODES:
            seed = 77 if rounding == "stochastic" else None
            bad = 0
            for saturate in (True, False):
                codes, _ = soft.quantize(xd, fmt, 1.0, rounding=rounding, saturate=saturate, seed=seed)
                bad += codes_diff(codes, fp8sim.encode(x.numpy(), fmt, rounding=rounding,
                                                       saturate=saturate, seed=seed))
            record(f"software cast {fmt} {rounding} (both overflow rules)", bad, 2 * x.numel())

    side = 64 if dev == "cpu" else 2048
    x2 = torch.from_numpy(random_values(side * (side + 3), seed=3, spread=12.0)).reshape(side, side + 3)
    xd = x2.to(dev)
    want = fp8sim.encode(x2.numpy() * np.float32(2.0), "e4m3", rounding="stochastic", seed=5)
    c, ct, _ = soft.cast_transpose(xd, "e4m3", 2.0, rounding="stochastic", seed=5)
    record("cast_transpose e4m3 stochastic", codes_diff(c, want) + codes_diff(ct, want.T), 2 * want.size)
    vals = soft.dequantize(c, "e4m3", 0.5, out_dtype=torch.bfloat16).cpu()
    ref = torch.from_numpy(fp8sim.decode(want, "e4m3") * np.float32(0.5)).to(torch.bfloat16)
    record("dequantize e4m3 -> bf16", int((vals.view(torch.int16) != ref.view(torch.int16)).sum()), want.size)
    for gran in ("block:1x128", "block:128x128", "mx", "mx:rceil", "row", "col"):
        c, s, _ = soft.block_quantize(xd, "e4m3", gran)
        st = quantize_scaled(x2.numpy(), "e4m3", gran)
        bad = codes_diff(c, st.codes) + int((s.cpu().nan_to_num(-1) != torch.from_numpy(st.scale_inv).nan_to_num(-1)).sum())
        record(f"block_quantize e4m3 {gran}", bad, st.codes.size)

    m, k, nn = (64, 256, 48) if dev == "cpu" else (1024, 4096, 768)
    rng = np.random.default_rng(5)
    for fa, fb, be, label in (("e4m3", "e4m3", native, "native"), ("e4m3", "e5m2", native, "native"),
                              ("e4m3", "e5m2", soft, "float16"), ("e3m4", "e4m3fnuz", soft, "float16")):
        def codes(fmt, shape):
            ok = np.flatnonzero(np.isfinite(decode_table(fmt, np.float64))).astype(np.uint8)
            return torch.from_numpy(ok[rng.integers(0, ok.size, shape)])
        a, b = codes(fa, (m, k)), codes(fb, (nn, k)).t()
        out = be.scaled_mm(a.to(dev), fa, 0.5, b.to(dev), fb, 2.0).cpu().double().numpy()
        av, bv = decode_table(fa, np.float64)[a.numpy()], decode_table(fb, np.float64)[b.numpy()]
        ref, mag = av @ bv, np.abs(av) @ np.abs(bv)
        f32_bound = (k + 2) * 2.0**-24 * mag + 2.0**-24 * np.abs(ref)
        worst = float(np.max(np.abs(out - ref) / np.maximum(f32_bound, 1e-300)))
        loose = 2.0**-12 * mag + 2.0**-24 * np.abs(ref)  # fp8 MMA's narrower internal adds
        bad = int((np.abs(out - ref) > (loose if label == "native" else f32_bound)).sum())
        record(f"scaled_mm {fa}x{fb} {label}", bad, ref.size, worst_error_over_f32_bound=round(worst, 3))

    size = 4096 if dev == "cpu" else n // 4
    rng = np.random.default_rng(9)
    p = torch.from_numpy((rng.standard_normal(size) * 20).astype(np.float16))
    g = torch.from_numpy((rng.standard_normal(size) * 1e-3).astype(np.float32))
    mm = torch.from_numpy(rng.integers(0, 0x7E, size, dtype=np.uint8))
    v = torch.from_numpy((rng.random(size) * 1e-2).astype(np.float16))
    for rounding in ("rne", "stochastic"):
        kw = dict(step=5, lr=1e-3, weight_decay=0.1, rounding=rounding,
                  seed=123 if rounding == "stochastic" else None)
        dst = [t.to(dev) for t in (p, mm, v)]
        ref = [t.clone() for t in (p, mm, v)]
        r1 = soft.adam_step(dst[0], 1 / 1024, g.to(dev), dst[1], 1 / 64, dst[2], 1.0, **kw)
        r2 = get("emulator").adam_step(ref[0], 1 / 1024, g, ref[1], 1 / 64, ref[2], 1.0, **kw)
        bad = sum(int((a.cpu().view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(dst, ref))
        bad += sum(int(not torch.equal(a.cpu(), b)) for a, b in zip(r1, r2))
        record(f"adam_step {rounding}", bad, 3 * size)

    _nvfp4_checks(dev, rand, record)
    return results


def _nvfp4_input(rand: np.ndarray) -> np.ndarray:
    """float32 (rows, cols) of the random values, both sides ragged for 16-element tiles and the
    last axis odd (a half-filled last packed byte), with NaN, +-inf, a zero 16x16 tile, tiny and
    float32-subnormal tiles, and tiles on the E2M1 rounding boundaries (te's rules) on top."""
    from fp8sim.backends.cases import nvfp4_boundary_tiles

    cols = 4093 if rand.size >= 1 << 20 else 61
    rows = rand.size // cols
    assert rows >= 40, "gpu_check: need at least 40 rows of random values"
    x = rand[: rows * cols].copy().reshape(rows, cols)
    x[1, 5], x[2, 40], x[3, 17] = np.nan, np.inf, -np.inf
    x[16:32, 16:32] = 0.0
    x[33, 0:16] = np.float32(1e-30)
    x[34, 0:16] = np.float32(2.0**-140) * np.arange(16)
    ties = nvfp4_boundary_tiles("16x16", "te", grid=(1, 2), seed=4)
    x[-16:, :32] = ties
    x[-20, 32:48] = nvfp4_boundary_tiles("1x16", "te", grid=(1, 1), seed=5)
    return x


def _nvfp4_checks(dev: str, rand: np.ndarray, record) -> None:
    import torch

    from fp8sim.backends.triton_backend import TritonBackend
    from fp8sim.kernels.nvfp4_quantize import nvfp4_quantize as nvfp4_kernel
    from fp8sim.hadamard import rht as rht_ref
    from fp8sim.nvfp4 import NVFP4_VARIANTS, pack_e2m1, quantize_nvfp4_2d

    tb = TritonBackend()
    x = _nvfp4_input(rand)
    xd = torch.from_numpy(x).to(dev)

    def bits(a) -> np.ndarray:
        a = np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a, dtype=np.float32)
        return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)

    cases = [(lay, var, "rne", {}) for lay in ("1x16", "16x1", "16x16") for var in NVFP4_VARIANTS]
    cases += [(lay, "te", "stochastic", {}) for lay in ("1x16", "16x1", "16x16")]
    cases += [("1x16", "te", "rne", {"global_amax": 3.0}), ("16x16", "torchao", "rne", {"global_amax": 3.0})]
    for lay, var, rounding, kw in cases:
        seed = 31 if rounding == "stochastic" else None
        ref = quantize_nvfp4_2d(x, lay, var, rounding=rounding, seed=seed, **kw)
        q = nvfp4_kernel(xd, lay, var, rounding=rounding, seed=seed, **kw)
        bad = int((q.codes.cpu().numpy() != pack_e2m1(ref.codes)).sum())
        bad += int((q.block_codes.cpu().numpy() != ref.block_codes).sum())
        bad += int((bits(q.block_scale) != bits(ref.block_scale)).sum())
        bad += int((bits(q.block_amax) != bits(ref.block_amax)).sum())
        bad += int(bits(q.tensor_scale) != bits(ref.tensor_scale)) + int(bits(q.global_amax) != bits(ref.global_amax))
        extra = f" global_amax={kw['global_amax']}" if kw else ""
        record(f"nvfp4 {lay} {var} {rounding}{extra}", bad, x.size)
    c, s, a = tb.block_quantize(xd, "e2m1", "nvfp4:2d")
    ref = quantize_nvfp4_2d(x, "16x16", "te")
    bad = int((c.cpu().numpy() != ref.codes).sum()) + int((bits(s) != bits(ref.block_scale)).sum())
    record("block_quantize e2m1 nvfp4:2d (backend)", bad + int((bits(a) != bits(ref.block_amax)).sum()), x.size)

    xr = x[:, : x.shape[1] // 16 * 16]
    rows16 = x[: x.shape[0] // 16 * 16]
    for arr, axis, signs, inverse in ((xr, -1, "te", False), (rows16, 0, 12345, False),
                                      (xr, -1, 777, True)):
        got = tb.rht(torch.from_numpy(np.ascontiguousarray(arr)).to(dev), axis, signs, inverse=inverse)
        want = rht_ref(arr, axis, signs, inverse=inverse)
        record(f"rht axis={axis} signs={signs} inverse={inverse}", int((bits(got) != bits(want)).sum()), arr.size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=24, help="random values per format: 2**log2n")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter run)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--only", choices=("all", "nvfp4"), default="all",
                    help="nvfp4: only the NVFP4 quantize and RHT checks")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dev = _device()
    if dev is None:
        print("gpu_check: no CUDA GPU visible (and TRITON_INTERPRET unset): nothing checked", file=sys.stderr)
        return 0
    if dev == "cpu" and not args.smoke:
        print("gpu_check: TRITON_INTERPRET is set; use --smoke for a tiny CPU run", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = run_checks(dev, 12 if args.smoke else args.log2n, args.only)
    failed = [r for r in results if not r["ok"]]
    summary = {"device": dev, "checks": len(results), "failed": len(failed),
               "seconds": round(time.perf_counter() - t0, 1), "results": results}
    if dev == "cuda":
        import torch

        summary["device"] = torch.cuda.get_device_name()
    print(f"gpu_check: {len(results) - len(failed)}/{len(results)} passed on {summary['device']} "
          f"in {summary['seconds']} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
