"""The emulator backend: the numba emulator behind the backend interface -- the reference.

Casts go through ``fp8sim.encode`` / ``fp8sim.decode`` on the CPU (tensors on another device are
copied to the CPU and the results copied back; the first such copy in a process says so once, a
``UserWarning``: use the triton backend to keep a GPU run on the GPU); the GEMM sums exactly decoded operands in float64
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
from fp8sim.emulator import decode, encode
from fp8sim.formats import FloatFormat, get_format

__all__ = ["EmulatorBackend", "adam_reference"]

_said_host_copy = False


def _host(t: torch.Tensor, *, own: bool = True) -> torch.Tensor:
    """``t`` on the CPU, detached. A tensor on another device is copied (said once per process,
    a UserWarning). ``own=True`` (default): never the caller's storage -- numpy is about to see
    it, which pins a storage for good (FSDP2 could no longer free an all-gathered weight);
    ``own=False`` for a temporary of the backend's own."""
    global _said_host_copy
    if t.device.type != "cpu":
        if not _said_host_copy:
            _said_host_copy = True
            import warnings

            warnings.warn(f"fp8sim: the emulator backend computes on the CPU: tensors on {t.device} are copied "
                          "through the host and back (the triton backend runs on the GPU)", UserWarning, stacklevel=3)
        return t.detach().cpu()
    return t.detach().clone() if own else t.detach()


class EmulatorBackend(Backend):
    """Bit-exact reference backend (numba emulator, CPU)."""

    name = "emulator"
    gemm_accumulations = GEMM_ACCUMULATIONS
    has_nvfp4 = True

    def _quantize(self, x: torch.Tensor, spec: CastSpec, scale: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x.detach().to(torch.float32) * scale  # float32 product, rounded once
        codes = encode(_host(y, own=False), spec.fmt, **spec.encode_kwargs())
        return codes.to(x.device), reciprocal(scale), amax_f32(x)

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
        values = decode(_host(codes), fmt) * s
        return values.to(out_dtype).to(codes.device)

    def decode(self, codes: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
        fmt = get_format(fmt)
        codes = check_codes(codes, fmt)
        return decode_in_order(decode, _host(codes), fmt).to(codes.device)

    def _block_quantize(self, x: torch.Tensor, spec: CastSpec, gran: Any, *,
                        margin: float, pow2: bool, epsilon: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``fp8sim.scaling.quantize_scaled`` (just-in-time scales) on torch tensors."""
        from fp8sim.scaling import quantize_scaled

        st = quantize_scaled(_host(x), spec.fmt, gran, margin=margin, pow2=pow2,
                             epsilon=epsilon, **spec.encode_kwargs())
        dev = x.device
        return (torch.from_numpy(st.codes).to(dev),
                torch.from_numpy(np.asarray(st.scale_inv, np.float32)).to(dev),
                torch.from_numpy(np.asarray(st.amax, np.float32)).to(dev))

    def _nvfp4_quantize(self, x: torch.Tensor, spec: CastSpec, tile: tuple[int, int], variant: str,
                        global_amax: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``fp8sim.nvfp4.quantize_nvfp4_2d`` on torch tensors."""
        from fp8sim.nvfp4 import quantize_nvfp4_2d

        if isinstance(global_amax, torch.Tensor):
            global_amax = float(global_amax)
        x32 = _host(x).to(torch.float32).numpy()
        p = quantize_nvfp4_2d(x32, tile, variant, global_amax=global_amax, rounding=spec.rounding,
                              seed=spec.seed, srbits=spec.srbits)
        dev = x.device
        return (torch.from_numpy(p.codes).to(dev), torch.from_numpy(p.block_scale).to(dev),
                torch.tensor(float(p.tensor_scale), dtype=torch.float32, device=dev),
                torch.tensor(float(p.global_amax), dtype=torch.float32, device=dev))

    def _rht(self, x: torch.Tensor, axis: int, signs: np.ndarray, inverse: bool) -> torch.Tensor:
        """``fp8sim.hadamard.rht``."""
        from fp8sim.hadamard import rht

        return torch.from_numpy(rht(_host(x), axis, signs, inverse=inverse)).to(x.device)

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
            a = decode_in_order(decode, _host(a_codes), a_fmt)
            b = decode_in_order(decode, _host(b_codes), b_fmt)
            return mm_float32(a, b, sa, sb, out_dtype).to(a_codes.device)
        sa, sb = sa.double(), sb.double()
        a = decode(a_codes.detach().cpu(), a_fmt, dtype=np.float64)
        b = decode(b_codes.detach().cpu(), b_fmt, dtype=np.float64)
        out = (a @ b) * sa * sb
        return out.to(out_dtype).to(a_codes.device)

    def gemm_accumulator(self, a: Any, b: Any, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:func:`fp8sim.gemm.scaled_gemm` with :data:`fp8sim.gemm.HOPPER_FP8` on the host: ``a``
        (M, K) and ``b`` (N, K) quantized along K, the result ``A B^T``."""
        from fp8sim.gemm import HOPPER_FP8, scaled_gemm
        from fp8sim.nvfp4 import gemm_alpha

        def layout(q: Any, transposed: bool) -> tuple[str, Any]:
            g, s = q.granularity, q.scale_inv.detach().cpu()
            if g.kind == "tensor":
                return "tensor", s
            if g.kind == "row":
                return ("col", s.t()) if transposed else ("row", s)
            r, c = g.block
            return (f"block:{c}x{r}", s.t()) if transposed else (f"block:{r}x{c}", s)

        (ga, sa), (gb, sb) = layout(a, False), layout(b, True)
        alpha = None
        if a.tensor_scale is not None:
            alpha = gemm_alpha(float(a.tensor_scale), float(b.tensor_scale), a.granularity.variant)
        out = scaled_gemm(a.codes.detach().cpu(), a.fmt, sa.numpy(), b.codes.detach().cpu().t(), b.fmt, sb.numpy(),
                          a_granularity=ga, b_granularity=gb, alpha=alpha, **HOPPER_FP8)
        return torch.from_numpy(out).to(out_dtype).to(a.codes.device)

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
            _host(param), _host(grad), _host(exp_avg), _host(exp_avg_sq), consts=consts, rounding=rounding, saturate=saturate,
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
