"""Compile the kernels for a GPU target without a GPU (ahead of time), and inspect the PTX.

Triton compiles to PTX and cubin for any ``GPUTarget`` with the ``ptxas`` it ships, no device
needed. That checks, on a CPU-only machine, what the interpreter cannot: that every kernel
variant (hardware fp8 casts, fp8 tensor-core dot) lowers for sm_90, and that the instructions
the bit-exactness argument relies on are the ones emitted -- ``div.rn``/``sqrt.rn`` and no
contracted ``fma`` in the Adam step, ``cvt.rn.satfinite`` for the native cast, ``wgmma`` on fp8
operands for the GEMM.

Targets: ``--arch 90`` (Hopper: H100/H200, PTX for ``sm_90a``) and ``--arch 100`` (Blackwell
B200/GB200, ``sm_100a``); Triton assembles both with the CUDA 13 ``ptxas`` it ships (named
``ptxas-blackwell``). On sm_100 float32 arithmetic may come out as the paired ``.f32x2``
instructions (each lane an IEEE operation, rounded to nearest even), which the counts include.

Run in a process where ``TRITON_INTERPRET`` is unset (``triton.jit`` returns interpreter
functions otherwise): ``python -m fp8sim.kernels.aot [--arch 90] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

__all__ = ["list_variants", "compile_variant", "ptx_facts", "main"]


def _variants() -> dict:
    """name -> (kernel, {arg: triton type}, {constexpr: value}, options), each op file's
    ``aot_variants()`` together."""
    from fp8sim.kernels import (adam, amax, block_quantize, cast_transpose, dequantize, nvfp4_quantize,
                                quantize, rht, scaled_mm)

    out: dict = {}
    for module in (quantize, amax, dequantize, cast_transpose, block_quantize, scaled_mm, adam,
                   nvfp4_quantize, rht):
        out.update(module.aot_variants())
    return out


def compile_variant(name: str, arch: int = 90):
    """Compile one variant (see :func:`list_variants`) for ``sm_<arch>``; returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, constexprs, options = _variants()[name]
    sig = {a: ("constexpr" if a in constexprs else types[a]) for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))


def ptx_facts(ptx: str) -> dict:
    """Counts of the PTX instructions the bit-exactness argument is about."""
    pats = {
        "fma_f32": r"\bfma\.rn(\.ftz)?\.f32(x2)?\b",  # f32x2: sm_100's paired float32 ops
        "div_rn_f32": r"\bdiv\.rn\.f32\b",
        "div_approx_f32": r"\bdiv\.(approx|full)(\.ftz)?\.f32\b",
        "sqrt_rn_f32": r"\bsqrt\.rn\.f32\b",
        "sqrt_approx_f32": r"\bsqrt\.approx(\.ftz)?\.f32\b",
        "ftz": r"\.ftz\.",
        "cvt_e4m3": r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b",
        "cvt_e5m2": r"\bcvt\.rn\.satfinite\.e5m2x2\.f32\b",
        "wgmma_e4m3": r"\bwgmma\.mma_async\S*\.e4m3\b",
        "wgmma_e5m2": r"\bwgmma\.mma_async\S*\.e5m2\b",
        "wgmma_f16": r"\bwgmma\.mma_async\S*\.f16\.f16\b",
        "add_f32": r"\badd(\.rn)?\.f32(x2)?\b",
        "sub_f32": r"\bsub(\.rn)?\.f32(x2)?\b",
    }
    return {k: len(re.findall(p, ptx)) for k, p in pats.items()}


def list_variants() -> list[str]:
    """Names of the compiled variants (one per kernel and interesting constexpr choice)."""
    return list(_variants())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8sim.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90,
                        help="compute capability, e.g. 90 (H100/H200) or 100 (B200/GB200)")
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--json", action="store_true", help="print the PTX facts as JSON")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("fp8sim.kernels.aot: unset TRITON_INTERPRET (interpreter functions cannot be compiled)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = {}
    for name in args.only or list_variants():
        t0 = time.perf_counter()
        kernel = compile_variant(name, args.arch)
        facts = ptx_facts(kernel.asm["ptx"])
        facts["seconds"] = round(time.perf_counter() - t0, 2)
        result[name] = facts
        if not args.json:
            print(name, facts, file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
