"""scaled_mm: ``(decode(a) @ decode(b)) * a_scale_inv * b_scale_inv``, accumulated in float32.

a (M, K) and b (K, N) are code tensors (any strides); scales are per tensor, per row of a
(M, 1) or per column of b (1, N). The operands reach ``tl.dot`` three ways (``DOT``):

* ``2`` native: e4m3/e5m2 codes bitcast to ``tl.float8e4nv`` / ``tl.float8e5`` (GPU tensor cores,
  sm_89+). Hopper's FP8 MMA adds products with fewer than float32's bits (about 14, DeepSeek-V3
  section 3.3.2); Triton's default on sm_90 lets it accumulate the whole K that way
  (``max_num_imprecise_acc = 2**30``), measured on an H200 at up to ~1.2e-3 of sum |a||b| for
  K = 4096. The kernel instead adds each ``BLOCK_K`` slice's MMA result into the float32
  accumulator (``max_num_imprecise_acc = BLOCK_K``, as cuBLAS without fast accumulation and
  DeepSeek-V3's 128-element promotion do), so the error stays within ``2**-12`` of sum |a||b|.
* ``1`` float16: the software decode, then float16 operands (exact: every value of an 8-bit
  format is a float16) on tensor cores -- the GPU path of the other formats.
* ``0`` float32: the software decode, float32 operands, ``input_precision="ieee"`` -- the
  interpreter's path. Its fp8 dot is usable for finite values, but it decodes fp8 NaN/inf codes
  as finite numbers, so the exact software decode is used there instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8sim.formats import FloatFormat, get_format
from fp8sim.kernels.cast import bf16_bits, decode_args, decode_f32, is_interpreter

__all__ = ["scaled_mm", "dot_path", "aot_variants"]

_NATIVE = {"e4m3": 1, "e5m2": 2}


@triton.jit
def _scaled_mm_kernel(
    a_ptr,  # a codes (M, K), uint8, any strides
    b_ptr,  # b codes (K, N), uint8, any strides
    c_ptr,  # output (M, N), float32 / float16 (bfloat16 as int16 bits), contiguous
    sa_ptr,  # float32 a_scale_inv: 1 value or one per row of a
    sb_ptr,  # float32 b_scale_inv: 1 value or one per column of b
    n_m, n_n, n_k,  # problem sizes M, N, K
    stride_am, stride_ak, stride_bk, stride_bn,  # element strides of a and b
    SA_ROW: tl.constexpr,  # 1: a_scale_inv per row
    SB_COL: tl.constexpr,  # 1: b_scale_inv per column
    DOT: tl.constexpr,  # 0 float32 decode, 1 float16 decode, 2 native fp8
    OUT_BF16: tl.constexpr,  # 1: c_ptr is an int16 view of bfloat16 output
    FAST_ACCUM: tl.constexpr,  # 1: native dot accumulates with the MMA's narrow adds (DOT == 2)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile sizes
    GROUP_M: tl.constexpr,  # rows of tiles walked together (L2 reuse)
    A_NATIVE: tl.constexpr, A_M: tl.constexpr, A_BIAS: tl.constexpr, A_MAG_BITS: tl.constexpr,
    A_SIGNED: tl.constexpr, A_HAS_SUB: tl.constexpr, A_NAN_KIND: tl.constexpr,
    A_NAN_CODE: tl.constexpr, A_INF_CODE: tl.constexpr, A_SUB_SCALE: tl.constexpr,
    B_NATIVE: tl.constexpr, B_M: tl.constexpr, B_BIAS: tl.constexpr, B_MAG_BITS: tl.constexpr,
    B_SIGNED: tl.constexpr, B_HAS_SUB: tl.constexpr, B_NAN_KIND: tl.constexpr,
    B_NAN_CODE: tl.constexpr, B_INF_CODE: tl.constexpr, B_SUB_SCALE: tl.constexpr,
):
    # grouped tile order: GROUP_M rows of tiles share their b columns in L2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(n_m, BLOCK_M)
    tiles_n = tl.cdiv(n_n, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_k, BLOCK_K):
        a_mask = (rm[:, None] < n_m) & (rk[None, :] < n_k - k0)
        b_mask = (rk[:, None] < n_k - k0) & (rn[None, :] < n_n)
        a = tl.load(a_ptrs, mask=a_mask, other=0)  # code 0 is +0 in every GEMM format
        b = tl.load(b_ptrs, mask=b_mask, other=0)
        if DOT == 2:  # hardware fp8 operands (constexpr branches: one is compiled)
            if A_NATIVE == 1:
                a_op = a.to(tl.float8e4nv, bitcast=True)
            else:
                a_op = a.to(tl.float8e5, bitcast=True)
            if B_NATIVE == 1:
                b_op = b.to(tl.float8e4nv, bitcast=True)
            else:
                b_op = b.to(tl.float8e5, bitcast=True)
            if FAST_ACCUM:  # the MMA's own narrow adds over all of K (Triton's sm_90 default)
                acc = tl.dot(a_op, b_op, acc)
            else:  # each BLOCK_K slice added into the float32 accumulator
                acc = tl.dot(a_op, b_op, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            a_val = decode_f32(a.to(tl.int32), A_M, A_BIAS, A_MAG_BITS, A_SIGNED, A_HAS_SUB,
                               A_NAN_KIND, A_NAN_CODE, A_INF_CODE, A_SUB_SCALE)
            b_val = decode_f32(b.to(tl.int32), B_M, B_BIAS, B_MAG_BITS, B_SIGNED, B_HAS_SUB,
                               B_NAN_KIND, B_NAN_CODE, B_INF_CODE, B_SUB_SCALE)
            if DOT == 1:  # exact: every 8-bit-format value is a float16
                acc = tl.dot(a_val.to(tl.float16), b_val.to(tl.float16), acc)
            else:
                acc = tl.dot(a_val, b_val, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SA_ROW:
        sa = tl.load(sa_ptr + rm, mask=rm < n_m, other=1.0)[:, None]
    else:
        sa = tl.load(sa_ptr)
    if SB_COL:
        sb = tl.load(sb_ptr + rn, mask=rn < n_n, other=1.0)[None, :]
    else:
        sb = tl.load(sb_ptr)
    c = (acc * sa) * sb
    c_mask = (rm[:, None] < n_m) & (rn[None, :] < n_n)
    if OUT_BF16:
        tl.store(c_ptr + rm[:, None] * n_n + rn[None, :], bf16_bits(c), mask=c_mask)
    else:
        tl.store(c_ptr + rm[:, None] * n_n + rn[None, :], c.to(c_ptr.dtype.element_ty), mask=c_mask)


def dot_path(a_fmt: FloatFormat, b_fmt: FloatFormat, device: torch.device, native: bool) -> int:
    """The ``DOT`` mode used for these operands (see the module docstring)."""
    if is_interpreter() or device.type != "cuda":
        return 0
    if native and a_fmt.name in _NATIVE and b_fmt.name in _NATIVE:
        if torch.cuda.get_device_capability(device) >= (8, 9):
            return 2
    return 1


def scaled_mm(
    a: torch.Tensor,
    a_fmt: FloatFormat | str,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_fmt: FloatFormat | str,
    b_scale_inv: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    native: bool = True,
    fast_accum: bool = False,
    blocks: tuple[int, int, int] | None = None,
    num_warps: int = 8,
    num_stages: int = 3,
) -> torch.Tensor:
    """``(decode(a) @ decode(b)) * a_scale_inv * b_scale_inv`` for uint8 codes a (M, K), b (K, N).

    ``a_scale_inv``: float32, 0-d or (M, 1); ``b_scale_inv``: 0-d or (1, N). ``native``: use
    fp8 tensor cores for e4m3/e5m2 operands on a GPU that has them. ``fast_accum`` (native
    only, like ``torch._scaled_mm(use_fast_accum=True)``): let the fp8 MMA accumulate all of K
    with its narrow internal adds instead of adding each ``BLOCK_K`` slice in float32.
    ``blocks`` (BLOCK_M, BLOCK_N, BLOCK_K), ``num_warps``, ``num_stages``: the GPU tiling.
    """
    a_fmt, b_fmt = get_format(a_fmt), get_format(b_fmt)
    for f in (a_fmt, b_fmt):
        if f.bits > 8 or not f.has_zero:
            raise NotImplementedError(f"triton scaled_mm: {f.name} operands (8-bit formats with a zero only)")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"scaled_mm: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    n_m, n_k = a.shape
    n_n = b.shape[1]
    dev = a.device
    dot = dot_path(a_fmt, b_fmt, dev, native)
    if blocks is None:
        blocks = (32, 32, 64) if is_interpreter() else ((256, 128, 128) if dot == 2 else (128, 128, 32))
    bm, bn, bk = blocks
    sa = a_scale_inv.to(device=dev, dtype=torch.float32).contiguous()
    sb = b_scale_inv.to(device=dev, dtype=torch.float32).contiguous()
    out = torch.empty((n_m, n_n), dtype=out_dtype, device=dev)
    if out.numel() == 0:
        return out
    if n_k == 0:
        return out.zero_()
    grid = (triton.cdiv(n_m, bm) * triton.cdiv(n_n, bn),)
    extra = {} if is_interpreter() else {"num_warps": num_warps, "num_stages": num_stages}
    _scaled_mm_kernel[grid](
        a.view(torch.uint8), b.view(torch.uint8),
        out.view(torch.int16) if out_dtype == torch.bfloat16 else out, sa, sb, n_m, n_n, n_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        SA_ROW=int(sa.dim() == 2), SB_COL=int(sb.dim() == 2), DOT=dot,
        OUT_BF16=int(out_dtype == torch.bfloat16), FAST_ACCUM=int(bool(fast_accum)),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        A_NATIVE=_NATIVE.get(a_fmt.name, 0), **decode_args(a_fmt, "A_"),
        B_NATIVE=_NATIVE.get(b_fmt.name, 0), **decode_args(b_fmt, "B_"),
        **extra,
    )
    return out


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    out: dict = {}
    mm_types = {"a_ptr": "*u8", "b_ptr": "*u8", "c_ptr": "*fp32", "sa_ptr": "*fp32",
                "sb_ptr": "*fp32", "n_m": "i32", "n_n": "i32", "n_k": "i32", "stride_am": "i32",
                "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32"}
    for name, fa, fb, dot, bk in [("scaled_mm_e4m3_native", "e4m3", "e4m3", 2, 128),
                                  ("scaled_mm_e4m3_e5m2_native", "e4m3", "e5m2", 2, 128),
                                  ("scaled_mm_e3m4_fp16", "e3m4", "e4m3fnuz", 1, 32)]:
        out[name] = (_scaled_mm_kernel, mm_types,
                     dict(SA_ROW=1, SB_COL=1, DOT=dot, OUT_BF16=0, FAST_ACCUM=0, BLOCK_M=128,
                          BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, A_NATIVE=_NATIVE.get(fa, 0),
                          **decode_args(fa, "A_"), B_NATIVE=_NATIVE.get(fb, 0),
                          **decode_args(fb, "B_")),
                     {"num_warps": 8, "num_stages": 3})
    return out
