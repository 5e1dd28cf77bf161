"""FP8 linear layers: ``convert_to_fp8(model, recipe, backend)`` and the autograd function.

``y = x W^T + b`` with all three GEMMs on FP8 operands, through a backend
(:func:`fp8sim.backends.get`):

* forward   ``Y  = X W^T``:   X (M, K) and W (N, K) cast with the recipe's ``input``/``weight``
  casts (E4M3 in the hybrid recipes);
* backward  ``dX = dY W``:    dY (M, N) cast with ``grad_output`` (E5M2 in hybrid), W reused;
* backward  ``dW = dY^T X``:  the same FP8 dY and the FP8 X saved by the forward (uint8 codes,
  not the float32 activation).

A cast is ``amax -> scale (the role's policy) -> codes = encode(float32(x) * scale)``, saturating,
rounding per the recipe (round to nearest even by default); a GEMM multiplies decoded codes and
applies ``scale_inv`` of both operands. Tensor scaling uses the backend's ``quantize``/``scaled_mm``
with ``accumulate=`` :attr:`Fp8State.gemm_accumulate`: ``"float32"`` by default -- on the CPU the
emulator and torch backends then run one and the same float32 GEMM
(:func:`fp8sim.backends.base.mm_float32`: exact products, float32 sum in the order of torch's CPU
matmul, ``float32(acc * float32(sA * sB))``), so their runs on one machine (same torch thread
count) agree bit for bit where their casts do -- or ``"float64"``: exact products summed in float64, scaled in float64, rounded once (about
2.5x slower; the order-independent reference). A backend without ``gemm_accumulations`` (Triton)
runs its own float32 GEMM. MX block scaling (one E8M0 scale per 32 elements along the reduction
axis) goes through :func:`fp8sim.scaling.quantize_scaled` and a float32 GEMM on the dequantized
operands, re-casting each operand along the reduction axis of every GEMM that consumes it, as
Transformer Engine's MXFP8 does (row-wise and column-wise copies).

Scaling policies observe each tensor's amax once per training step (not in eval mode).
Overflow (``|float32(x) * scale| > max``, clamped) and underflow (a nonzero value whose code is
zero) are counted per cast into :attr:`Fp8State.events`.

Nothing global is touched: ``convert_to_fp8`` replaces the model's own ``nn.Linear`` children
and keeps their ``Parameter`` objects (optimizers and weight tying keep working).
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from fp8sim.formats import FloatFormat, get_format
from fp8sim.scaling import MX_BLOCK
from fp8sim.trace import cast_thresholds
from fp8sim.training.recipes import CastConfig, LinearRecipe, Recipe

__all__ = ["Fp8State", "Fp8Linear", "Fp8Operand", "convert_to_fp8", "get_fp8_state", "fp8_linears"]

#: a recorder tap: (tensor name, role, float tensor as cast, cast, scale used, operand)
Tap = Callable[[str, str, torch.Tensor, CastConfig, Any, "Fp8Operand"], None]


@dataclass
class Fp8Operand:
    """A cast tensor: uint8 ``codes`` with their format and inverse scale.

    ``scale_inv`` is a 0-d float32 tensor (tensor scaling) or, for MX, a float32 tensor with one
    entry per 32-element block along the last axis. ``value = decode(code) * scale_inv``.
    """

    codes: torch.Tensor
    scale_inv: torch.Tensor
    fmt: FloatFormat
    granularity: str = "tensor"

    def t(self) -> "Fp8Operand":
        """The transpose (tensor scaling only: the codes are a view, the scale is shared)."""
        if self.granularity != "tensor":
            raise ValueError("Fp8Operand.t: only tensor-scaled operands transpose without a re-cast")
        return Fp8Operand(self.codes.t(), self.scale_inv, self.fmt, self.granularity)


class Fp8State:
    """What the FP8 linears of one model share: backend, one policy per role, step, counters.

    Attributes:
        backend: the backend object doing amax / quantize / scaled_mm.
        policies: role -> :class:`fp8sim.policies.ScalingPolicy` (``activation``, ``weight``,
            ``grad_output``, optionally ``weight_grad``).
        step: the training step the casts belong to (set by the trainer, used for stochastic
            rounding seeds and by recorders).
        events: ``{"overflow": n, "underflow": n}`` since the last :meth:`pop_events`.
        taps: recorder callbacks, called once per cast.
        observing: False in evaluation: casts use the current scales but update no policy,
            count nothing and call no tap.
        gemm_accumulate: the ``accumulate=`` of every tensor-scaled GEMM (``"float32"`` or
            ``"float64"``, see the module docstring), or None for a backend that takes none.
    """

    def __init__(self, recipe: LinearRecipe, backend: str | Any, *, count_events: bool = True,
                 gemm_accumulate: str | None = "float32") -> None:
        from fp8sim import backends
        from fp8sim.policies import parse_policy

        self.recipe = recipe
        self.backend = backends.get(backend) if isinstance(backend, str) else backend
        self.backend_name = backend if isinstance(backend, str) else type(backend).__name__
        self.casts = recipe.casts()
        self.policies = {role: parse_policy(c.policy) for role, c in self.casts.items()}
        self.formats = {role: get_format(c.fmt) for role, c in self.casts.items()}
        self.step = 0
        self.count_events = count_events
        self.events: Counter = Counter()
        self.taps: list[Tap] = []
        self.observing = True
        self.gemm_accumulate = gemm_accumulate

    @property
    def gemm_accumulate(self) -> str | None:
        return self._accumulate

    @gemm_accumulate.setter
    def gemm_accumulate(self, mode: str | None) -> None:
        from fp8sim.backends.base import GEMM_ACCUMULATIONS

        if mode is not None and mode not in GEMM_ACCUMULATIONS:
            raise ValueError(f"Fp8State: gemm_accumulate must be one of "
                             f"{', '.join(GEMM_ACCUMULATIONS)} or None, got {mode!r}")
        modes = tuple(getattr(self.backend, "gemm_accumulations", ()))
        if mode == "float32" and not modes:  # the default: the backend's own float32 GEMM
            mode = None
        if mode is not None and mode not in modes:
            raise NotImplementedError(
                f"Fp8State: backend {self.backend_name} has no accumulate={mode!r} GEMM "
                f"(it offers {', '.join(modes) or 'only its own float32 GEMM'})"
            )
        self._accumulate = mode
        self._mm_kwargs = {"out_dtype": torch.float32}
        if mode is not None:
            self._mm_kwargs["accumulate"] = mode

    # -- casts ------------------------------------------------------------------------------
    def cast(self, name: str, role: str, x: torch.Tensor, *, observe: bool = True) -> Fp8Operand:
        """Cast ``x`` (2-D; blocks, if any, along the last axis) for tensor ``name`` in ``role``.

        ``observe=False`` re-casts a tensor already cast this step (MX column-wise copies): no
        policy update, no count, no tap.
        """
        cast, fmt, policy = self.casts[role], self.formats[role], self.policies[role]
        x = x.detach()
        if cast.granularity == "mx":
            op, scale = self._cast_mx(x, fmt, cast, policy), None
            amax = None
        else:
            seed = self._seed(name) if cast.rounding == "stochastic" else None
            kwargs = {"rounding": cast.rounding, "saturate": True, "seed": seed}
            if policy.just_in_time:  # current scaling: the scale needs this tensor's amax first
                amax = self.backend.amax(x)
                scale = float(policy.scale_for(name, fmt, current_amax=float(amax)))
                codes, scale_inv = self.backend.quantize(x, fmt, scale, **kwargs)
            else:  # delayed: the scale is known, amax comes out of the same pass
                scale = float(policy.scale_for(name, fmt))
                codes, scale_inv, amax = self.backend.quantize_with_amax(x, fmt, scale, **kwargs)
            op = Fp8Operand(codes, scale_inv, fmt)
        if not (observe and self.observing):  # re-casts and eval passes leave no trace
            return op
        amax = float(x.float().abs().amax()) if amax is None else float(amax)
        stats = {"numel": x.numel()}
        if getattr(policy, "NAME", "") == "autoscale":  # steered by the share of values cast to +-max
            mag = op.codes & (fmt.sign_mask - 1) if fmt.signed else op.codes
            stats["n_at_max"] = int(torch.count_nonzero(mag == fmt.max_code))
        policy.observe(name, amax, fmt, **stats)
        if self.count_events:
            self._count(x, op, scale, amax)
        for tap in self.taps:
            tap(name, role, x, cast, scale, op)
        return op

    def _cast_mx(self, x: torch.Tensor, fmt: FloatFormat, cast: CastConfig, policy) -> Fp8Operand:
        from fp8sim.scaling import quantize_scaled

        gran = getattr(policy, "granularity", "mx")  # "mx" (OCP floor rule) or "mx:rceil" (TE, cuBLAS)
        st = quantize_scaled(x.float().numpy(), fmt, gran, rounding=cast.rounding)
        codes = torch.from_numpy(np.ascontiguousarray(st.codes))
        scale_inv = torch.from_numpy(np.ascontiguousarray(st.scale_inv, dtype=np.float32))
        return Fp8Operand(codes, scale_inv, fmt, "mx")

    def _seed(self, name: str) -> int:
        return (self.step * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63

    def _count(self, x: torch.Tensor, op: Fp8Operand, scale: float | None, amax: float) -> None:
        """Overflow and underflow as :mod:`fp8sim.trace` defines them (round to nearest even):
        overflow: ``float32(|x| * scale)`` rounds above max (then clamped); underflow: a nonzero
        value whose code is zero."""
        fmt = op.fmt
        mag = op.codes & (fmt.sign_mask - 1) if fmt.signed else op.codes
        # zero codes minus zero inputs (count_nonzero counts NaN, not -0.0), one pass each
        self.events["underflow"] += int(torch.count_nonzero(x)) - int(torch.count_nonzero(mag))
        if scale is None:  # MX: the block scale keeps every block's amax within max
            return
        thr = cast_thresholds(fmt, "rne")
        s32 = torch.tensor(scale, dtype=torch.float32)
        top = float(torch.tensor(amax, dtype=torch.float32) * s32)
        if top < thr.overflow_at or (top == thr.overflow_at and not thr.overflow_tie):
            return  # nothing overflows: the largest scaled magnitude is below the threshold
        q = (x.float() * s32).abs()
        over = q > thr.overflow_at
        if thr.overflow_tie:
            over |= q == thr.overflow_at
        over &= torch.isfinite(x)  # inf inputs are counted as inf by traces, not as overflow
        self.events["overflow"] += int(torch.count_nonzero(over))

    def pop_events(self) -> dict[str, int]:
        out = {"overflow": int(self.events["overflow"]), "underflow": int(self.events["underflow"])}
        self.events.clear()
        return out

    # -- GEMM -------------------------------------------------------------------------------
    def gemm(self, a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
        """``A B^T`` in float32 for ``a`` (M, K) and ``b`` (N, K), both reduced along K."""
        if a.granularity == "tensor" and b.granularity == "tensor":
            return self.backend.scaled_mm(
                a.codes, a.fmt, a.scale_inv, b.codes.t(), b.fmt, b.scale_inv, **self._mm_kwargs
            )
        return _dequantize_blocks(a) @ _dequantize_blocks(b).t()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "policies": {r: p.state_dict() for r, p in self.policies.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        for role, sd in d["policies"].items():
            self.policies[role].load_state_dict(sd)


def _dequantize_blocks(op: Fp8Operand) -> torch.Tensor:
    """``decode(codes) * scale_inv`` in float32 (exact decode; one rounding of the product)."""
    from fp8sim.emulator import decode

    values = decode(op.codes, op.fmt)  # (R, C) float32, exact
    if op.granularity == "tensor":
        return values * op.scale_inv
    R, C = values.shape
    sinv = op.scale_inv.reshape(R, -1)  # (R, ceil(C / 32)): 32-element blocks, the last shorter
    if sinv.shape[1] != -(-C // MX_BLOCK):
        raise ValueError(f"MX operand: {sinv.shape[1]} scales per row for {C} columns "
                         f"(expected ceil({C}/{MX_BLOCK}) = {-(-C // MX_BLOCK)})")
    if C % MX_BLOCK == 0:  # whole blocks: broadcast each scale over its block, no copies
        return (values.view(R, -1, MX_BLOCK) * sinv[:, :, None]).view(R, C)
    return values * torch.repeat_interleave(sinv, MX_BLOCK, dim=1)[:, :C]


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: "Fp8Linear"):
        st = layer.state
        xq = st.cast(f"{layer.name}.input", "activation", x)  # (M, K)
        wq = st.cast(f"{layer.name}.weight", "weight", weight)  # (N, K)
        y = st.gemm(xq, wq)  # (M, N) float32
        if bias is not None:
            y = y + bias
        if xq.granularity == "tensor":
            ctx.save_for_backward(xq.codes, xq.scale_inv, wq.codes, wq.scale_inv)
            ctx.hp = None
        else:  # MX re-casts along the other axis in backward, from the high-precision tensors
            ctx.save_for_backward(x, weight)
            ctx.hp = True
        ctx.layer, ctx.fmts, ctx.has_bias = layer, (xq.fmt, wq.fmt), bias is not None
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        layer = ctx.layer
        st = layer.state
        gy = gy.contiguous()
        gq = st.cast(f"{layer.name}.grad_output", "grad_output", gy)  # (M, N)
        if ctx.hp is None:
            xc, xs, wc, ws = ctx.saved_tensors
            xq = Fp8Operand(xc, xs, ctx.fmts[0])
            wq = Fp8Operand(wc, ws, ctx.fmts[1])
            dx = st.gemm(gq, wq.t())  # (M, N) x (N, K) -> (M, K)
            dw = st.gemm(gq.t(), xq.t())  # (N, M) x (M, K) -> (N, K)
        else:
            x, w = ctx.saved_tensors
            wt = st.cast(f"{layer.name}.weight", "weight", w.t().contiguous(), observe=False)  # (K, N)
            gt = st.cast(f"{layer.name}.grad_output", "grad_output", gy.t().contiguous(), observe=False)
            xt = st.cast(f"{layer.name}.input", "activation", x.t().contiguous(), observe=False)  # (K, M)
            dx = st.gemm(gq, wt)
            dw = st.gemm(gt, xt)
        if "weight_grad" in st.casts:  # FP8-LM O1: the weight gradient itself travels in FP8
            dwq = st.cast(f"{layer.name}.weight_grad", "weight_grad", dw)
            dw = _dequantize_blocks(dwq) if dwq.granularity != "tensor" else st.backend.dequantize(
                dwq.codes, dwq.fmt, dwq.scale_inv, out_dtype=torch.float32)
        db = gy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class Fp8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` whose GEMMs run in FP8 (see the module docstring).

    Shares ``weight``/``bias`` Parameters with the linear it replaces; ``name`` is its qualified
    module name (the prefix of its tensors' names in policies and traces).
    """

    def __init__(self, linear: nn.Linear, name: str, state: Fp8State) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.name = name
        self.state = state  # plain attribute: shared, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K), M = prod(lead)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = _Fp8LinearFunction.apply(x2, self.weight, self.bias, self)  # (M, N)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        roles = ", ".join(f"{r}={c.fmt}" for r, c in self.state.casts.items())
        return f"in_features={self.in_features}, out_features={self.out_features}, {roles}"


def convert_to_fp8(
    model: nn.Module, recipe: Recipe | LinearRecipe, backend: str | Any = "emulator", *, count_events: bool = True,
    gemm_accumulate: str | None = "float32",
) -> nn.Module:
    """Replace the ``nn.Linear`` modules of ``model`` (in place) by :class:`Fp8Linear`.

    Modules whose qualified name ends with an entry of ``recipe.skip`` stay as they are. All
    converted layers share one :class:`Fp8State` (``gemm_accumulate``: see there); returns
    ``model``. A recipe without FP8 GEMMs (``recipe.linear is None``) raises ValueError.
    """
    linear_recipe = recipe.linear if isinstance(recipe, Recipe) else recipe
    if not isinstance(linear_recipe, LinearRecipe):
        name = getattr(recipe, "name", recipe)
        raise ValueError(f"convert_to_fp8: recipe {name!r} has no FP8 linear layers")
    if get_fp8_state(model) is not None:
        raise ValueError("convert_to_fp8: model is already converted")
    state = Fp8State(linear_recipe, backend, count_events=count_events, gemm_accumulate=gemm_accumulate)
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod) is nn.Linear and not any(name.endswith(s) for s in linear_recipe.skip)
    ]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear(mod, name, state))
    return model


def fp8_linears(model: nn.Module) -> list[Fp8Linear]:
    """The FP8 linears of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def get_fp8_state(model: nn.Module) -> Fp8State | None:
    """The shared :class:`Fp8State` of a converted model, or None."""
    layers = fp8_linears(model)
    return layers[0].state if layers else None
