"""The backend interface: one set of FP8 operations, three implementations.

Every backend takes and returns torch tensors and gives the same answer bit for bit as the
emulator (``fp8sim.encode`` / ``fp8sim.decode``), or raises ``NotImplementedError`` naming the
capability it lacks -- never a silently different answer. The only exception is ``scaled_mm``,
whose float32 accumulation order is the implementation's own: it is exact up to the float32
accumulation bound (see :meth:`Backend.scaled_mm`). On the CPU the emulator and torch backends
offer two GEMM arithmetics (``accumulate=``, :data:`GEMM_ACCUMULATIONS`), and each one is the
same computation in both backends, so the two give bit-identical GEMM outputs on one machine:

* ``"float64"`` (their default): the decoded operands multiplied in float64 (every product is
  exact), summed in float64, times ``float64(a_scale_inv) * float64(b_scale_inv)``, rounded once
  to ``out_dtype``. The sum is exact -- so independent of order -- while it fits float64's 53
  bits, e.g. always for E4M3 x E4M3 with K <= 2**17, and otherwise rounds in float64.
* ``"float32"``: :func:`mm_float32`, one shared function: ``torch.mm`` on the exactly decoded
  float32 operands (products exact, sum in float32 in the order of torch's CPU GEMM: fixed on
  one machine and thread count, not across them), then ``float32(acc * float32(sa * sb))``.
  About 2.5x faster than float64 on a CPU; the training path (:mod:`fp8sim.training.fp8_linear`)
  uses it by default.

Semantics shared by all backends (units and rounding):

* ``amax(x)``: ``max |float32(x)|`` as a 0-d float32 tensor; NaN if any element is NaN; 0 for an
  empty tensor.
* ``quantize(x, fmt, scale)``: ``codes = encode(float32(x) * float32(scale))`` -- the product is
  rounded to float32 first (exactly what a GPU does), then encoded once with ``rounding`` and the
  overflow rule ``saturate``; ``scale_inv = 1 / float32(scale)`` rounded to float32. ``scale`` is a
  number, a 0-d tensor, or for 2-D ``x`` a per-row ``(M, 1)`` / per-column ``(1, N)`` tensor.
  Stochastic rounding draws ``tl.randint(seed, i)`` for flat C-order element index ``i``.
* ``dequantize(codes, fmt, scale_inv)``: ``float32(decode(codes)) * float32(scale_inv)`` rounded
  to float32, then cast to ``out_dtype`` with round-to-nearest-even.
* ``cast_transpose``: the codes of ``quantize`` and their transpose (``codes.T``, contiguous) --
  the transposed copy is the same quantization, not a second rounding of ``x.T``.
* ``block_quantize``: per-group just-in-time scales (1xN, NxN, MX), as
  ``fp8sim.scaling.quantize_scaled``.
* ``nvfp4_quantize``: NVFP4 (E2M1 codes, E4M3 block scales, a float32 tensor scale), exactly
  ``fp8sim.nvfp4.quantize_nvfp4_2d``; ``rht``: the Random Hadamard Transform along the last axis,
  exactly ``fp8sim.hadamard.rht``. Backends without them say so (:attr:`Backend.has_nvfp4`).
* ``scaled_mm``: ``(decode(a) @ decode(b)) * a_scale_inv * b_scale_inv`` accumulated in float32
  (or better: ``accumulate="float64"``, see above).
* ``gemm`` / ``grouped_gemm``: the FP8 GEMM of two cast operands under a GEMM rule, and the MoE
  experts' GEMMs (one per expert, each on its own scales), :mod:`fp8sim.backends.gemms`.
* ``decode(codes, fmt)``: the exact float32 values of the codes, in the codes' memory order.
* ``adam_step``: the fused FP8-LM Adam step, see :meth:`Backend.adam_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from fp8sim.formats import ROUNDING_MODES
from fp8sim.formats import FloatFormat, get_format

__all__ = [
    "GEMM_ACCUMULATIONS",
    "Backend",
    "CastSpec",
    "AdamStepResult",
    "check_input",
    "check_codes",
    "check_rounding",
    "check_scale_inv",
    "check_mm",
    "as_scale",
    "reciprocal",
    "adam_constants",
    "amax_f32",
    "check_adam_args",
    "check_accumulate",
    "decode_in_order",
    "mm_float32",
]

#: the CPU GEMM arithmetics of the emulator and torch backends (``scaled_mm(accumulate=...)``)
GEMM_ACCUMULATIONS = ("float64", "float32")


class AdamStepResult(NamedTuple):
    """What :meth:`Backend.adam_step` hands back (all 0-d float32 tensors).

    ``*_scale_inv``: the decode factors of the state just written (``1 / new scale``).
    ``*_amax``: ``max |value|`` of the new float32 value before scaling (NaN-propagating), for
    the next step's scales (delayed scaling).
    """

    param_scale_inv: torch.Tensor
    exp_avg_scale_inv: torch.Tensor
    exp_avg_sq_scale_inv: torch.Tensor
    param_amax: torch.Tensor
    exp_avg_amax: torch.Tensor
    exp_avg_sq_amax: torch.Tensor


# -- validation helpers shared by the backends -------------------------------------------------


def check_input(x: Any, what: str = "x") -> torch.Tensor:
    """``x`` must be a float16/bfloat16/float32/float64 torch tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{what}: expected float16/bfloat16/float32/float64, got {x.dtype}")
    return x


def check_codes(codes: Any, fmt: FloatFormat, what: str = "codes") -> torch.Tensor:
    """Codes are uint8 (formats up to 8 bits) or uint16/int16 (wider formats)."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{what}: expected a torch tensor of codes, got {type(codes).__name__}")
    valid = (torch.uint8, torch.int8) if fmt.bits <= 8 else (torch.uint16, torch.int16)
    if codes.dtype not in valid:
        raise TypeError(f"{what}: {fmt.name} codes must be {valid[0]}, got {codes.dtype}")
    return codes


def as_scale(scale: Any, x_shape: tuple, device: torch.device, what: str = "scale") -> torch.Tensor:
    """``scale`` as a float32 tensor on ``device``: 0-d, or (M, 1) / (1, N) for a 2-D input.

    A Python number becomes float32 by round-to-nearest-even (``float32(scale)``).
    """
    if isinstance(scale, torch.Tensor):
        if not scale.dtype.is_floating_point:
            raise TypeError(f"{what}: expected a float tensor, got {scale.dtype}")
        s = scale.detach().to(device=device, dtype=torch.float32)
        if s.numel() == 1 and s.dim() <= 1:
            return s.reshape(())
        if s.dim() == 0:
            return s
        ok = len(x_shape) == 2 and s.dim() == 2 and (
            tuple(s.shape) == (x_shape[0], 1) or tuple(s.shape) == (1, x_shape[1])
        )
        if not ok:
            raise ValueError(
                f"{what}: shape {tuple(s.shape)} is not valid for x of shape {tuple(x_shape)}; "
                "valid: a number, a 0-d tensor, or (M, 1) / (1, N) for 2-D x"
            )
        return s
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
        raise TypeError(f"{what}: expected a number or tensor, got {type(scale).__name__}")
    return torch.tensor(float(scale), dtype=torch.float32, device=device)


def amax_f32(x: torch.Tensor) -> torch.Tensor:
    """``max |float32(x)|`` as a 0-d float32 tensor, in one pass (``aminmax``; rounding to
    float32 is monotonic, so it commutes with the max); NaN if any NaN; 0 if empty."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(lo.abs(), hi.abs()).to(torch.float32)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in float32 (correctly rounded on CPU and CUDA)."""
    return torch.reciprocal(scale.to(torch.float32))


def check_rounding(rounding: str, seed: Any) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDING_MODES)}")
    if rounding == "stochastic" and seed is None:
        raise ValueError("rounding='stochastic' needs seed= (Philox key, counter = flat index)")
    if rounding != "stochastic" and seed is not None:
        raise ValueError(f"seed= is for rounding='stochastic', not {rounding!r}")


@dataclass(frozen=True)
class CastSpec:
    """How one cast encodes, checked once when built: the target format (a name becomes its
    :class:`FloatFormat`), ``rounding`` (one of ``fp8sim.ROUNDING_MODES``), the overflow rule
    ``saturate``, and for ``rounding="stochastic"`` the Philox key ``seed`` (required) and the
    number of random bits ``srbits`` (1..32, default 32). Invalid combinations raise
    ``ValueError`` / ``TypeError`` here, so backends receive only valid specs."""

    fmt: FloatFormat
    rounding: str = "rne"
    saturate: bool = True
    seed: int | None = None
    srbits: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        check_rounding(self.rounding, self.seed)
        if not isinstance(self.saturate, (bool, np.bool_)):
            raise TypeError(f"saturate must be True or False, got {self.saturate!r}")
        object.__setattr__(self, "saturate", bool(self.saturate))
        if self.srbits is not None:
            if self.rounding != "stochastic":
                raise ValueError(f"srbits= is for rounding='stochastic', not {self.rounding!r}")
            k = self.srbits
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= 32:
                raise ValueError(f"srbits must be an int in 1..32, got {k!r}")

    def encode_kwargs(self) -> dict[str, Any]:
        """The keywords of ``fp8sim.encode`` for this cast (format not included)."""
        return {"rounding": self.rounding, "saturate": self.saturate, "seed": self.seed,
                "srbits": self.srbits}


def check_scale_inv(scale_inv: Any, rows: int, cols: int, what: str, axis: str) -> torch.Tensor:
    """GEMM scale_inv: 0-d (per tensor), or per row of a (M, 1) / per column of b (1, N)."""
    if not isinstance(scale_inv, torch.Tensor):
        if isinstance(scale_inv, (int, float, np.number)) and not isinstance(scale_inv, bool):
            return torch.tensor(float(scale_inv), dtype=torch.float32)
        raise TypeError(f"{what}: expected a number or tensor, got {type(scale_inv).__name__}")
    s = scale_inv.detach().to(torch.float32)
    if s.numel() == 1 and s.dim() <= 1:
        return s.reshape(())
    want = (rows, 1) if axis == "row" else (1, cols)
    if s.dim() == 1 and s.numel() == (rows if axis == "row" else cols):
        return s.reshape(want)
    if tuple(s.shape) != want:
        raise ValueError(f"{what}: shape {tuple(s.shape)} is not valid; valid: 0-d or {want}")
    return s


def check_mm(a: torch.Tensor, b: torch.Tensor, a_fmt: FloatFormat, b_fmt: FloatFormat) -> None:
    check_codes(a, a_fmt, "a_codes")
    check_codes(b, b_fmt, "b_codes")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"scaled_mm: need a (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def check_accumulate(accumulate: Any) -> str:
    """``accumulate=`` of ``scaled_mm``: None (the default, float64) or a name in
    :data:`GEMM_ACCUMULATIONS`."""
    if accumulate is None:
        return "float64"
    if accumulate not in GEMM_ACCUMULATIONS:
        raise ValueError(
            f"scaled_mm: accumulate must be one of {', '.join(GEMM_ACCUMULATIONS)}, "
            f"got {accumulate!r}"
        )
    return accumulate


def decode_in_order(decode: Any, codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``decode(contiguous codes, fmt)`` (float32) laid out as ``codes`` is: a transposed view
    of contiguous codes decodes the storage and returns the transposed view of the values, so
    no copy is made and the GEMM sees the same memory order whichever backend decoded."""
    if codes.dim() == 2 and not codes.is_contiguous() and codes.t().is_contiguous():
        return decode(codes.t(), fmt).t()
    return decode(codes.contiguous(), fmt)


def mm_float32(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The ``accumulate="float32"`` GEMM of the CPU backends, one function for both.

    ``a`` (M, K) and ``b`` (K, N): exactly decoded float32 values (any strides; the emulator
    and torch backends pass the same layouts, :func:`decode_in_order`); ``sa``/``sb``: float32
    scale_inv, 0-d or (M, 1) / (1, N). ``acc = torch.mm(a, b)`` (exact products, float32 sum in
    the CPU GEMM's order), then ``float32(acc * float32(sa * sb))`` -- cuBLAS's epilogue order
    and :func:`fp8sim.gemm.scaled_gemm`'s -- then cast to ``out_dtype`` (RNE).
    """
    acc = torch.mm(a, b)
    acc.mul_(sa * sb)  # (M, 1) * (1, N) broadcasts to (M, N); 0-d stays 0-d
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)


def adam_constants(
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> dict[str, np.float32]:
    """The float32 constants of the Adam step, each computed in float64 and rounded once."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"adam_step: step must be an int >= 1 (1 on the first step), got {step!r}")
    for name, v, lo, hi in (("beta1", beta1, 0.0, 1.0), ("beta2", beta2, 0.0, 1.0)):
        if not lo <= v < hi:
            raise ValueError(f"adam_step: {name} must be in [0, 1), got {v}")
    if eps <= 0 or lr < 0 or weight_decay < 0:
        raise ValueError("adam_step: need eps > 0, lr >= 0, weight_decay >= 0")
    f32 = np.float32
    return {
        "beta1": f32(beta1),
        "one_minus_beta1": f32(1.0 - beta1),
        "beta2": f32(beta2),
        "one_minus_beta2": f32(1.0 - beta2),
        "bias_correction1": f32(1.0 - beta1**step),
        "bias_correction2": f32(1.0 - beta2**step),
        "eps": f32(eps),
        "lr": f32(lr),
        "decay": f32(1.0 - lr * weight_decay),
    }


def check_adam_args(
    param, param_scale_inv, grad, exp_avg, exp_avg_scale_inv, exp_avg_sq, exp_avg_sq_scale_inv,
    grad_scale_inv, param_scale, exp_avg_scale, exp_avg_sq_scale, exp_avg_fmt, rounding, seed,
) -> dict:
    """Validate the Adam state; every scale becomes a 0-d float32 tensor on param's device.

    Returns ``{"fmt": exp_avg format, "scalars": {name: tensor}}`` with the four decode factors
    and the three new scales (default ``1 / scale_inv``).
    """
    fmt = get_format(exp_avg_fmt)
    if fmt.bits > 8:
        raise ValueError(f"adam_step: exp_avg_fmt must be an 8-bit-or-narrower format, got {fmt.name}")
    check_rounding(rounding, seed)
    if not isinstance(param, torch.Tensor) or param.dtype != torch.float16:
        raise TypeError("adam_step: param must be a float16 tensor (the scaled master weight)")
    if not isinstance(exp_avg_sq, torch.Tensor) or exp_avg_sq.dtype != torch.float16:
        raise TypeError("adam_step: exp_avg_sq must be a float16 tensor")
    check_codes(exp_avg, fmt, "exp_avg")
    check_input(grad, "grad")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape:
            raise ValueError(
                f"adam_step: {name} shape {tuple(t.shape)} != param shape {tuple(param.shape)}"
            )
    dev = param.device
    shape = tuple(param.shape)

    def scalar(v: Any, what: str) -> torch.Tensor:
        s = as_scale(v, shape, dev, what)
        if s.dim() != 0:
            raise ValueError(f"adam_step: {what} must be a number or 0-d tensor")
        return s

    s = {
        "param_scale_inv": scalar(param_scale_inv, "param_scale_inv"),
        "exp_avg_scale_inv": scalar(exp_avg_scale_inv, "exp_avg_scale_inv"),
        "exp_avg_sq_scale_inv": scalar(exp_avg_sq_scale_inv, "exp_avg_sq_scale_inv"),
        "grad_scale_inv": scalar(grad_scale_inv, "grad_scale_inv"),
    }
    for new, old in (("param_scale", "param_scale_inv"), ("exp_avg_scale", "exp_avg_scale_inv"),
                     ("exp_avg_sq_scale", "exp_avg_sq_scale_inv")):
        given = {"param_scale": param_scale, "exp_avg_scale": exp_avg_scale,
                 "exp_avg_sq_scale": exp_avg_sq_scale}[new]
        s[new] = reciprocal(s[old]) if given is None else scalar(given, new)
    return {"fmt": fmt, "scalars": s}


class Backend:
    """Interface of an FP8 backend (see the module docstring for the shared semantics).

    The public methods check their arguments once (a cast's in a :class:`CastSpec`) and call a
    backend's hooks: ``_quantize``, ``_block_quantize``, optionally ``_cast_transpose``, and
    ``dequantize``, ``scaled_mm``, ``_adam_step``; ``check_tensor`` adds device rules. The plain
    ``quantize`` and ``cast_transpose`` drop the amax.
    """

    name: str = "base"
    #: whether :meth:`nvfp4_quantize` and :meth:`rht` are implemented (else NotImplementedError)
    has_nvfp4: bool = False
    #: the ``accumulate=`` values ``scaled_mm`` takes; empty: it takes no such keyword (the
    #: backend's own float32 accumulation, e.g. the Triton kernel's)
    gemm_accumulations: tuple[str, ...] = ()

    # -- casts -----------------------------------------------------------------------------
    # The public cast methods check their arguments here, once, and call the backend's hooks
    # (``_quantize``, ``_cast_transpose``, ``_block_quantize``) with a checked input and a
    # :class:`CastSpec`.
    def check_tensor(self, x: Any, what: str = "x") -> torch.Tensor:
        """``x`` if this backend can take it (:func:`check_input`; backends add device rules)."""
        return check_input(x, what)

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """``max |float32(x)|`` as a 0-d float32 tensor (NaN if any NaN; 0 if empty)."""
        return amax_f32(self.check_tensor(x))

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
        """(codes, scale_inv, amax of x): ``codes = encode(float32(x) * float32(scale))``."""
        x = self.check_tensor(x)
        spec = CastSpec(fmt, rounding, saturate, seed, srbits)
        return self._quantize(x, spec, as_scale(scale, tuple(x.shape), x.device))

    def _quantize(self, x: torch.Tensor, spec: CastSpec, scale: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`quantize_with_amax` on a checked ``x`` and a float32 ``scale`` tensor
        (:func:`as_scale`)."""
        raise NotImplementedError(f"{self.name}: quantize")

    def quantize(
        self,
        x: torch.Tensor,
        fmt: FloatFormat | str,
        scale: Any = 1.0,
        *,
        rounding: str = "rne",
        saturate: bool = True,
        seed: int | None = None,
        srbits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scale_inv): codes (uint8; uint16 for formats over 8 bits) of x's shape,
        ``encode(float32(x) * float32(scale))``; ``scale_inv = float32(1 / float32(scale))``."""
        codes, scale_inv, _ = self.quantize_with_amax(
            x, fmt, scale, rounding=rounding, saturate=saturate, seed=seed, srbits=srbits
        )
        return codes, scale_inv

    def dequantize(
        self,
        codes: torch.Tensor,
        fmt: FloatFormat | str,
        scale_inv: Any = 1.0,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``float32(decode(codes)) * float32(scale_inv)``, cast to ``out_dtype`` (RNE)."""
        raise NotImplementedError(f"{self.name}: dequantize")

    def decode(self, codes: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
        """The exact float32 values of ``codes`` (no scale), on their device, in the codes'
        memory order (:func:`decode_in_order`)."""
        fmt = get_format(fmt)
        return decode_in_order(lambda c, f: self.dequantize(c, f, 1.0, torch.float32), codes, fmt)

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
        """(codes, codes_t, scale_inv, amax) for 2-D ``x``; ``codes_t = codes.T`` contiguous."""
        x = self.check_tensor(x)
        if x.dim() != 2:
            raise ValueError(f"cast_transpose: x must be 2-D, got shape {tuple(x.shape)}")
        spec = CastSpec(fmt, rounding, saturate, seed, srbits)
        return self._cast_transpose(x, spec, as_scale(scale, tuple(x.shape), x.device))

    def _cast_transpose(self, x: torch.Tensor, spec: CastSpec, scale: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`cast_transpose_with_amax` on checked arguments; by default :meth:`_quantize`
        and a transposed copy of its codes."""
        codes, scale_inv, amax = self._quantize(x, spec, scale)
        return codes, codes.t().contiguous(), scale_inv, amax

    def cast_transpose(
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
        """(codes, codes_t, scale_inv): the quantize of 2-D ``x`` and its transpose in one pass."""
        codes, codes_t, scale_inv, _ = self.cast_transpose_with_amax(
            x, fmt, scale, rounding=rounding, saturate=saturate, seed=seed, srbits=srbits
        )
        return codes, codes_t, scale_inv

    def block_quantize(
        self,
        x: torch.Tensor,
        fmt: FloatFormat | str,
        granularity: Any = "block:1x128",
        *,
        margin: float = 0,
        pow2: bool = False,
        epsilon: float = 0.0,
        rounding: str = "rne",
        saturate: bool = True,
        seed: int | None = None,
        srbits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale_inv, amax) with just-in-time scales per group of ``granularity`` (a
        :class:`~fp8sim.granularity.Granularity`, or its spelling: ``row``, ``col``,
        ``block:RxC``, ``mx``, ``mx:rceil``, ``nvfp4[:LAYOUT][:VARIANT]``): exactly
        ``fp8sim.scaling.quantize_scaled`` (its rules, shapes and NaN handling); scale_inv and
        amax have the scaling module's grid shape, as float32 tensors (NVFP4: the decoded E4M3
        block scales and the block amaxes; the tensor scale is not returned). Granularity
        ``tensor`` is :meth:`quantize`'s job."""
        from fp8sim.scaling import parse_granularity

        x = self.check_tensor(x)
        spec = CastSpec(fmt, rounding, saturate, seed, srbits)
        gran = parse_granularity(granularity)  # a Granularity is taken as is
        kind = gran.kind
        if kind == "tensor":
            raise ValueError("block_quantize: granularity 'tensor' is quantize()'s job")
        if kind == "nvfp4" and (spec.fmt.name != "e2m1" or margin != 0 or pow2 or epsilon != 0
                                or not spec.saturate):
            raise ValueError("block_quantize: nvfp4 needs fmt='e2m1' and takes no margin, pow2, "
                             "epsilon or saturate=False")
        return self._block_quantize(x, spec, gran, margin=margin, pow2=pow2, epsilon=epsilon)

    def _block_quantize(self, x: torch.Tensor, spec: CastSpec, gran: Any, *,
                        margin: float, pow2: bool, epsilon: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`block_quantize` on checked arguments."""
        raise NotImplementedError(f"{self.name}: block_quantize")

    def nvfp4_quantize(
        self,
        x: torch.Tensor,
        layout: str = "1x16",
        variant: str = "te",
        *,
        global_amax: Any = None,
        rounding: str = "rne",
        seed: int | None = None,
        srbits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """NVFP4 quantization of a 2-D ``x``, exactly :func:`fp8sim.nvfp4.quantize_nvfp4_2d`.

        ``layout``: the block, ``"1x16"`` (along rows), ``"16x1"`` or ``"16x16"``; ``variant``:
        one of :data:`fp8sim.nvfp4.NVFP4_VARIANTS`; ``global_amax``: the tensor amax the tensor
        scale comes from (None: max |x| over the non-NaN elements); ``rounding`` of the E2M1
        cast (stochastic: Philox keyed by ``seed``, counter = flat index). Returns (E2M1 codes
        uint8 of x's shape, one code per element; decoded E4M3 block scales, float32 of the
        block grid; tensor scale, 0-d float32; global amax, 0-d float32).
        """
        from fp8sim.nvfp4 import check_layout, check_variant

        x = self.check_tensor(x)
        if x.dim() != 2:
            raise ValueError(f"nvfp4_quantize: x must be 2-D, got shape {tuple(x.shape)}")
        spec = CastSpec("e2m1", rounding, True, seed, srbits)
        return self._nvfp4_quantize(x, spec, check_layout(layout), check_variant(variant), global_amax)

    def _nvfp4_quantize(self, x: torch.Tensor, spec: CastSpec, tile: tuple[int, int], variant: str,
                        global_amax: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`nvfp4_quantize` on checked arguments."""
        raise NotImplementedError(f"backend {self.name!r} has no NVFP4 quantize (E2M1 with E4M3 block scales); "
                                  "use the emulator backend")

    def rht(self, x: torch.Tensor, axis: int = -1, signs: Any = "te", *, inverse: bool = False) -> torch.Tensor:
        """The Random Hadamard Transform of ``x`` along ``axis`` (a multiple of 16) in groups of
        16, float32, exactly :func:`fp8sim.hadamard.rht` (its operation order); ``signs``:
        ``"te"`` (Transformer Engine's vector), a seed, or 16 values +-1; ``inverse`` undoes it."""
        from fp8sim.hadamard import RHT_SIZE, check_signs

        x = self.check_tensor(x)
        if x.dim() == 0 or not -x.dim() <= axis < x.dim() or x.shape[axis] % RHT_SIZE:
            raise ValueError(f"rht: axis {axis} of x must exist and be a multiple of {RHT_SIZE}, "
                             f"got shape {tuple(x.shape)}")  # fmt: skip
        return self._rht(x, axis % x.dim(), check_signs(signs), bool(inverse))

    def _rht(self, x: torch.Tensor, axis: int, signs: np.ndarray, inverse: bool) -> torch.Tensor:
        """:meth:`rht` on checked arguments (``signs``: 16 float32 values +-1)."""
        raise NotImplementedError(f"backend {self.name!r} has no Random Hadamard Transform; use the emulator backend")

    # -- GEMM --------------------------------------------------------------------------------
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
        """``(decode(a) @ decode(b)) * a_scale_inv * b_scale_inv``, a (M, K), b (K, N).

        Products of decoded values are exact in float32; the sum over K is accumulated in
        float32 (order up to the backend) or better, the scales applied after, then the result
        is cast to ``out_dtype``. ``a_scale_inv``: 0-d or per row (M, 1); ``b_scale_inv``: 0-d
        or per column (1, N). Codes may be non-contiguous views. Backends listing
        :attr:`gemm_accumulations` also take ``accumulate=`` (``"float64"`` by default,
        ``"float32"``: :func:`mm_float32`), see the module docstring.
        """
        raise NotImplementedError(f"{self.name}: scaled_mm")

    def gemm(self, a: Any, b: Any, rule: Any = "exact", *, accumulate: str | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``A B^T`` of two :class:`~fp8sim.quantizer.QuantizedTensor` -- ``a`` (M, K), ``b``
        (N, K), any granularity -- under a :class:`~fp8sim.recipes.GemmRule` (``exact``,
        ``torchao``, ``accumulator``): :func:`fp8sim.backends.gemms.gemm`."""
        from fp8sim.backends.gemms import gemm

        return gemm(self, a, b, rule, accumulate=accumulate, out_dtype=out_dtype)

    def grouped_gemm(self, a: Any, b: Any, rule: Any = "exact", *, accumulate: str | None = None,
                     out_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """The grouped GEMM of MoE experts: ``[A_g B_g^T for g]`` for two equally long sequences of
        :class:`~fp8sim.quantizer.QuantizedTensor` -- ``a[g]`` (M_g, K_g), ``b[g]`` (N_g, K_g) --
        each pair cast on its own (one scale set per expert, with the recipe's granularity),
        under one :class:`~fp8sim.recipes.GemmRule`: :func:`fp8sim.backends.gemms.grouped_gemm`,
        bit for bit the loop of :meth:`gemm` over the groups."""
        from fp8sim.backends.gemms import grouped_gemm

        return grouped_gemm(self, a, b, rule, accumulate=accumulate, out_dtype=out_dtype)

    def gemm_accumulator(self, a: Any, b: Any, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``accumulator`` GEMM rule (:mod:`fp8sim.gemm`'s Hopper model); the emulator's."""
        raise NotImplementedError(f"backend {self.name!r} has no accumulator GEMM model (fp8sim.gemm, numba on "
                                  f"the host); use the emulator backend")

    def to_float(self, q: Any) -> torch.Tensor:
        """The float32 values of a :class:`~fp8sim.quantizer.QuantizedTensor` on its device
        (:func:`fp8sim.backends.gemms.dequantize`)."""
        from fp8sim.backends.gemms import dequantize

        return dequantize(self, q)

    # -- optimizer ---------------------------------------------------------------------------
    def adam_step(
        self,
        param: torch.Tensor,
        param_scale_inv: Any,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_scale_inv: Any,
        exp_avg_sq: torch.Tensor,
        exp_avg_sq_scale_inv: Any = 1.0,
        *,
        step: int,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_scale_inv: Any = 1.0,
        param_scale: Any = None,
        exp_avg_scale: Any = None,
        exp_avg_sq_scale: Any = None,
        exp_avg_fmt: FloatFormat | str = "e4m3",
        rounding: str = "rne",
        saturate: bool = True,
        seed: int | None = None,
    ) -> AdamStepResult:
        """One fused FP8-LM AdamW step, updating ``param``, ``exp_avg``, ``exp_avg_sq`` in place.

        State (all same shape): ``param`` float16 master weight holding ``w * param_scale``;
        ``exp_avg`` uint8 codes of ``exp_avg_fmt`` (e4m3) holding ``m * exp_avg_scale``;
        ``exp_avg_sq`` float16 holding ``v * exp_avg_sq_scale``. Each ``*_scale_inv`` decodes
        the current state; the new state is encoded with ``param_scale`` / ``exp_avg_scale`` /
        ``exp_avg_sq_scale`` (default: ``1 / scale_inv`` in float32, i.e. keep the scale).

        In float32, every operation rounded (no fused multiply-add), constants from
        :func:`adam_constants`::

            g = float32(grad) * grad_scale_inv
            w = float32(param) * param_scale_inv
            m = float32(decode(exp_avg)) * exp_avg_scale_inv
            v = float32(exp_avg_sq) * exp_avg_sq_scale_inv
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * (g * g)
            u = (m / bias_correction1) / (sqrt(v / bias_correction2) + eps)
            w = w * (1 - lr * weight_decay) - lr * u          (decoupled weight decay, AdamW)
            param = encode_fp16(w * param_scale); exp_avg = encode(m * exp_avg_scale);
            exp_avg_sq = encode_fp16(v * exp_avg_sq_scale)

        with ``rounding`` and ``saturate`` for all three encodings; stochastic rounding keys
        Philox with ``seed``, ``seed + 1``, ``seed + 2`` for param, exp_avg, exp_avg_sq (counter =
        flat index). Returns the new scale_invs and the amaxes of the new w, m, v.
        """
        args = check_adam_args(
            param, param_scale_inv, grad, exp_avg, exp_avg_scale_inv, exp_avg_sq,
            exp_avg_sq_scale_inv, grad_scale_inv, param_scale, exp_avg_scale, exp_avg_sq_scale,
            exp_avg_fmt, rounding, seed,
        )
        consts = adam_constants(step, lr, beta1, beta2, eps, weight_decay)
        return self._adam_step(param, grad, exp_avg, exp_avg_sq, args["fmt"], args["scalars"],
                               consts, rounding=rounding, saturate=saturate, seed=seed)

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
        """The backend's arithmetic for :meth:`adam_step`, on checked arguments: ``scalars`` the
        float32 scale/scale_inv tensors by name, ``consts`` from :func:`adam_constants`."""
        raise NotImplementedError(f"{self.name}: adam_step")

    def __repr__(self) -> str:
        return f"<fp8sim backend {self.name!r}>"
