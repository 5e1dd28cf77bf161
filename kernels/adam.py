"""adam: the fused FP8-LM AdamW step (MS-AMP O2 state layout), one pass over the state.

State per element: master weight float16 holding ``w * param_scale``, first moment as codes of
an 8-bit format (e4m3) holding ``m * exp_avg_scale``, second moment float16 holding
``v * exp_avg_sq_scale``. Each is decoded with its ``scale_inv``, updated in float32 with one
rounding per operation (the recipe of ``fp8sim.backends.base.Backend.adam_step``; ``div_rn`` and
``sqrt_rn`` are IEEE on the GPU, and launches there pass ``enable_fp_fusion=False`` so no
multiply-add is contracted), re-encoded with the software cast under the new scales, and each
program writes ``max |w|, max |m|, max |v|`` of the new float32 values for the next scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8sim.formats import FloatFormat, get_format
from fp8sim.kernels.cast import cast_args, decode_args, decode_f32, encode_f32, is_interpreter

__all__ = ["adam_step", "SCALARS", "aot_variants"]

#: order of the float32 scalars in the ``scalars`` tensor the kernel reads
SCALARS = ("param_scale_inv", "exp_avg_scale_inv", "exp_avg_sq_scale_inv", "grad_scale_inv",
           "param_scale", "exp_avg_scale", "exp_avg_sq_scale")


@triton.jit
def _amax_nan(x, mask):
    """max |x| over the masked block, NaN if it holds a NaN."""
    is_nan = (x != x) & mask
    mag = tl.where(is_nan | (mask == 0), 0.0, tl.abs(x))
    nan_count = tl.sum(is_nan.to(tl.int32), axis=0)
    nan = (nan_count * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(nan_count > 0, nan, tl.max(mag, axis=0))


@triton.jit
def _adam_kernel(
    p_ptr,  # master weight, float16 bits as int16 (in/out)
    g_ptr,  # gradient, float16/bfloat16/float32 (in)
    m_ptr,  # first moment codes, uint8 (in/out)
    v_ptr,  # second moment, float16 bits as int16 (in/out)
    scal_ptr,  # float32[7]: the SCALARS, read on the device (no host sync)
    amax_ptr,  # float32 (programs, 3): partial amax of the new w, m, v
    n,  # number of elements
    seed_p, seed_m, seed_v,  # Philox keys of the three stochastic encodings
    beta1, one_minus_beta1, beta2, one_minus_beta2,  # float32 constants (adam_constants)
    bias_correction1, bias_correction2, eps, lr, decay,
    BLOCK: tl.constexpr,  # elements per program
    MODE: tl.constexpr, SATURATE: tl.constexpr, K: tl.constexpr,  # rounding of all three
    # first-moment format: encode (E_*) and decode (D_*) parameters
    E_M: tl.constexpr, E_EMIN: tl.constexpr, E_MAX_CODE: tl.constexpr, E_SIGN_MASK: tl.constexpr,
    E_SIGNED: tl.constexpr, E_HAS_SUB: tl.constexpr, E_NAN_KIND: tl.constexpr,
    E_NAN_CODE: tl.constexpr, E_INF_CODE: tl.constexpr,
    D_M: tl.constexpr, D_BIAS: tl.constexpr, D_MAG_BITS: tl.constexpr, D_SIGNED: tl.constexpr,
    D_HAS_SUB: tl.constexpr, D_NAN_KIND: tl.constexpr, D_NAN_CODE: tl.constexpr,
    D_INF_CODE: tl.constexpr, D_SUB_SCALE: tl.constexpr,
    # float16 encode parameters (master weight and second moment)
    H_M: tl.constexpr, H_EMIN: tl.constexpr, H_MAX_CODE: tl.constexpr, H_SIGN_MASK: tl.constexpr,
    H_SIGNED: tl.constexpr, H_HAS_SUB: tl.constexpr, H_NAN_KIND: tl.constexpr,
    H_NAN_CODE: tl.constexpr, H_INF_CODE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # flat index: the stochastic counter
    mask = offs < n
    p_sinv = tl.load(scal_ptr + 0)
    m_sinv = tl.load(scal_ptr + 1)
    v_sinv = tl.load(scal_ptr + 2)
    g_sinv = tl.load(scal_ptr + 3)
    p_s = tl.load(scal_ptr + 4)
    m_s = tl.load(scal_ptr + 5)
    v_s = tl.load(scal_ptr + 6)

    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * g_sinv
    w = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    w = w * p_sinv
    mc = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = decode_f32(mc, D_M, D_BIAS, D_MAG_BITS, D_SIGNED, D_HAS_SUB, D_NAN_KIND, D_NAN_CODE,
                   D_INF_CODE, D_SUB_SCALE) * m_sinv
    v = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    v = v * v_sinv

    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = tl.sqrt_rn(tl.div_rn(v, bias_correction2)) + eps
    u = tl.div_rn(tl.div_rn(m, bias_correction1), denom)
    w = w * decay - lr * u

    if MODE == 6:
        r_p = tl.randint(seed_p, offs)
        r_m = tl.randint(seed_m, offs)
        r_v = tl.randint(seed_v, offs)
    else:
        r_p = offs.to(tl.uint32)  # unused
        r_m = r_p
        r_v = r_p
    code_p = encode_f32(w * p_s, r_p, H_M, H_EMIN, H_MAX_CODE, H_SIGN_MASK, H_SIGNED, H_HAS_SUB,
                        H_NAN_KIND, H_NAN_CODE, H_INF_CODE, MODE, SATURATE, K)
    code_m = encode_f32(m * m_s, r_m, E_M, E_EMIN, E_MAX_CODE, E_SIGN_MASK, E_SIGNED, E_HAS_SUB,
                        E_NAN_KIND, E_NAN_CODE, E_INF_CODE, MODE, SATURATE, K)
    code_v = encode_f32(v * v_s, r_v, H_M, H_EMIN, H_MAX_CODE, H_SIGN_MASK, H_SIGNED, H_HAS_SUB,
                        H_NAN_KIND, H_NAN_CODE, H_INF_CODE, MODE, SATURATE, K)
    tl.store(p_ptr + offs, code_p.to(tl.int16), mask=mask)
    tl.store(m_ptr + offs, code_m.to(tl.uint8), mask=mask)
    tl.store(v_ptr + offs, code_v.to(tl.int16), mask=mask)

    tl.store(amax_ptr + pid * 3 + 0, _amax_nan(w, mask))
    tl.store(amax_ptr + pid * 3 + 1, _amax_nan(m, mask))
    tl.store(amax_ptr + pid * 3 + 2, _amax_nan(v, mask))


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: torch.Tensor,
    consts: dict,
    *,
    exp_avg_fmt: FloatFormat | str = "e4m3",
    rounding: str = "rne",
    saturate: bool = True,
    seed: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Update ``param`` (float16), ``exp_avg`` (uint8 codes), ``exp_avg_sq`` (float16) in place.

    ``scalars``: float32 tensor of the 7 :data:`SCALARS`; ``consts``: the float32 constants of
    ``fp8sim.backends.base.adam_constants``. Returns the amaxes of the new w, m, v (float32 (3,)).
    Non-contiguous state is updated through contiguous copies. ``block``: elements per program.
    """
    fmt = get_format(exp_avg_fmt)
    e_args = cast_args(fmt, rounding, saturate)
    h_args = cast_args("fp16", rounding, saturate)
    mode, sat, k = e_args.pop("MODE"), e_args.pop("SATURATE"), e_args.pop("K")
    for key in ("MODE", "SATURATE", "K"):
        h_args.pop(key)
    if rounding == "stochastic" and seed is None:
        raise ValueError("rounding='stochastic' needs seed=")
    seed = 0 if seed is None else int(seed)
    n = param.numel()
    if n >= 2**31:
        raise ValueError(f"adam_step: at most 2**31 - 1 elements per call, got {n}")
    tensors = [param, grad, exp_avg, exp_avg_sq]
    work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    blk = block or (8192 if is_interpreter() else 1024)  # interpreter: fewer programs, faster
    programs = max(triton.cdiv(n, blk), 1)
    partial = torch.zeros((programs, 3), dtype=torch.float32, device=param.device)
    extra = {} if is_interpreter() else {"num_warps": 4, "enable_fp_fusion": False}
    if n:
        _adam_kernel[(programs,)](
            work[0].view(torch.int16), work[1], work[2], work[3].view(torch.int16),
            scalars.to(device=param.device, dtype=torch.float32).contiguous(), partial, n,
            seed, seed + 1, seed + 2,
            *(float(consts[c]) for c in ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
                                         "bias_correction1", "bias_correction2", "eps", "lr",
                                         "decay")),
            BLOCK=blk, MODE=mode, SATURATE=sat, K=k,
            **{"E_" + key: val for key, val in e_args.items()},
            **decode_args(fmt, "D_"),
            **{"H_" + key: val for key, val in h_args.items()},
            **extra,
        )
    for orig, w in zip(tensors, work):
        if w is not orig and orig is not grad:
            orig.copy_(w)
    return partial.amax(dim=0)


def aot_variants() -> dict:
    """Ahead-of-time compile variants of this file's kernel (:mod:`fp8sim.kernels.aot`):
    name -> (kernel, {argument: Triton type}, {constexpr: value}, compile options)."""
    e_args = cast_args("e4m3", "stochastic", True)
    h_args = cast_args("fp16", "stochastic", True)
    consts = dict(BLOCK=1024, MODE=e_args.pop("MODE"), SATURATE=e_args.pop("SATURATE"),
                  K=e_args.pop("K"))
    for key in ("MODE", "SATURATE", "K"):
        h_args.pop(key)
    consts.update({"E_" + k: v for k, v in e_args.items()})
    consts.update(decode_args("e4m3", "D_"))
    consts.update({"H_" + k: v for k, v in h_args.items()})
    types = {"p_ptr": "*i16", "g_ptr": "*bf16", "m_ptr": "*u8", "v_ptr": "*i16",
             "scal_ptr": "*fp32", "amax_ptr": "*fp32", "n": "i32", "seed_p": "i64",
             "seed_m": "i64", "seed_v": "i64"}
    for c in ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "bias_correction1",
              "bias_correction2", "eps", "lr", "decay"):
        types[c] = "fp32"
    return {"adam_e4m3_stochastic": (_adam_kernel, types, consts,
                                     {"num_warps": 4, "enable_fp_fusion": False})}
