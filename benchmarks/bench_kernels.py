"""Triton kernel speed on a GPU, as ratios against the hardware's yardsticks, in one process.

    python benchmarks/bench_kernels.py [--log2n 28] [--sizes 4096 8192] [--json]

Rows:
* quantize + fused amax (bfloat16 -> e4m3, per-tensor scale): software cast and native cast,
  as achieved bandwidth (bytes read + written per second) and as a share of a device-to-device
  copy of the same input (bytes read + written; the bandwidth limit). Target: >= 85% native.
* NVFP4 quantize (bfloat16 -> packed E2M1 + E4M3 block scales, 1x16 and 16x16 tiles, te
  rules): with its tensor-amax pass, and with a given tensor amax (one pass); and the RHT
  (bfloat16 in, float32 out), as achieved bandwidth and as a share of the device copy.
* scaled GEMM at M = N = K in ``--sizes``: TFLOP/s of the Triton kernel (native fp8 dot) against
  ``torch._scaled_mm`` (cuBLASLt) with the same accumulation (float32 adds of K slices; and
  ``fast_accum`` against ``use_fast_accum=True``), and a bfloat16 ``torch.matmul``.
  Target: >= 0.9x _scaled_mm.
Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs).

Without a CUDA GPU (or with TRITON_INTERPRET=1) there is nothing to measure: the script says so
on stderr and exits 0.

Needs a CUDA GPU and Triton: pip install -e '.[gpu]' (from a checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _no_gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels would run in the CPU interpreter"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def bench_quantize(log2n: int) -> list[dict]:
    import torch
    from triton.testing import do_bench

    from fp8sim.kernels.quantize import quantize

    n = 1 << log2n
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 100
    scale = torch.tensor(2.0, device="cuda")
    dst = torch.empty_like(x)
    t_copy = do_bench(lambda: dst.copy_(x), return_mode="median")
    copy_bw = 2 * x.numel() * x.element_size() / (t_copy * 1e-3)
    rows = [{"op": "device copy (bf16)", "ms": t_copy, "GB/s": copy_bw / 1e9, "of_copy": 1.0}]
    moved = x.numel() * x.element_size() + x.numel() * 1  # read bf16, write one byte per element
    for native in (False, True):
        t = do_bench(lambda: quantize(x, "e4m3", scale, native=native), return_mode="median")
        bw = moved / (t * 1e-3)
        rows.append({"op": f"quantize+amax e4m3 ({'native' if native else 'software'} cast)",
                     "ms": t, "GB/s": bw / 1e9, "of_copy": bw / copy_bw})
    return rows


def bench_nvfp4(log2n: int) -> list[dict]:
    import torch
    from triton.testing import do_bench

    from fp8sim.kernels.nvfp4_quantize import nvfp4_quantize
    from fp8sim.kernels.rht import rht

    n = 1 << log2n
    x = (torch.randn(n, device="cuda", dtype=torch.bfloat16) * 100).reshape(-1, 4096)
    dst = torch.empty_like(x)
    t_copy = do_bench(lambda: dst.copy_(x), return_mode="median")
    copy_bw = 2 * x.numel() * x.element_size() / (t_copy * 1e-3)
    # bytes read and written: x (bf16) once per pass; packed codes n/2; per 16 elements one
    # E4M3 code and two float32 (the decoded block scale and the block amax)
    outs = n // 2 + (n // 16) * 9
    rows = []
    for layout in ("1x16", "16x16"):
        for ga, passes in ((None, 2), (100.0, 1)):
            t = do_bench(lambda: nvfp4_quantize(x, layout, global_amax=ga), return_mode="median")
            bw = (passes * 2 * n + outs) / (t * 1e-3)
            label = "amax pass + quantize" if ga is None else "given tensor amax"
            rows.append({"op": f"nvfp4 quantize {layout} te ({label})", "ms": t, "GB/s": bw / 1e9,
                         "of_copy": bw / copy_bw})
    t = do_bench(lambda: rht(x, -1, "te"), return_mode="median")
    bw = (2 * n + 4 * n) / (t * 1e-3)
    rows.append({"op": "rht along rows (bf16 -> fp32)", "ms": t, "GB/s": bw / 1e9, "of_copy": bw / copy_bw})
    return rows


def bench_gemm(size: int) -> list[dict]:
    import torch
    from triton.testing import do_bench

    from fp8sim.kernels.scaled_mm import scaled_mm

    m = n = k = size
    a = (torch.randn(m, k, device="cuda") * 10).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda") * 10).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    flops = 2.0 * m * n * k
    rows = []

    def triton_mm(fast):
        return lambda: scaled_mm(a.view(torch.uint8), "e4m3", one, b.view(torch.uint8).t(), "e4m3",
                                 one, out_dtype=torch.bfloat16, fast_accum=fast)

    def torch_mm(fast):
        return lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    # (name, function, the row it is compared with): precise with precise, fast with fast
    fns = [
        ("triton scaled_mm", triton_mm(False), "torch._scaled_mm"),
        ("torch._scaled_mm", torch_mm(False), "torch._scaled_mm"),
        ("triton scaled_mm fast_accum", triton_mm(True), "torch._scaled_mm fast_accum"),
        ("torch._scaled_mm fast_accum", torch_mm(True), "torch._scaled_mm fast_accum"),
        ("bf16 matmul", (lambda ab=a.to(torch.bfloat16), bb=b.to(torch.bfloat16).t(): ab @ bb),
         "torch._scaled_mm"),
    ]
    times = {}
    for name, fn, _ in fns:
        try:
            t = do_bench(fn, return_mode="median")
            times[name] = t
            rows.append({"op": f"{name} {size}^3", "ms": t, "TFLOP/s": flops / (t * 1e-3) / 1e12})
        except Exception as exc:  # report what failed, keep measuring the rest
            rows.append({"op": f"{name} {size}^3", "error": f"{type(exc).__name__}: {exc}"[:200]})
    for (name, _, ref), r in zip(fns, rows[-len(fns):]):
        if "ms" in r and ref in times:
            r["vs_scaled_mm"] = times[ref] / r["ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=28, help="quantize: 2**log2n elements")
    ap.add_argument("--sizes", type=int, nargs="*", default=[4096, 8192], help="GEMM M=N=K")
    ap.add_argument("--json", action="store_true", help="print rows as JSON")
    args = ap.parse_args(argv)
    reason = _no_gpu_reason()
    if reason:
        print(f"bench_kernels: nothing measured ({reason}); run on a CUDA GPU", file=sys.stderr)
        return 0
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = bench_quantize(args.log2n)
    rows += bench_nvfp4(args.log2n)
    for size in args.sizes:
        rows += bench_gemm(size)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return 0
    print(f"# {meta['device']}, torch {meta['torch']}")
    print(f"{'op':48s} {'ms':>9s} {'GB/s':>8s} {'TFLOP/s':>8s} {'ratio':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:48s} error: {r['error']}")
            continue
        ratio = r.get("of_copy", r.get("vs_scaled_mm", float("nan")))
        print(f"{r['op']:48s} {r['ms']:9.3f} {r.get('GB/s', float('nan')):8.1f} "
              f"{r.get('TFLOP/s', float('nan')):8.1f} {ratio:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
