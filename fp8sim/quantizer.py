"""The quantizer: the one place where amax -> scale -> cast -> observe happens.

A :class:`Quantizer` is built from a :class:`~fp8sim.recipes.CastConfig` (format, scaling
config, granularity, rounding, RHT) and holds the scaling policy's state for every tensor it
casts, keyed by tensor name. Training (every FP8 linear's casts), FP8-LM's gradient all-reduce,
optimizer states and weights, the policy replay and the analysis all decide scales through it,
so live and replayed numbers cannot drift apart.

Per tensor and step, :meth:`Quantizer.quantize` does, on torch tensors of any device, through
the backend it was given (:mod:`fp8sim.backends`; only the emulator copies through the host):

1. ``amax = max |float32(x)|`` (NaN propagates: a NaN amax gives scale 1 under current
   scaling and keeps the previous scale under delayed scaling); then the **amax reduction**, if any (a process group: MAX across it, as TE's amax reduction
   group; or a callable), so every rank decides the same scale;
2. ``scale = policy.scale_for(name, fmt, current_amax=amax)`` (:meth:`scale_for`), or the
   scale given (a recomputed forward reuses its first cast's);
3. the cast ``encode(float32(float32(x) * scale))`` with the config's rounding, saturating --
   per tensor through ``backend.quantize``, per block (row, ``blocks(R, C)``, MX, NVFP4) through
   ``backend.block_quantize`` / ``backend.nvfp4_quantize`` with each block's just-in-time
   scale (the reduction applies to NVFP4's tensor amax, never to block amaxes);
4. ``policy.observe(name, amax, fmt, numel=..., n_at_max=...)`` (``n_at_max``: values cast to
   +-max, counted only for the policies that steer by it).

It returns one :class:`QuantizedTensor`. Replay and analysis, which hold amaxes and
histograms rather than tensors, call :meth:`scale_for` and :meth:`observe` themselves.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from fp8sim.formats import FloatFormat, Rounding
from fp8sim.granularity import Granularity
from fp8sim.policies import build_policy
from fp8sim.recipes import CastConfig
from fp8sim.scaling import block_multiplier
from fp8sim.scaling_config import AutoScaleConfig, TorchaoScalingConfig

__all__ = ["QuantizedTensor", "Quantizer", "AmaxReduction", "max_across", "stochastic_seed"]

#: an amax reduction: a callable taking and returning a float32 tensor of amaxes, or a
#: ``torch.distributed`` process group (MAX across it, NaN amaxes left out unless all are NaN)
AmaxReduction = Callable[[Any], Any]


@dataclass
class QuantizedTensor:
    """A cast tensor: ``codes`` with their format and scales (torch tensors on one device).

    ``scale_inv``: a 0-d float32 tensor (tensor scaling) or a float32 grid with one entry per
    group of the granularity (:mod:`fp8sim.scaling`'s shapes: row ``(M, 1)``, MX
    ``(M, ceil(N/32))``, ``blocks(R, C)`` ``(ceil(M/R), ceil(N/C))``);
    ``value = decode(code) * scale_inv``. ``scale``: the multiplier the cast applied (0-d, tensor
    scaling only; None for block scales, which ``scale_inv`` holds). NVFP4: ``scale_inv`` holds
    the decoded E4M3 block scales, ``tensor_scale`` the variant's per-tensor float32 and
    ``global_amax`` the tensor amax it came from (0-d float32 tensors);
    ``value = decode(code) * block_decode_scale(scale_inv, tensor_scale)`` (:mod:`fp8sim.nvfp4`).
    ``amax``: the tensor amax the quantizer observed (after the reduction), None for a re-cast.
    """

    codes: Any
    scale_inv: Any
    fmt: FloatFormat
    granularity: Granularity
    scale: Any = None
    tensor_scale: Any = None
    global_amax: Any = None
    amax: float | None = None

    def t(self) -> "QuantizedTensor":
        """The transpose without a re-cast: codes and scale grid transposed (views). Tensor
        scaling and square tiles (``blocks(C, C)``, NVFP4 16x16) only: their transpose is the
        cast of the transposed tensor; a one-row block is not (it is cast again instead)."""
        g = self.granularity
        if g.kind == "tensor":
            return replace(self, codes=self.codes.t())
        if g.block is None or g.block[0] != g.block[1]:
            raise ValueError(f"QuantizedTensor.t: a {g.spec} operand does not transpose without a re-cast "
                             f"(only tensor scaling and square tiles do)")
        return replace(self, codes=self.codes.t(), scale_inv=self.scale_inv.t())

    @property
    def one_row_blocks(self) -> bool:
        """Whether the scales run along rows (row, ``blocks(1, C)``, MX, NVFP4 1x16): cast again
        for a GEMM that reduces along the other axis."""
        return not self.granularity.kind == "tensor" and not (
            self.granularity.block is not None and self.granularity.block[0] == self.granularity.block[1])


def stochastic_seed(step: int, name: str) -> int:
    """The Philox key of a stochastic cast of tensor ``name`` at ``step``:
    ``(step * 0x9E3779B1 + crc32(name)) mod 2**63``, so a step's rounding is reproducible."""
    return (step * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63


def max_across(group: Any) -> AmaxReduction:
    """The amax reduction of a ``torch.distributed`` process group: MAX across its ranks. A
    NaN amax sets no bound (it is left out, as NCCL's ``fmaxf`` MAX does); if every rank's is
    NaN the result is NaN."""
    import torch
    import torch.distributed as dist

    def reduce(amax: Any) -> Any:
        t = amax.detach().to(torch.float32).clone()
        t = torch.where(torch.isnan(t), torch.full_like(t, -1.0), t)  # amaxes are >= 0: -1 marks NaN
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return torch.where(t < 0, torch.full_like(t, float("nan")), t)

    return reduce


class Quantizer:
    """amax -> scale -> cast -> observe for the tensors of one :class:`CastConfig`.

    Args:
        cast: the cast config (format, scaling, granularity, rounding, RHT).
        backend: the backend object whose casts run (``fp8sim.backends.get(name)``); needed by
            :meth:`quantize` only.
        amax_reduction: a process group (MAX across it, see :func:`max_across`) or a callable
            on a float32 tensor of amaxes, applied before the scale is decided and observed.
        scale_divisor: every scale the policy decides is divided by it, in float64 then rounded
            once to float32 (FP8-LM's MS-AMP all-reduce divides by ``sqrt(world)``, a
            pre-scaled all-reduce by ``world``).
        policy: a policy object whose state this quantizer shares (default: a fresh
            ``build_policy(cast.scaling)``); its config must be ``cast.scaling``.

    Attributes:
        policy: the stateful policy (``build_policy(cast.scaling)``); its state is this quantizer's.
    """

    def __init__(self, cast: CastConfig, backend: Any = None, *, amax_reduction: Any = None,
                 scale_divisor: float = 1.0, policy: Any = None) -> None:
        if not isinstance(cast, CastConfig):
            raise TypeError(f"Quantizer: cast must be a CastConfig, got {type(cast).__name__}")
        self.cast = cast
        self.fmt = cast.fmt
        self.granularity = cast.granularity
        if policy is not None and policy.config != cast.scaling:
            raise ValueError(f"Quantizer: the policy given is {policy.spec}, the cast's scaling {cast.scaling.spec}")
        self.policy = policy if policy is not None else build_policy(cast.scaling)
        self.policy._granularity = cast.granularity  # its spec names the granularity too
        self.backend = backend
        self.amax_reduction = _as_reduction(amax_reduction)
        self.scale_divisor = float(scale_divisor)
        #: whether :meth:`observe` needs ``n_at_max`` (the share of values cast to +-max)
        self.counts_saturation = isinstance(cast.scaling, AutoScaleConfig)

    def __repr__(self) -> str:
        return f"Quantizer({self.fmt.name}, {self.policy.spec}, rounding={self.cast.rounding.value})"

    # -- deciding ----------------------------------------------------------------------------------
    def reduce_amax(self, amax: Any) -> Any:
        """``amax`` (a float32 tensor of any shape) through the amax reduction, if any."""
        return amax if self.amax_reduction is None else self.amax_reduction(amax)

    def scale_for(self, name: str, amax: float | None) -> float:
        """The multiplier of tensor ``name``'s cast this step, from its (reduced) amax: the
        policy's (``amax`` used only by just-in-time policies); for MX and NVFP4 the multiplier
        of the block whose amax is ``amax`` (:func:`fp8sim.scaling.block_multiplier`)."""
        if self.granularity.kind in ("mx", "nvfp4"):
            return float(block_multiplier(self.granularity, amax, self.fmt))
        s = self.policy.scale_for(name, self.fmt, current_amax=amax if self.policy.just_in_time else None)
        if self.scale_divisor != 1.0:
            s = float(np.float32(s / self.scale_divisor))
        return s

    def group_scales(self, amax: np.ndarray, nan_groups: np.ndarray | None = None, *,
                     tensor_amax: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(multipliers, scale_inv), float32, of a block granularity's groups from their amaxes
        over the non-NaN values (a numpy array; ``nan_groups`` marks the groups that hold a NaN),
        by its just-in-time rule -- what the analysis applies to a tensor it reads in chunks:
        the current rule (:func:`fp8sim.scaling.scale_from_amax`: margin, pow2, epsilon; a scale
        that underflowed to 0 has scale_inv inf), MX's E8M0 rule (a group with a NaN: NaN), or
        NVFP4's two levels from the groups' and the tensor's amax ``tensor_amax`` (a group with a
        NaN: NaN; a block scale of 0 gives multiplier 0)."""
        from fp8sim.nvfp4 import block_decode_scale, block_scales, cast_multiplier, tensor_scale_for
        from fp8sim.scaling import mx_shared_scale, scale_from_amax

        g, a = self.granularity, np.asarray(amax, np.float32)
        if g.kind in ("mx", "nvfp4") and nan_groups is not None:
            a = np.where(nan_groups, np.float32(np.nan), a).astype(np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):
            if g.kind == "mx":
                sinv = mx_shared_scale(a, self.fmt, g.mx_rule)
                return (np.float32(1) / sinv).astype(np.float32), sinv
            if g.kind == "nvfp4":
                _, b = block_scales(a, tensor_amax, g.variant)
                mult = np.where(b == 0, np.float32(0), cast_multiplier(b, tensor_amax, g.variant))
                return mult.astype(np.float32), block_decode_scale(b, tensor_scale_for(tensor_amax, g.variant), g.variant)
            c = self.cast.scaling
            mult = scale_from_amax(a, self.fmt, margin=c.margin, pow2=c.pow2, epsilon=c.epsilon).reshape(-1)
            return mult, (np.float32(1) / mult).astype(np.float32)

    def observe(self, name: str, amax: float, **stats: Any) -> None:
        """Report this step's (reduced) amax of ``name`` to the policy, once per step."""
        self.policy.observe(name, amax, self.fmt, **stats)

    def state_dict(self) -> dict:
        return self.policy.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.policy.load_state_dict(d)

    # -- casting -----------------------------------------------------------------------------------
    def quantize(self, name: str, x: Any, *, observe: bool = True, scale: float | None = None,
                 seed: int | None = None, wgrad: bool = False, global_amax: Any = None) -> QuantizedTensor:
        """Cast the torch tensor ``x`` (2-D; blocks along the last axis) for tensor ``name``.

        ``observe=False`` re-casts (a column-wise copy, an evaluation pass): no policy update.
        ``scale``: cast with this multiplier (tensor scaling: a recomputed forward reuses its
        first cast's) and observe nothing. ``seed``: the Philox key when the rounding is
        stochastic (:func:`stochastic_seed`). ``wgrad``: ``x`` is the copy for the weight-gradient
        GEMM; with the config's ``rht`` it is padded with zero columns to a multiple of 16 tokens
        and Hadamard-transformed first (the transform of the padded group is orthogonal, so the
        GEMM's exact value is unchanged; Transformer Engine refuses such token counts).
        ``global_amax``: an NVFP4 cast's tensor amax to use as given (a recomputed forward reuses
        its first cast's; no reduction).
        """
        import torch

        be, cast, fmt = self._backend(), self.cast, self.fmt
        x = x.detach()
        if cast.rounding != Rounding.STOCHASTIC:
            seed = None
        elif seed is None:
            raise ValueError(f"Quantizer({name!r}): stochastic rounding needs seed= (see stochastic_seed)")
        kw = {"rounding": cast.rounding.value, "seed": seed}
        g = self.granularity
        if g.kind == "tensor":
            if scale is not None:
                codes, scale_inv = be.quantize(x, fmt, scale, **kw)
                return QuantizedTensor(codes, scale_inv, fmt, g, _f32_tensor(scale, x))
            amax = None
            if self.policy.just_in_time or self.amax_reduction is not None:
                amax = float(self.reduce_amax(be.amax(x)))
                scale = self.scale_for(name, amax)
                codes, scale_inv = be.quantize(x, fmt, scale, **kw)
            else:  # delayed: the scale is known, the amax comes out of the same pass
                scale = self.scale_for(name, None)
                codes, scale_inv, local = be.quantize_with_amax(x, fmt, scale, **kw)
                amax = float(local)
            q = QuantizedTensor(codes, scale_inv, fmt, g, _f32_tensor(scale, x), amax=amax)
        elif g.kind == "nvfp4":
            if wgrad and cast.rht:
                from fp8sim.hadamard import RHT_SIZE

                pad = -x.shape[-1] % RHT_SIZE
                if pad:
                    x = torch.nn.functional.pad(x, (0, pad))
                x = be.rht(x, -1, "te")
            if global_amax is None and self.amax_reduction is not None:
                global_amax = self.reduce_amax(be.amax(x))
            r, c = g.block
            codes, block_scale, tensor_scale, global_amax = be.nvfp4_quantize(
                x, f"{r}x{c}", g.variant, global_amax=global_amax, **kw)
            q = QuantizedTensor(codes, block_scale, fmt, g, None, tensor_scale, global_amax)
        elif isinstance(cast.scaling, TorchaoScalingConfig):  # torchao's rule per row, then the backend's cast
            from fp8sim.scaling_torch import torchao_scale

            scale = torchao_scale(x.float().abs().amax(dim=-1, keepdim=True), fmt, pow2=cast.scaling.pow2)
            codes, scale_inv = be.quantize(x, fmt, scale, **kw)
            q = QuantizedTensor(codes, scale_inv, fmt, g, scale)
        else:  # row, blocks(R, C), MX: just-in-time scales per group, by the current rule
            c = cast.scaling
            extra = {} if g.kind == "mx" else {"margin": c.margin, "pow2": c.pow2, "epsilon": c.epsilon}
            codes, scale_inv, _ = be.block_quantize(x, fmt, g, **extra, **kw)
            q = QuantizedTensor(codes, scale_inv, fmt, g)
        if observe:
            if q.amax is None:  # block scales: the tensor amax, for the policy and the counts
                q.amax = float(self.reduce_amax(be.amax(x)))
            self._observe_cast(name, x, q)
        return q

    def _observe_cast(self, name: str, x: Any, q: QuantizedTensor) -> None:
        import torch

        stats: dict[str, Any] = {"numel": int(x.numel())}
        if self.counts_saturation:
            mag = q.codes & (self.fmt.sign_mask - 1) if self.fmt.signed else q.codes
            stats["n_at_max"] = int(torch.count_nonzero(mag == self.fmt.max_code))
        self.observe(name, q.amax, **stats)

    def _backend(self) -> Any:
        if self.backend is None:
            raise ValueError("Quantizer.quantize needs a backend (Quantizer(cast, fp8sim.backends.get('emulator')))")
        return self.backend


def _f32_tensor(scale: Any, like: Any) -> Any:
    import torch

    if isinstance(scale, torch.Tensor):
        return scale.detach().to(device=like.device, dtype=torch.float32)
    return torch.tensor(float(scale), dtype=torch.float32, device=like.device)


def _as_reduction(r: Any) -> AmaxReduction | None:
    if r is None or callable(r):
        return r
    return max_across(r)  # a process group
