"""Compile the kernels for a GPU target without a GPU (ahead of time), and inspect the PTX.

Triton compiles to PTX and cubin for any ``GPUTarget`` with the ``ptxas`` it ships, no device
needed. That checks, on a CPU-only machine, what the interpreter cannot: that every kernel
variant (hardware fp8 casts, fp8 tensor-core dot) lowers for sm_90, and that the instructions
the bit-exactness argument relies on are the ones emitted -- ``div.rn``/``sqrt.rn`` and no
contracted ``fma`` in the Adam step, ``cvt.rn.satfinite`` for the native cast, ``wgmma`` on fp8
operands for the GEMM.

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
    """name -> (kernel, {arg: triton type}, {constexpr: value}, options)."""
    from fp8sim.kernels import adam, amax, block_quantize, cast_transpose, dequantize, quantize, scaled_mm
    from fp8sim.kernels._cast import cast_args, decode_args

    out: dict = {}
    q_types = {"x_ptr": "*fp32", "scale_ptr": "*fp32", "codes_ptr": "*u8", "amax_ptr": "*fp32",
               "seed": "i64", "n_rows": "i32", "n_cols": "i32", "stride_r": "i32",
               "stride_c": "i32"}
    for name, fmt, rnd, native, x_ty in [
        ("quantize_e4m3_rne", "e4m3", "rne", 0, "*bf16"),
        ("quantize_e5m2_stochastic", "e5m2", "stochastic", 0, "*fp32"),
        ("quantize_e4m3_native", "e4m3", "rne", 1, "*bf16"),
        ("quantize_e5m2_native", "e5m2", "rne", 2, "*fp32"),
    ]:
        fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
        out[name] = (quantize._quantize_kernel, {**q_types, "x_ptr": x_ty},
                     dict(SCALE_MODE=0, CONTIGUOUS=True, NATIVE=native, FMAX=fmax, BLOCK=2048,
                          **cast_args(fmt, rnd, True)), {"num_warps": 8})
    out["quantize_fp16_rowscale_strided"] = (
        quantize._quantize_kernel, {**q_types, "codes_ptr": "*u16"},
        dict(SCALE_MODE=1, CONTIGUOUS=False, NATIVE=0, FMAX=65504.0, BLOCK=2048,
             **cast_args("fp16", "rtz", False)), {"num_warps": 8})
    out["amax"] = (amax._amax_kernel, {"x_ptr": "*bf16", "partial_ptr": "*fp32", "n_rows": "i32",
                                       "n_cols": "i32", "stride_r": "i32", "stride_c": "i32"},
                   dict(BLOCK=4096), {"num_warps": 8})
    out["dequantize_e5m2_bf16"] = (
        dequantize._dequantize_kernel,
        {"codes_ptr": "*u8", "scale_inv_ptr": "*fp32", "out_ptr": "*i16", "n_rows": "i32",
         "n_cols": "i32", "stride_r": "i32", "stride_c": "i32"},
        dict(SCALE_MODE=0, OUT_BF16=1, BLOCK=2048, **decode_args("e5m2")), {"num_warps": 8})
    out["cast_transpose_e4m3_stochastic"] = (
        cast_transpose._cast_transpose_kernel,
        {"x_ptr": "*bf16", "scale_ptr": "*fp32", "codes_ptr": "*u8", "codes_t_ptr": "*u8",
         "amax_ptr": "*fp32", "seed": "i64", "n_rows": "i32", "n_cols": "i32",
         "stride_r": "i32", "stride_c": "i32"},
        dict(SCALE_MODE=0, BLOCK_M=64, BLOCK_N=64, **cast_args("e4m3", "stochastic", True)),
        {"num_warps": 8})
    bq_types = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scale_inv_ptr": "*fp32",
                "amax_ptr": "*fp32", "e8m0_ptr": "*u8", "seed": "i64", "n_rows": "i32",
                "n_cols": "i32", "sx_r": "i32", "sx_c": "i32", "sc_r": "i32", "sc_c": "i32",
                "cnt_r": "i32", "cnt_c": "i32", "ss_r": "i32", "ss_c": "i32", "eps": "fp32",
                "margin_div": "fp32"}
    for name, tile, block, mx in [("block_quantize_mx", (1, 32), (16, 32), 1),
                                  ("block_quantize_128x128", (128, 128), (128, 128), 0)]:
        out[name] = (block_quantize._block_quantize_kernel, bq_types,
                     dict(TILE_R=tile[0], TILE_C=tile[1], BLOCK_R=block[0], BLOCK_C=block[1],
                          MX=mx, RCEIL=mx, POW2=1 - mx, FMAX=448.0, EMAX=8, RCP_MAX=1 / 448.0,
                          F32_MAX=3.4028234663852886e38, **cast_args("e4m3", "rne", True)),
                     {"num_warps": 8, "enable_fp_fusion": False})
    mm_types = {"a_ptr": "*u8", "b_ptr": "*u8", "c_ptr": "*fp32", "sa_ptr": "*fp32",
                "sb_ptr": "*fp32", "n_m": "i32", "n_n": "i32", "n_k": "i32", "stride_am": "i32",
                "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32"}
    for name, fa, fb, dot, bk in [("scaled_mm_e4m3_native", "e4m3", "e4m3", 2, 128),
                                  ("scaled_mm_e4m3_e5m2_native", "e4m3", "e5m2", 2, 128),
                                  ("scaled_mm_e3m4_fp16", "e3m4", "e4m3fnuz", 1, 32)]:
        native = {"e4m3": 1, "e5m2": 2}
        out[name] = (scaled_mm._scaled_mm_kernel, mm_types,
                     dict(SA_ROW=1, SB_COL=1, DOT=dot, OUT_BF16=0, FAST_ACCUM=0, BLOCK_M=128, BLOCK_N=128,
                          BLOCK_K=bk, GROUP_M=8, A_NATIVE=native.get(fa, 0),
                          **decode_args(fa, "A_"), B_NATIVE=native.get(fb, 0),
                          **decode_args(fb, "B_")),
                     {"num_warps": 8, "num_stages": 3})
    e_args = cast_args("e4m3", "stochastic", True)
    h_args = cast_args("fp16", "stochastic", True)
    consts = dict(BLOCK=1024, MODE=e_args.pop("MODE"), SATURATE=e_args.pop("SATURATE"),
                  K=e_args.pop("K"))
    for key in ("MODE", "SATURATE", "K"):
        h_args.pop(key)
    consts.update({"E_" + k: v for k, v in e_args.items()})
    consts.update(decode_args("e4m3", "D_"))
    consts.update({"H_" + k: v for k, v in h_args.items()})
    adam_types = {"p_ptr": "*i16", "g_ptr": "*bf16", "m_ptr": "*u8", "v_ptr": "*i16",
                  "scal_ptr": "*fp32", "amax_ptr": "*fp32", "n": "i32", "seed_p": "i64",
                  "seed_m": "i64", "seed_v": "i64"}
    for c in ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "bias_correction1",
              "bias_correction2", "eps", "lr", "decay"):
        adam_types[c] = "fp32"
    out["adam_e4m3_stochastic"] = (adam._adam_kernel, adam_types, consts,
                                   {"num_warps": 4, "enable_fp_fusion": False})
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
        "fma_f32": r"\bfma\.rn(\.ftz)?\.f32\b",
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
        "add_f32": r"\badd(\.rn)?\.f32\b",
    }
    return {k: len(re.findall(p, ptx)) for k, p in pats.items()}


def list_variants() -> list[str]:
    """Names of the compiled variants (one per kernel and interesting constexpr choice)."""
    return list(_variants())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8sim.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
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
