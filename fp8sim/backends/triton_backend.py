"""The triton backend: the kernels of ``kernels/`` behind the backend interface.

Runs on a CUDA GPU, or on the CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` was
set before triton was first imported (the tests do that in ``tests/conftest.py``). Casts use the
software cast (bit-exact to the emulator for every format, rounding mode and overflow rule);
``native=True`` on a backend instance enables the hardware fp8 cast for e4m3/e5m2 ``rne``
saturating casts on GPU (checked against the emulator by ``benchmarks/gpu_check.py``).
Block and MX scaling: :meth:`TritonBackend.block_quantize`; an ``nvfp4...`` granularity there
runs the NVFP4 kernel (``kernels/nvfp4_quantize.py``). Two NVFP4 operations only this backend has
so far: :meth:`TritonBackend.nvfp4_quantize` (all of it: packed codes, E4M3 block-scale codes,
the tensor scale) and :meth:`TritonBackend.rht` (the Random Hadamard Transform).
"""

from __future__ import annotations

from typing import Any

import torch

from fp8sim.backends.base import (
    AdamStepResult,
    Backend,
    CastSpec,
    as_scale,
    check_codes,
    check_input,
    check_mm,
    check_scale_inv,
    reciprocal,
)
from fp8sim.formats import FloatFormat, get_format
from fp8sim.kernels import adam as _adam
from fp8sim.kernels.cast import is_interpreter
from fp8sim.kernels.amax import amax as _amax
from fp8sim.kernels.block_quantize import block_quantize as _block_quantize
from fp8sim.kernels.cast_transpose import cast_transpose as _cast_transpose
from fp8sim.kernels.dequantize import dequantize as _dequantize
from fp8sim.kernels.nvfp4_quantize import nvfp4_quantize as nvfp4_kernel
from fp8sim.kernels.quantize import quantize as _quantize
from fp8sim.kernels.rht import rht as rht_kernel
from fp8sim.kernels.scaled_mm import scaled_mm as _scaled_mm

__all__ = ["TritonBackend"]


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.device.type == "cuda" or (is_interpreter() and t.device.type == "cpu"):
        return
    raise ValueError(
        f"triton backend: {what} is on {t.device}; need a CUDA tensor, or CPU tensors with "
        "TRITON_INTERPRET=1 set before triton is imported"
    )


class TritonBackend(Backend):
    """Triton kernels (GPU, or the CPU interpreter)."""

    name = "triton"
    has_nvfp4 = True

    def __init__(self, native: bool = False) -> None:
        #: use the hardware fp8 casts / fp8 tensor-core dot where they compute the same thing
        self.native = native

    def check_tensor(self, x: Any, what: str = "x") -> torch.Tensor:
        x = check_input(x, what)
        _check_device(x, what)
        return x

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        return _amax(self.check_tensor(x).detach())

    def _quantize(self, x: torch.Tensor, spec: CastSpec, scale: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        codes, amax = _quantize(x.detach(), spec.fmt, scale, **spec.encode_kwargs(),
                                native=self.native)
        return codes, reciprocal(scale), amax

    def dequantize(
        self,
        codes: torch.Tensor,
        fmt: FloatFormat | str,
        scale_inv: Any = 1.0,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        fmt = get_format(fmt)
        codes = check_codes(codes, fmt)
        _check_device(codes, "codes")
        s = as_scale(scale_inv, tuple(codes.shape), codes.device, "scale_inv")
        return _dequantize(codes, fmt, s, out_dtype)

    def _cast_transpose(self, x: torch.Tensor, spec: CastSpec, scale: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        codes, codes_t, amax = _cast_transpose(x.detach(), spec.fmt, scale, **spec.encode_kwargs())
        return codes, codes_t, reciprocal(scale), amax

    def _block_quantize(self, x: torch.Tensor, spec: CastSpec, gran: Any, *,
                        margin: float, pow2: bool, epsilon: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :meth:`Backend.block_quantize`; one kernel computes the group amaxes, scales and
        codes (``kernels.block_quantize``, which also returns MX scales as E8M0 codes). NVFP4:
        the tensor amax pass, then ``kernels.nvfp4_quantize`` (codes one per byte; scale_inv the
        decoded E4M3 block scales, amax the block amaxes, as ``fp8sim.scaling.quantize_scaled``)."""
        if gran.kind == "nvfp4":
            q = nvfp4_kernel(x.detach(), gran.block, gran.variant, pack=False,
                                rounding=spec.rounding, seed=spec.seed, srbits=spec.srbits)
            return q.codes, q.block_scale, q.block_amax
        codes, scale_inv, amax, _ = _block_quantize(
            x.detach(), spec.fmt, gran, margin=margin, pow2=pow2, epsilon=epsilon,
            **spec.encode_kwargs(),
        )
        return codes, scale_inv, amax

    def _nvfp4_quantize(self, x: torch.Tensor, spec: CastSpec, tile: tuple[int, int], variant: str,
                        global_amax: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :meth:`Backend.nvfp4_quantize`: ``kernels.nvfp4_quantize`` (the tensor amax pass,
        then one kernel), codes one per byte. Packed codes and E4M3 scale codes: call
        ``fp8sim.kernels.nvfp4_quantize.nvfp4_quantize`` itself."""
        q = nvfp4_kernel(x.detach(), tile, variant, global_amax=global_amax, rounding=spec.rounding,
                         seed=spec.seed, srbits=spec.srbits, pack=False)
        return q.codes, q.block_scale, q.tensor_scale, q.global_amax

    def _rht(self, x: torch.Tensor, axis: int, signs: Any, inverse: bool) -> torch.Tensor:
        """See :meth:`Backend.rht`: ``kernels.rht``, bit for bit ``fp8sim.hadamard.rht``."""
        return rht_kernel(x.detach(), axis, signs, inverse=inverse)

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
    ) -> torch.Tensor:
        a_fmt, b_fmt = get_format(a_fmt), get_format(b_fmt)
        check_mm(a_codes, b_codes, a_fmt, b_fmt)
        _check_device(a_codes, "a_codes")
        _check_device(b_codes, "b_codes")
        m, n = a_codes.shape[0], b_codes.shape[1]
        sa = check_scale_inv(a_scale_inv, m, n, "a_scale_inv", "row")
        sb = check_scale_inv(b_scale_inv, m, n, "b_scale_inv", "col")
        return _scaled_mm(a_codes, a_fmt, sa, b_codes, b_fmt, sb, out_dtype=out_dtype,
                          native=self.native)

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
        """See :meth:`Backend.adam_step` (one fused kernel, ``kernels/adam.py``)."""
        for what, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                        ("exp_avg_sq", exp_avg_sq)):
            _check_device(t, what)
        s = scalars
        packed = torch.stack([s[name].reshape(()) for name in _adam.SCALARS])
        amax = _adam.adam_step(param, grad.detach(), exp_avg, exp_avg_sq, packed, consts,
                               exp_avg_fmt=fmt, rounding=rounding, saturate=saturate,
                               seed=seed)
        return AdamStepResult(
            reciprocal(s["param_scale"]), reciprocal(s["exp_avg_scale"]),
            reciprocal(s["exp_avg_sq_scale"]), amax[0], amax[1], amax[2],
        )
