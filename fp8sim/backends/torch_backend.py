"""The torch backend: torch's native float8 (and float16/bfloat16) casts, on CPU or GPU.

What torch can do exactly as the emulator does, and what it cannot (checked by
``tests/test_backends.py`` against the emulator, not assumed):

* rounding: only round-to-nearest-even -- torch has no other rounding mode and no stochastic
  rounding; anything else raises ``NotImplementedError``.
* formats: ``e4m3`` (float8_e4m3fn), ``e5m2``, ``e4m3fnuz``, ``e5m2fnuz``, ``fp16``, ``bf16``.
  Others (e3m4, MX FP6/FP4, E8M0, generic eXmY) raise ``NotImplementedError``.
* overflow: saturating casts clamp to +-max first, then cast (round-then-compare and
  clamp-then-round agree for RNE). torch's e4m3fn cast saturates by itself, so the OCP
  non-saturating e4m3 rule (overflow -> NaN) is not available: ``NotImplementedError``.
  e5m2/fp16/bf16 overflow to inf and the FNUZ formats to NaN exactly as non-saturating asks.
* NaN: torch keeps NaN payload bits; the codes are canonicalized to the format's NaN with the
  input's sign (FNUZ: 0x80), as the emulator writes them.

Block scaling (``block_quantize`` with ``row``, ``col``, ``block:RxC`` -- Transformer Engine's
``block:1x128`` / ``block:128x128`` -- and MX): the tile amaxes and the scale rules in torch on
the tensor's device (:mod:`fp8sim.scaling_torch`, bit for bit the rules of
:mod:`fp8sim.scaling`), then the native cast -- the codes, scales and amaxes of
``fp8sim.scaling.quantize_scaled``. NVFP4 (``nvfp4_quantize``, ``rht``: torch has no float32 ->
E2M1 cast) raises ``NotImplementedError``.
Decoding is exact for every code: e4m3 and e5m2 through float16 bit patterns (an e5m2 code is
the high byte of the float16 of the same value; an e4m3 code's exponent and mantissa bits
shifted into a float16 give the value / 2**8 -- both several times faster on a CPU than torch's
float8 -> float32 conversion), other formats through the native dtype or an exact table gather.

``scaled_mm`` (see :mod:`fp8sim.backends.base` for ``accumulate=``): on the CPU, ``"float64"``
(default) or ``"float32"``, the very arithmetic of the emulator backend in either mode, so CPU
runs of the two backends differ only where their casts do (they do not, where both support a
cast). On a CUDA GPU: ``torch._scaled_mm`` (compute capability 8.9 or newer, e4m3/e5m2 operands
whose shapes it accepts), else a float32 matmul of the decoded operands -- for ``accumulate``
None or ``"float32"``; ``"float64"`` multiplies in float64 on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8sim.backends.base import (
    GEMM_ACCUMULATIONS,
    AdamStepResult,
    Backend,
    CastSpec,
    amax_f32,
    as_scale,
    check_accumulate,
    check_codes,
    check_mm,
    check_scale_inv,
    decode_in_order,
    mm_float32,
    reciprocal,
)
from fp8sim.emulator import decode_table
from fp8sim.formats import FloatFormat, get_format

__all__ = ["TorchBackend", "TORCH_DTYPES"]

#: formats with a native torch dtype whose float32 -> format cast rounds to nearest even
TORCH_DTYPES: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
#: formats whose torch cast saturates on its own (no non-saturating cast exists)
_SELF_SATURATING = ("e4m3",)


def _torch_dtype(fmt: FloatFormat, what: str) -> torch.dtype:
    if fmt.name not in TORCH_DTYPES:
        raise NotImplementedError(
            f"torch backend: {what} in format {fmt.name} (torch has no native dtype for it; "
            f"supported: {', '.join(TORCH_DTYPES)}); use the emulator or triton backend"
        )
    return TORCH_DTYPES[fmt.name]


def _code_view(t: torch.Tensor) -> torch.Tensor:
    """The code bits of a native-dtype tensor: uint8, or uint16 for 16-bit formats."""
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view(torch.uint16)


def _cast(y: torch.Tensor, spec: CastSpec, may_have_nan: bool = True,
          in_range: bool = False) -> torch.Tensor:
    """Codes of the float32 tensor ``y``: the emulator's ``encode(y, spec.fmt, ...)``.

    ``may_have_nan=False`` (the caller knows ``y`` has no NaN, e.g. from a finite amax) skips
    the NaN-canonicalizing passes; ``in_range=True`` (the caller knows ``|y| <= fmt.max``)
    skips the saturating clamp, which would change nothing."""
    fmt, saturate = spec.fmt, spec.saturate
    if spec.rounding != "rne":
        raise NotImplementedError(
            f"torch backend: rounding={spec.rounding!r} (torch casts round to nearest even only; "
            "stochastic and directed rounding need the emulator or triton backend)"
        )
    dtype = _torch_dtype(fmt, "a cast")
    if not saturate and fmt.name in _SELF_SATURATING:
        raise NotImplementedError(
            f"torch backend: non-saturating {fmt.name} cast (torch's float8_e4m3fn cast "
            "saturates; overflow -> NaN needs the emulator or triton backend)"
        )
    src = y.clamp(-fmt.max, fmt.max) if saturate and not in_range else y  # NaN passes clamp
    codes = _code_view(src.to(dtype))
    if not may_have_nan:
        return codes.contiguous()
    if fmt.nan == "fnuz":
        canonical = torch.full_like(codes, fmt.nan_code)
    else:
        canonical = torch.where(torch.signbit(y), fmt.nan_code | fmt.sign_mask, fmt.nan_code)
        canonical = canonical.to(codes.dtype)
    return torch.where(torch.isnan(y), canonical, codes).contiguous()


#: int16 mask keeping the sign (bit 15) and an e4m3 code's 7 exponent/mantissa bits (13..7)
_E4M3_F16_MASK = -0x4080  # 0xBF80


def _decode_f32(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Exact float32 values of ``codes`` (float16 bit patterns for e4m3/e5m2, else the native
    view where torch has the dtype, else a table gather)."""
    if fmt.name == "e5m2":  # s eeeee mm is the high byte of the float16 s eeeee mm00000000
        raw = codes.contiguous().view(torch.uint8).to(torch.int16) << 8
        return raw.view(torch.float16).to(torch.float32)
    if fmt.name == "e4m3":
        # the int8 code sign-extended and shifted by 7: sign at bit 15 (bit 14, a copy of the
        # sign, cleared), exponent and mantissa at bits 13..7: the float16 of value / 2**8,
        # subnormals included (float16's exponent range holds them). A NaN code (S.1111.111)
        # would read as +-480 / 2**8: adding 1 at bit 7 carries into bit 14 for it alone, and
        # that bit completes float16's all-ones exponent (a NaN; its sign and payload after the
        # float32 multiply are not specified -- NaN bits carry no meaning, compare NaN-aware).
        bits = torch.bitwise_left_shift(codes.contiguous().view(torch.int8).to(torch.int16), 7)
        bits.bitwise_and_(_E4M3_F16_MASK)
        bits.bitwise_or_(torch.add(bits, 0x80).bitwise_and_(0x4000))
        return bits.view(torch.float16).to(torch.float32).mul_(256.0)
    if fmt.name in TORCH_DTYPES:
        dtype = TORCH_DTYPES[fmt.name]
        raw = codes.contiguous()
        raw = raw.view(torch.uint8) if dtype.itemsize == 1 else raw.view(torch.uint16)
        return raw.view(dtype).to(torch.float32)
    table = torch.from_numpy(decode_table(fmt, "float32").copy()).to(codes.device)
    idx = codes.to(torch.int64) & ((1 << fmt.bits) - 1)
    return table[idx]


class TorchBackend(Backend):
    """torch native casts (CPU or CUDA); ``torch._scaled_mm`` where the GPU has it."""

    name = "torch"
    gemm_accumulations = GEMM_ACCUMULATIONS

    def _quantize(self, x: torch.Tensor, spec: CastSpec, s: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        amax = amax_f32(x)  # NaN-propagating
        y = x.detach().to(torch.float32) * s
        # y is NaN-free when x is and the scale is finite and nonzero (else inf*0 = NaN); and
        # |y| <= float32(amax * |s|) (rounding is monotonic), so a small enough bound means
        # the saturating clamp has nothing to do
        top = (amax * s).abs().amax()
        clean = bool(torch.isfinite(top)) and bool((s != 0).all())
        codes = _cast(y, spec, may_have_nan=not clean,
                      in_range=clean and bool(top <= spec.fmt.max))
        return codes, reciprocal(s), amax

    def dequantize(
        self,
        codes: torch.Tensor,
        fmt: FloatFormat | str,
        scale_inv: Any = 1.0,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        fmt = get_format(fmt)
        codes = check_codes(codes, fmt)
        s = as_scale(scale_inv, tuple(codes.shape), codes.device, "scale_inv")
        return (_decode_f32(codes, fmt) * s).to(out_dtype)

    def _block_quantize(self, x: torch.Tensor, spec: CastSpec, gran: Any, *,
                        margin: float, pow2: bool, epsilon: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row, ``block:RxC`` and MX (see the module docstring): the tile amaxes and the scale
        rule in torch on ``x``'s device (:func:`fp8sim.scaling_torch.block_quantize_torch`), then
        the native cast -- the codes, scales and amaxes of ``fp8sim.scaling.quantize_scaled``."""
        from fp8sim.scaling_torch import block_quantize_torch

        if gran.kind not in ("row", "col", "block", "mx"):
            raise NotImplementedError(f"torch backend: block_quantize with granularity {gran.spec} (torch has no "
                                      "float32 -> E2M1 cast); use the emulator or triton backend")
        _cast(x.new_zeros(0, dtype=torch.float32), spec)  # what torch cannot cast raises here, first
        return block_quantize_torch(x, spec.fmt, gran, lambda y: _cast(y, spec), margin=margin, pow2=pow2,
                                    epsilon=epsilon)

    def decode(self, codes: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
        fmt = get_format(fmt)
        return decode_in_order(_decode_f32, check_codes(codes, fmt), fmt)

    def scaled_mm(
        self,
        a_codes: torch.Tensor,
        a_fmt: FloatFormat | str,
        a_scale_inv: Any,
        b_codes: torch.Tensor,
        b_fmt: FloatFormat | str,
        b_scale_inv: Any,
        *,
        out_dtype: torch.dtype = torch.float32,
        accumulate: str | None = None,
    ) -> torch.Tensor:
        a_fmt, b_fmt = get_format(a_fmt), get_format(b_fmt)
        check_mm(a_codes, b_codes, a_fmt, b_fmt)
        mode = check_accumulate(accumulate)  # None -> "float64" on the CPU
        m, n = a_codes.shape[0], b_codes.shape[1]
        dev = a_codes.device
        sa = check_scale_inv(a_scale_inv, m, n, "a_scale_inv", "row").to(dev)
        sb = check_scale_inv(b_scale_inv, m, n, "b_scale_inv", "col").to(dev)
        if dev.type == "cpu" and mode == "float32":  # the emulator backend's float32 GEMM
            a = decode_in_order(_decode_f32, a_codes, a_fmt)
            b = decode_in_order(_decode_f32, b_codes, b_fmt)
            return mm_float32(a, b, sa, sb, out_dtype)
        exact = dev.type == "cpu" or accumulate == "float64"
        if not exact and _scaled_mm_ok(a_codes, a_fmt, sa, b_codes, b_fmt, sb, out_dtype):
            a8 = a_codes.contiguous().view(TORCH_DTYPES[a_fmt.name])
            b8 = b_codes.t().contiguous().view(TORCH_DTYPES[b_fmt.name]).t()  # column-major
            return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        if exact:
            # as the emulator backend: exact products summed in float64, scaled, rounded once
            acc = _decode_f32(a_codes, a_fmt).double() @ _decode_f32(b_codes, b_fmt).double()
            return (acc * sa.double() * sb.double()).to(out_dtype)
        # float32 accumulate on a GPU without torch._scaled_mm for these operands: the CPU's
        # float32 GEMM with its epilogue (acc * float32(sa * sb))
        return mm_float32(_decode_f32(a_codes, a_fmt), _decode_f32(b_codes, b_fmt), sa, sb, out_dtype)

    def _nvfp4_quantize(self, x: torch.Tensor, spec: CastSpec, tile: tuple[int, int], variant: str,
                        global_amax: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError(
            "torch backend: NVFP4 (torch has no float32 -> float4_e2m1fn_x2 cast, and no stochastic "
            "rounding); use the emulator backend"
        )

    def _rht(self, x: torch.Tensor, axis: int, signs: Any, inverse: bool) -> torch.Tensor:
        raise NotImplementedError("torch backend: the Random Hadamard Transform of NVFP4 training is not "
                                  "implemented here (its only use is NVFP4, which torch cannot cast); use "
                                  "the emulator backend")

    def _adam_step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        fmt: FloatFormat,
        scalars: dict[str, torch.Tensor],
        consts: dict[str, Any],
        *,
        rounding: str,
        saturate: bool,
        seed: int | None,
    ) -> AdamStepResult:
        """See :meth:`Backend.adam_step`; separate torch float32 ops, so no op is fused."""
        s = scalars
        c = {k: float(v) for k, v in consts.items()}
        f32 = torch.float32
        g = grad.detach().to(f32) * s["grad_scale_inv"]
        w = param.detach().to(f32) * s["param_scale_inv"]
        m = _decode_f32(exp_avg.detach(), fmt) * s["exp_avg_scale_inv"]
        v = exp_avg_sq.detach().to(f32) * s["exp_avg_sq_scale_inv"]
        m = m * c["beta1"] + g * c["one_minus_beta1"]
        v = v * c["beta2"] + (g * g) * c["one_minus_beta2"]
        denom = torch.sqrt(v / c["bias_correction2"]) + c["eps"]
        u = (m / c["bias_correction1"]) / denom
        w = w * c["decay"] - u * c["lr"]
        fp16 = CastSpec("fp16", rounding, saturate, seed)
        new_param = _cast(w * s["param_scale"], fp16)
        new_m = _cast(m * s["exp_avg_scale"], CastSpec(fmt, rounding, saturate, seed))
        new_v = _cast(v * s["exp_avg_sq_scale"], fp16)
        param.copy_(new_param.view(torch.float16))
        exp_avg.copy_(new_m.view(exp_avg.dtype))
        exp_avg_sq.copy_(new_v.view(torch.float16))
        return AdamStepResult(
            reciprocal(s["param_scale"]),
            reciprocal(s["exp_avg_scale"]),
            reciprocal(s["exp_avg_sq_scale"]),
            w.abs().amax() if w.numel() else torch.zeros((), dtype=f32, device=w.device),
            m.abs().amax() if m.numel() else torch.zeros((), dtype=f32, device=w.device),
            v.abs().amax() if v.numel() else torch.zeros((), dtype=f32, device=w.device),
        )


def _scaled_mm_ok(a: torch.Tensor, a_fmt: FloatFormat, sa: torch.Tensor, b: torch.Tensor,
                  b_fmt: FloatFormat, sb: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` can compute this product (else: float32 fallback)."""
    if a.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    if a_fmt.name not in ("e4m3", "e5m2") or b_fmt.name not in ("e4m3", "e5m2"):
        return False
    if a_fmt.name == "e5m2" and b_fmt.name == "e5m2":
        return False  # cuBLASLt has no e5m2 x e5m2 kernel
    m, k = a.shape
    n = b.shape[1]
    if m % 16 or k % 16 or n % 16:
        return False
    per_tensor = sa.dim() == 0 and sb.dim() == 0
    rowwise = sa.dim() == 2 and sb.dim() == 2 and out_dtype == torch.bfloat16
    return out_dtype in (torch.float32, torch.bfloat16, torch.float16) and (per_tensor or rowwise)
