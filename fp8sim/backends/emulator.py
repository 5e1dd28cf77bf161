"""The emulator backend: the numba emulator behind the backend interface -- the reference.

Casts go through ``fp8sim.encode`` / ``fp8sim.decode`` on the CPU (tensors on another device are
copied to the CPU and the results copied back); the GEMM sums exactly decoded operands in float64
and rounds once (``accumulate="float64"``, the default) or, with ``accumulate="float32"``, hands
the exactly decoded float32 operands to :func:`fp8sim.backends.base.mm_float32`, the one float32
GEMM the torch backend calls too (see :mod:`fp8sim.backends.base`); the Adam step runs its
float32 recipe in numpy, one rounding per operation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fp8sim.backends.base import (
    GEMM_ACCUMULATIONS,
    AdamStepResult,
    Backend,
    amax_f32,
    as_scale,
    check_accumulate,
    check_codes,
    check_input,
    check_mm,
    check_rounding,
    check_scale_inv,
    decode_in_order,
    mm_float32,
    reciprocal,
)
from fp8sim.emulator import decode, encode
from fp8sim.formats import FloatFormat, get_format

__all__ = ["EmulatorBackend", "adam_reference"]


class EmulatorBackend(Backend):
    """Bit-exact reference backend (numba emulator, CPU)."""

    name = "emulator"
    gemm_accumulations = GEMM_ACCUMULATIONS

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        return amax_f32(check_input(x))

    def quantize_with_amax(
        self,
        x: torch.Tensor,
        fmt: FloatFormat | str,
        scale: Any = 1.0,
        *,
        rounding: str = "rne",
        saturate: bool = True,
        seed: int | None = None,
        srbits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = check_input(x)
        fmt = get_format(fmt)
        check_rounding(rounding, seed)
        s = as_scale(scale, tuple(x.shape), x.device)
        y = x.detach().to(torch.float32) * s  # float32 product, rounded once
        codes = encode(y.cpu(), fmt, rounding=rounding, saturate=saturate, seed=seed, srbits=srbits)
        return codes.to(x.device), reciprocal(s), amax_f32(x)

    def dequantize(
        self,
        codes: torch.Tensor,
        fmt: FloatFormat | str,
        scale_inv: Any = 1.0,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        fmt = get_format(fmt)
        codes = check_codes(codes, fmt)
        s = as_scale(scale_inv, tuple(codes.shape), torch.device("cpu"), "scale_inv")
        values = decode(codes.detach().cpu(), fmt) * s
        return values.to(out_dtype).to(codes.device)

    def decode(self, codes: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
        fmt = get_format(fmt)
        codes = check_codes(codes, fmt)
        return decode_in_order(decode, codes.detach().cpu(), fmt).to(codes.device)

    def cast_transpose_with_amax(
        self,
        x: torch.Tensor,
        fmt: FloatFormat | str,
        scale: Any = 1.0,
        *,
        rounding: str = "rne",
        saturate: bool = True,
        seed: int | None = None,
        srbits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if check_input(x).dim() != 2:
            raise ValueError(f"cast_transpose: x must be 2-D, got shape {tuple(x.shape)}")
        codes, scale_inv, amax = self.quantize_with_amax(
            x, fmt, scale, rounding=rounding, saturate=saturate, seed=seed, srbits=srbits
        )
        return codes, codes.t().contiguous(), scale_inv, amax

    def block_quantize(
        self,
        x: torch.Tensor,
        fmt: FloatFormat | str,
        granularity: str = "block:1x128",
        *,
        margin: float = 0,
        pow2: bool = False,
        epsilon: float = 0.0,
        rounding: str = "rne",
        saturate: bool = True,
        seed: int | None = None,
        srbits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``fp8sim.scaling.quantize_scaled`` (just-in-time scales) on torch tensors."""
        from fp8sim.scaling import parse_granularity, quantize_scaled

        x = check_input(x)
        check_rounding(rounding, seed)
        if parse_granularity(granularity).kind == "tensor":
            raise ValueError("block_quantize: granularity 'tensor' is quantize()'s job")
        st = quantize_scaled(x.detach().cpu(), fmt, granularity, margin=margin, pow2=pow2,
                             epsilon=epsilon, rounding=rounding, saturate=saturate, seed=seed,
                             srbits=srbits)
        dev = x.device
        return (torch.from_numpy(st.codes).to(dev),
                torch.from_numpy(np.asarray(st.scale_inv, np.float32)).to(dev),
                torch.from_numpy(np.asarray(st.amax, np.float32)).to(dev))

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
        """``"float64"`` (default), the reference: exact products, float64 sum, scales in
        float64, one final rounding; ``"float32"``: :func:`~fp8sim.backends.base.mm_float32`
        of the decoded operands (the torch backend's float32 GEMM, bit for bit)."""
        a_fmt, b_fmt = get_format(a_fmt), get_format(b_fmt)
        check_mm(a_codes, b_codes, a_fmt, b_fmt)
        mode = check_accumulate(accumulate)
        m, n = a_codes.shape[0], b_codes.shape[1]
        sa = check_scale_inv(a_scale_inv, m, n, "a_scale_inv", "row").cpu()
        sb = check_scale_inv(b_scale_inv, m, n, "b_scale_inv", "col").cpu()
        if mode == "float32":
            a = decode_in_order(decode, a_codes.detach().cpu(), a_fmt)
            b = decode_in_order(decode, b_codes.detach().cpu(), b_fmt)
            return mm_float32(a, b, sa, sb, out_dtype).to(a_codes.device)
        sa, sb = sa.double(), sb.double()
        a = decode(a_codes.detach().cpu(), a_fmt, dtype=np.float64)
        b = decode(b_codes.detach().cpu(), b_fmt, dtype=np.float64)
        out = (a @ b) * sa * sb
        return out.to(out_dtype).to(a_codes.device)

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
        """See :meth:`Backend.adam_step`; computed by :func:`adam_reference`."""
        new = adam_reference(
            param.detach().cpu(), grad.detach().cpu(), exp_avg.detach().cpu(),
            exp_avg_sq.detach().cpu(), consts=consts, rounding=rounding, saturate=saturate,
            seed=seed, **{k: v.cpu() for k, v in scalars.items()}, exp_avg_fmt=fmt,
        )
        param.copy_(new["param"].to(param.device))
        exp_avg.copy_(new["exp_avg"].to(exp_avg.device))
        exp_avg_sq.copy_(new["exp_avg_sq"].to(exp_avg_sq.device))
        dev = param.device
        s = scalars
        return AdamStepResult(
            reciprocal(s["param_scale"]).to(dev),
            reciprocal(s["exp_avg_scale"]).to(dev),
            reciprocal(s["exp_avg_sq_scale"]).to(dev),
            new["param_amax"].to(dev),
            new["exp_avg_amax"].to(dev),
            new["exp_avg_sq_amax"].to(dev),
        )


def _f32(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a float32 numpy array (float16/bfloat16 widen exactly)."""
    return t.detach().to(torch.float32).numpy()


def adam_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    consts: dict,
    exp_avg_fmt: FloatFormat,
    rounding: str,
    saturate: bool,
    seed: int | None,
    param_scale_inv: torch.Tensor,
    exp_avg_scale_inv: torch.Tensor,
    exp_avg_sq_scale_inv: torch.Tensor,
    grad_scale_inv: torch.Tensor,
    param_scale: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The Adam recipe of :meth:`Backend.adam_step` in numpy float32 (CPU tensors in and out)."""
    c = consts
    f32 = np.float32
    with np.errstate(all="ignore"):
        g = _f32(grad) * f32(grad_scale_inv)
        w = _f32(param) * f32(param_scale_inv)
        m = decode(exp_avg.detach().cpu().contiguous(), exp_avg_fmt).numpy() * f32(exp_avg_scale_inv)
        v = _f32(exp_avg_sq) * f32(exp_avg_sq_scale_inv)
        m = c["beta1"] * m + c["one_minus_beta1"] * g
        v = c["beta2"] * v + c["one_minus_beta2"] * (g * g)
        denom = np.sqrt(v / c["bias_correction2"]) + c["eps"]
        u = (m / c["bias_correction1"]) / denom
        w = w * c["decay"] - c["lr"] * u
        yw = w * f32(param_scale)
        ym = m * f32(exp_avg_scale)
        yv = v * f32(exp_avg_sq_scale)
    assert w.dtype == m.dtype == v.dtype == np.float32

    def enc(y: np.ndarray, fmt: Any, k: int) -> np.ndarray:
        sd = None if seed is None else seed + k
        return encode(y, fmt, rounding=rounding, saturate=saturate, seed=sd)

    def amax(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(np.abs(a).max() if a.size else f32(0), dtype=torch.float32)

    return {
        "param": torch.from_numpy(enc(yw, "fp16", 0).view(np.float16)),
        "exp_avg": torch.from_numpy(enc(ym, exp_avg_fmt, 1)),
        "exp_avg_sq": torch.from_numpy(enc(yv, "fp16", 2).view(np.float16)),
        "param_amax": amax(w),
        "exp_avg_amax": amax(m),
        "exp_avg_sq_amax": amax(v),
    }
