"""FP8 linear layers: :class:`Fp8Linear`, its shared :class:`Fp8State` and the custom ops
(the conversion of a model, ``convert_to_fp8``, is :mod:`fp8sim.training.convert`).

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

Scaling policies observe each tensor's amax once per training step: only forwards in training
mode with autograd enabled observe, and a forward that activation checkpointing recomputes inside
backward reuses the first forward's scales and observes nothing. Each layer's GEMMs run as torch
custom ops (``fp8sim::fp8_linear`` and its backward), so ``torch.compile`` traces a converted
model in one graph: the casts (Python, numpy, ``.item()``) run eagerly inside the op.
Overflow (``|float32(x) * scale| > max``, clamped) and underflow (a nonzero value whose code is
zero) are counted per cast into :attr:`Fp8State.events`.

Nothing global is touched: :func:`fp8sim.training.convert.convert_to_fp8` replaces the model's own ``nn.Linear`` (and Hugging
Face ``Conv1D``) children and keeps their ``Parameter`` objects (optimizers and weight tying keep
working); the custom ops find a layer through a weak registry of the converted layers.
"""

from __future__ import annotations

import weakref
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn

from fp8sim.formats import FloatFormat, get_format
from fp8sim.scaling import parse_granularity
from fp8sim.trace import cast_thresholds
from fp8sim.training.recipes import CastConfig, LinearRecipe, Recipe

__all__ = ["Fp8State", "Fp8Linear", "Fp8Operand", "is_hf_conv1d", "in_backward"]

#: a recorder tap: (tensor name, role, float tensor as cast, cast, scale used, operand)
Tap = Callable[[str, str, torch.Tensor, CastConfig, Any, "Fp8Operand"], None]


@dataclass
class Fp8Operand:
    """A cast tensor: uint8 ``codes`` with their format and inverse scale.

    ``scale_inv`` is a 0-d float32 tensor (tensor scaling) or a float32 grid with one entry per
    block of the granularity (:mod:`fp8sim.scaling`'s shapes: MX ``(M, ceil(N/32))``, ``block:RxC``
    ``(ceil(M/R), ceil(N/C))``); ``value = decode(code) * scale_inv``. NVFP4: ``scale_inv`` holds
    the decoded E4M3 block scales, ``tensor_scale`` the variant's per-tensor float32 and
    ``global_amax`` the tensor amax it came from (0-d float32 tensors);
    ``value = decode(code) * block_decode_scale(scale_inv, tensor_scale)`` (:mod:`fp8sim.nvfp4`).
    """

    codes: torch.Tensor
    scale_inv: torch.Tensor
    fmt: FloatFormat
    granularity: str = "tensor"
    tensor_scale: torch.Tensor | None = None
    global_amax: torch.Tensor | None = None

    def t(self) -> "Fp8Operand":
        """The transpose without a re-cast: codes and scale grid transposed (views). Tensor
        scaling and square tiles (``block:CxC``, ``nvfp4:2d``) only: their transpose is the cast
        of the transposed tensor; a one-row block is not (it is cast again instead)."""
        if self.granularity != "tensor":
            r, c = parse_granularity(self.granularity).block
            if r != c:
                raise ValueError(f"Fp8Operand.t: a {self.granularity} operand does not transpose without a re-cast "
                                 f"(only tensor scaling and square tiles do)")
            return Fp8Operand(self.codes.t(), self.scale_inv.t(), self.fmt, self.granularity, self.tensor_scale,
                              self.global_amax)
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
                 gemm_accumulate: str | None = "float32", recipe_name: str | None = None) -> None:
        from fp8sim import backends
        from fp8sim.policies import parse_policy

        self.recipe = recipe
        self.backend = backends.get(backend) if isinstance(backend, str) else backend
        self.backend_name = backend if isinstance(backend, str) else type(backend).__name__
        self.casts = recipe.casts()
        self.policies = {role: parse_policy(c.policy) for role, c in self.casts.items()}
        self.formats = {role: get_format(c.fmt) for role, c in self.casts.items()}
        self._check_casts(recipe_name)
        self._step = 0
        self._explicit_step = False
        #: tensor name -> (step, scale) of its last observed cast: what a recomputed forward
        #: (activation checkpointing) casts with again
        self._cast_scales: dict[str, tuple[int, float]] = {}
        #: objects with state_dict/load_state_dict whose state travels with the model's state
        #: dict (in the first FP8 layer's ``_extra_state``), e.g. FP8-LM's gradient reducer
        self.extra_states: dict[str, Any] = {}
        self.count_events = count_events
        self.events: Counter = Counter()
        self.taps: list[Tap] = []
        self.observing = True
        self.first_layer: str | None = None  # the converted layer that carries extra_states
        self._root_hook: Any = None  # the handle of convert_to_fp8's step hook on the root module
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
        if mode == "float64" and any(c.granularity != "tensor" for c in self.casts.values()):
            raise ValueError("Fp8State: gemm_accumulate='float64' is for per-tensor scaled GEMMs; the block-scaled "
                             "ones (mx, block, nvfp4) accumulate in float32 (see Fp8State.gemm)")
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

    def _check_casts(self, recipe_name: str | None) -> None:
        """Refuse, before any step, a cast this backend or policy cannot do (one clear line)."""
        what = f"recipe {recipe_name}" if recipe_name else "FP8 recipe"
        for role, c in self.casts.items():
            kind = c.granularity.partition(":")[0]
            if kind == "nvfp4" and not getattr(self.backend, "has_nvfp4", False):
                why = {"torch": "torch has no float32 -> E2M1 cast and no stochastic rounding",
                       "triton": "its NVFP4 kernels (quantize, RHT) are not in this version"}.get(
                    self.backend_name, "it has no NVFP4 quantize")
                raise NotImplementedError(f"{what}: {role} granularity {c.granularity} needs NVFP4 casts, which "
                                          f"backend {self.backend_name} does not offer ({why}); use the emulator "
                                          f"backend")
            if kind == "block" and getattr(self.policies[role], "NAME", "") != "current":
                raise ValueError(f"{what}: {role} granularity {c.granularity} takes its block scales just in time: "
                                 f"its policy must be 'current' (with pow2/epsilon/margin), got {c.policy!r}")

    # -- the step ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The training step the casts belong to (stochastic rounding seeds, checkpoints).

        It advances by one at each forward of the converted root module in training mode with
        autograd enabled (see :func:`convert_to_fp8`), unless a loop sets it: after the first
        assignment ``state.step = n`` the loop owns it and it never advances by itself.
        """
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = int(value)
        self._explicit_step = True
        if self._root_hook is not None:  # the loop owns the step: the root hook has nothing to do
            self._root_hook.remove()
            self._root_hook = None

    def _advance_step(self) -> None:
        if not self._explicit_step:
            self._step += 1

    # -- casts ------------------------------------------------------------------------------
    def cast(self, name: str, role: str, x: torch.Tensor, *, observe: bool = True,
             recompute: bool = False, wgrad: bool = False) -> Fp8Operand:
        """Cast ``x`` (2-D; blocks, if any, along the last axis) for tensor ``name`` in ``role``.

        ``observe=False`` re-casts a tensor already cast this step (column-wise copies, eval
        and no-grad forwards): no policy update, no count, no tap. ``recompute=True`` is the
        forward that activation checkpointing runs again in backward: if ``name`` was observed
        this step it is cast with the scale that cast used (its input is the same, so are its
        codes) and observes nothing; otherwise (a reentrant checkpoint's first forward ran
        without autograd) this is the step's observed cast. ``wgrad=True``: ``x`` is the
        transposed copy (K or N, M) for the weight-gradient GEMM: with the cast's ``rht`` it is
        padded with zero columns to a multiple of 16 tokens and Hadamard-transformed first (see
        :meth:`_cast_blocks`), and stochastic rounding keys its stream with ``name + "^T"``.
        """
        cast, fmt, policy = self.casts[role], self.formats[role], self.policies[role]
        x = x.detach()
        reused = self._cast_scales.get(name) if recompute else None
        if reused is not None and reused[0] == self._step:
            observe = False
        else:
            reused = None
        if cast.granularity == "mx":
            op, scale = self._cast_mx(x, fmt, cast, policy), None
            amax = None
        elif cast.granularity != "tensor":
            op, scale = self._cast_blocks(name + "^T" if wgrad else name, x, fmt, cast, policy, wgrad), None
            amax = None
        else:
            seed = self.seed_for(name) if cast.rounding == "stochastic" else None
            kwargs = {"rounding": cast.rounding, "saturate": True, "seed": seed}
            if reused is not None:  # the scale of this step's first forward
                scale = reused[1]
                codes, scale_inv = self.backend.quantize(x, fmt, scale, **kwargs)
                amax = None
            elif policy.just_in_time:  # current scaling: the scale needs this tensor's amax first
                amax = self.backend.amax(x)
                scale = float(policy.scale_for(name, fmt, current_amax=float(amax)))
                codes, scale_inv = self.backend.quantize(x, fmt, scale, **kwargs)
            else:  # delayed: the scale is known, amax comes out of the same pass
                scale = float(policy.scale_for(name, fmt))
                codes, scale_inv, amax = self.backend.quantize_with_amax(x, fmt, scale, **kwargs)
            op = Fp8Operand(codes, scale_inv, fmt)
        if not (observe and self.observing):  # re-casts and eval passes leave no trace
            return op
        self._cast_scales[name] = (self._step, scale)  # scale None: MX, block scales from the tensor
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

    def _cast_blocks(self, seed_name: str, x: torch.Tensor, fmt: FloatFormat, cast: CastConfig, policy,
                     wgrad: bool) -> Fp8Operand:
        """``block:RxC`` through the backend's ``block_quantize`` (the ``current`` policy's pow2,
        epsilon and margin); ``nvfp4...`` through its ``nvfp4_quantize`` (the tensor amax of
        ``x`` as it is cast, i.e. after the RHT, as Transformer Engine's column-wise copy).

        The RHT (``cast.rht`` and ``wgrad``) runs along the last axis, the token axis of a
        weight-gradient operand; a token count that is not a multiple of 16 is padded with zero
        columns first (Transformer Engine refuses it). Both operands of that GEMM are padded
        alike, and the transform of the padded group is orthogonal, so the GEMM's exact value is
        unchanged; the padded columns take part in the tensor amax and the block scales."""
        gran = parse_granularity(cast.granularity)
        seed = self.seed_for(seed_name) if cast.rounding == "stochastic" else None
        if gran.kind == "block":
            p = policy.params
            codes, scale_inv, _ = self.backend.block_quantize(
                x, fmt, gran.spec, margin=p["margin"], pow2=p["pow2"], epsilon=p["epsilon"],
                rounding=cast.rounding, seed=seed)
            return Fp8Operand(codes, scale_inv, fmt, gran.spec)
        if wgrad and cast.rht:
            from fp8sim.hadamard import RHT_SIZE

            pad = -x.shape[-1] % RHT_SIZE
            if pad:
                x = torch.nn.functional.pad(x, (0, pad))
            x = self.backend.rht(x, -1, "te")
        r, c = gran.block
        codes, block_scale, tensor_scale, global_amax = self.backend.nvfp4_quantize(
            x, f"{r}x{c}", gran.variant, rounding=cast.rounding, seed=seed)
        return Fp8Operand(codes, block_scale, fmt, gran.spec, tensor_scale, global_amax)

    def seed_for(self, name: str) -> int:
        """The Philox key of a stochastic cast of tensor ``name`` at the current step:
        ``(step * 0x9E3779B1 + crc32(name)) mod 2**63`` (the column-wise copy of a weight-gradient
        operand is keyed by ``name + "^T"``), so a step's rounding is reproducible."""
        return (self.step * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63

    def _count(self, x: torch.Tensor, op: Fp8Operand, scale: float | None, amax: float) -> None:
        """Overflow and underflow as :mod:`fp8sim.trace` defines them (round to nearest even):
        overflow: ``float32(|x| * scale)`` rounds above max (then clamped); underflow: a nonzero
        value whose code is zero."""
        fmt = op.fmt
        mag = op.codes & (fmt.sign_mask - 1) if fmt.signed else op.codes
        if op.tensor_scale is not None:  # NVFP4: see _nvfp4_events
            over, under = _nvfp4_events(x, op, mag)
            self.events["overflow"] += over
            self.events["underflow"] += under
            return
        # zero codes minus zero inputs (count_nonzero counts NaN, not -0.0), one pass each
        self.events["underflow"] += int(torch.count_nonzero(x)) - int(torch.count_nonzero(mag))
        if scale is None:  # MX, block:RxC: the block scale keeps every block's amax within max
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
        """``A B^T`` in float32 for ``a`` (M, K) and ``b`` (N, K), both reduced along K.

        Tensor scaling: the backend's ``scaled_mm``. Block scaling (MX, ``block:RxC``): a float32
        ``torch.mm`` of the operands dequantized in float32 (``decode * scale_inv``, one rounding;
        exact for power-of-two scales). NVFP4: ``float32(torch.mm(e2m1 * b_A, e2m1 * b_B) *
        alpha)`` -- each operand times its decoded E4M3 block scales (exact: 2 x 4 significant
        bits), every product exact, summed in float32, then the per-tensor factor
        :func:`fp8sim.nvfp4.gemm_alpha` once, as Transformer Engine's reference NVFP4 GEMM."""
        if a.granularity == "tensor" and b.granularity == "tensor":
            return self.backend.scaled_mm(
                a.codes, a.fmt, a.scale_inv, b.codes.t(), b.fmt, b.scale_inv, **self._mm_kwargs
            )
        if a.tensor_scale is None and b.tensor_scale is None:
            return _dequantize_blocks(a) @ _dequantize_blocks(b).t()
        from fp8sim.nvfp4 import gemm_alpha

        ga, gb = parse_granularity(a.granularity), parse_granularity(b.granularity)
        if ga.kind != "nvfp4" or gb.kind != "nvfp4" or ga.variant != gb.variant:
            raise ValueError(f"Fp8State.gemm: NVFP4 operands need NVFP4 partners of one variant, got "
                             f"{a.granularity} and {b.granularity}")
        alpha = gemm_alpha(float(a.tensor_scale), float(b.tensor_scale), ga.variant)
        acc = _block_values(a) @ _block_values(b).t()
        return acc * torch.tensor(alpha, dtype=torch.float32, device=acc.device)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "policies": {r: p.state_dict() for r, p in self.policies.items()}}

    def load_state_dict(self, d: dict) -> None:
        self._step = int(d["step"])  # not the setter: a loop that never set the step still need not
        self._cast_scales.clear()
        for role, sd in d["policies"].items():
            self.policies[role].load_state_dict(sd)

    def layer_state(self, names: set[str]) -> dict:
        """The part of the state that belongs to the tensors ``names`` (one layer's), plain data:
        the step, whether a loop set it, and each role's policy state of those tensors."""
        out = {"step": self._step, "explicit_step": self._explicit_step, "policies": {}}
        for role, policy in self.policies.items():
            sd = policy.state_dict()
            out["policies"][role] = {"policy": sd["policy"],
                                     "tensors": {k: v for k, v in sd["tensors"].items() if k in names}}
        return out

    def load_layer_state(self, names: set[str], d: dict) -> None:
        """Restore :meth:`layer_state` of the tensors ``names`` (the other tensors keep theirs)."""
        self._step = int(d["step"])
        self._explicit_step = bool(d.get("explicit_step", False))
        self._cast_scales.clear()
        for role, sd in d["policies"].items():
            if role not in self.policies:
                raise ValueError(f"FP8 state for role {role!r}: this model's recipe casts only "
                                 f"{', '.join(self.policies)}")
            full = self.policies[role].state_dict()
            if sd["policy"] != full["policy"]:
                raise ValueError(f"FP8 state of {role}: saved with policy {sd['policy']!r}, "
                                 f"this model uses {full['policy']!r}")
            tensors = {k: v for k, v in full["tensors"].items() if k not in names}
            tensors.update({k: v for k, v in sd["tensors"].items() if k in names})
            self.policies[role].load_state_dict({"policy": full["policy"], "tensors": tensors})


def _expand_grid(grid: torch.Tensor, tile: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """A per-block grid spread over the (rows, cols) elements its blocks cover (ragged edges cut)."""
    r, c = tile
    want = (-(-rows // r), -(-cols // c))
    if tuple(grid.shape) != want:
        raise ValueError(f"block operand: scale grid {tuple(grid.shape)} for a ({rows}, {cols}) operand in "
                         f"{r}x{c} blocks (expected {want})")
    return grid.repeat_interleave(min(r, max(rows, 1)), 0)[:rows].repeat_interleave(min(c, max(cols, 1)), 1)[:, :cols]


def _block_values(op: Fp8Operand) -> torch.Tensor:
    """``decode(codes) * scale_inv`` in float32 per block (exact decode, one rounding of the
    product; for NVFP4 the product with the E4M3 block scale, exact, without the tensor scale)."""
    from fp8sim.emulator import decode

    values = decode(op.codes.contiguous(), op.fmt)  # (R, C) float32, exact
    if op.granularity == "tensor":
        return values * op.scale_inv
    R, C = values.shape
    return values * _expand_grid(op.scale_inv.to(torch.float32), parse_granularity(op.granularity).block, R, C)


def _dequantize_blocks(op: Fp8Operand) -> torch.Tensor:
    """The float32 values of a cast: ``decode(codes) * scale_inv`` (one rounding of the
    product); NVFP4: ``decode(codes) * block_decode_scale`` (:func:`fp8sim.nvfp4.block_decode_scale`)."""
    if op.tensor_scale is None:
        return _block_values(op)
    from fp8sim.emulator import decode
    from fp8sim.nvfp4 import block_decode_scale

    gran = parse_granularity(op.granularity)
    values = decode(op.codes.contiguous(), op.fmt)
    f = torch.from_numpy(block_decode_scale(op.scale_inv.cpu().numpy(), float(op.tensor_scale), gran.variant))
    return values * _expand_grid(f.to(values.device), gran.block, *values.shape)


def _nvfp4_events(x: torch.Tensor, op: Fp8Operand, mag: torch.Tensor) -> tuple[int, int]:
    """(overflow, underflow) of an NVFP4 cast. Underflow: a finite nonzero ``x`` that decodes to
    0 -- its code is 0, or its block scale rounded to 0 in E4M3 (the whole block decodes to 0,
    whatever codes its elements got). Overflow: in a block with a nonzero scale, ``y`` rounds above
    E2M1's max and is clamped to +-6 (``y = float32(x * r)`` with the block multiplier of
    :func:`fp8sim.nvfp4.cast_multiplier`; compressed-tensors ``x / (b / G)``; round to nearest
    even); this happens when an E4M3 block scale rounds down by more than 1/6, i.e. it is
    subnormal."""
    from fp8sim.nvfp4 import cast_multiplier

    gran = parse_granularity(op.granularity)
    x = x.float().cpu()
    b = op.scale_inv.cpu().numpy()
    live = torch.isfinite(x) & (x != 0)
    dead = _expand_grid(torch.from_numpy(b == 0), gran.block, *x.shape)
    under = int(torch.count_nonzero(live & ((mag.cpu() == 0) | dead)))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if gran.variant == "compressed-tensors":
            div = torch.from_numpy((b / np.float32(op.tensor_scale)).astype(np.float32))
            y = x / _expand_grid(div, gran.block, *x.shape)
        else:
            r = torch.from_numpy(cast_multiplier(b, float(op.global_amax), gran.variant))
            y = x * _expand_grid(r, gran.block, *x.shape)
    thr = cast_thresholds(op.fmt, "rne")
    q = y.abs()
    over = q > thr.overflow_at
    if thr.overflow_tie:
        over |= q == thr.overflow_at
    return int(torch.count_nonzero(over & live & ~dead)), under


# -- the FP8 linear as two custom ops ---------------------------------------------------------------
# The forward and backward are torch custom ops (torch.library): opaque to torch.compile, which
# traces each layer's call without a graph break and without guards on the layer's name or
# policy state (the casts run eagerly inside the op, .item() and numpy included). An op takes
# tensors and plain values only, so a layer is passed as its key in _LAYERS (a weak registry:
# a layer that is gone is gone from it).

_LAYERS: "weakref.WeakValueDictionary[int, Fp8Linear]" = weakref.WeakValueDictionary()


def _saved_specs(layer: "Fp8Linear", m: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what the forward saves: codes + scale_inv of X (M, K) and W (N, K),
    or for MX the float32 X and W (the backward re-casts them along the other axis)."""
    k, n = layer.in_features, layer.out_features
    if layer.state.casts["activation"].granularity == "tensor":
        return [((m, k), torch.uint8), ((), torch.float32), ((n, k), torch.uint8), ((), torch.float32)]
    return [((m, k), torch.float32), ((0,), torch.float32), ((n, k), torch.float32), ((0,), torch.float32)]


@torch.library.custom_op("fp8sim::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], key: int,
                   out_dtype: torch.dtype, observe: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor]:
    """``y = x W^T + b`` on FP8 operands: float32 GEMM outside autocast, one rounding to
    ``out_dtype``; returns ``y`` (M, N) and the four tensors the backward needs.

    ``observe``: a training forward (else eval / no grad: the policies' current scales, nothing
    observed). Run inside a backward pass it is activation checkpointing's recomputed forward:
    the casts reuse this step's first forward's scales and observe nothing."""
    layer = _LAYERS[key]
    st = layer.state
    recompute = observe and in_backward()
    with torch.autocast(x.device.type, enabled=False):  # the emulated GEMM is never autocast
        x32 = x.detach().to(torch.float32)  # (M, K); exact from bf16 / fp16
        w32 = weight.detach().to(torch.float32)  # (N, K), or (K, N) for a transposed layer
        if layer.transposed:  # HF Conv1D stores W^T; the cast sees W (N, K), as nn.Linear's
            w32 = w32.t().contiguous()
        xq = st.cast(f"{layer.name}.input", "activation", x32, observe=observe, recompute=recompute)
        wq = st.cast(f"{layer.name}.weight", "weight", w32, observe=observe, recompute=recompute)
        y = st.gemm(xq, wq)  # (M, N) float32
        if bias is not None:  # the GEMM epilogue's float32 add, before the one rounding
            y = y + bias.detach().to(torch.float32)
    if xq.granularity == "tensor":
        saved = (xq.codes, xq.scale_inv, wq.codes, wq.scale_inv)
    else:  # MX re-casts along the other axis in backward, from the high-precision tensors
        empty = torch.zeros(0, dtype=torch.float32)
        saved = (x32, empty, w32, empty.clone())
    # outputs of a custom op may not alias its inputs or each other
    saved = tuple(t.reshape(shape).to(dtype).clone() for t, (shape, dtype) in zip(saved, _saved_specs(layer, x.shape[0])))
    return (y.to(out_dtype),) + saved


@_fp8_linear_op.register_fake
def _(x, weight, bias, key, out_dtype, observe):
    layer = _LAYERS[key]
    m = x.shape[0]
    y = x.new_empty((m, layer.out_features), dtype=out_dtype)
    return (y,) + tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in _saved_specs(layer, m))


@torch.library.custom_op("fp8sim::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward_op(gy: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor,
                            s3: torch.Tensor, key: int, observe: bool, x_dtype: torch.dtype, w_dtype: torch.dtype,
                            b_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dX = dY W`` and ``dW = dY^T X`` on FP8 operands (and ``db``, empty without a bias), in
    the dtypes of x, the stored weight (its layout too) and the bias."""
    layer = _LAYERS[key]
    st = layer.state
    fmt_x, fmt_w = st.formats["activation"], st.formats["weight"]
    with torch.autocast(gy.device.type, enabled=False):
        gy = gy.to(torch.float32).contiguous()  # (M, N); exact from bf16 / fp16
        gq = st.cast(f"{layer.name}.grad_output", "grad_output", gy, observe=observe)
        if s0.dtype == torch.uint8:  # tensor scaling: the FP8 X and W of the forward
            xq, wq = Fp8Operand(s0, s1, fmt_x), Fp8Operand(s2, s3, fmt_w)
            dx = st.gemm(gq, wq.t())  # (M, N) x (N, K) -> (M, K)
            dw = st.gemm(gq.t(), xq.t())  # (N, M) x (M, K) -> (N, K)
        else:  # blocks along each GEMM's reduction axis, cast from the high-precision tensors
            x, w = s0, s2
            r, c = parse_granularity(st.casts["weight"].granularity).block
            if r == c:  # square tiles: the forward's quantized W (the same cast of the same w), transposed
                wt = st.cast(f"{layer.name}.weight", "weight", w, observe=False).t()  # (K, N)
            else:
                wt = st.cast(f"{layer.name}.weight", "weight", w.t().contiguous(), observe=False)  # (K, N)
            # the weight-gradient operands, reduced along the tokens: (N, M) and (K, M)
            gt = st.cast(f"{layer.name}.grad_output", "grad_output", gy.t().contiguous(), observe=False, wgrad=True)
            xt = st.cast(f"{layer.name}.input", "activation", x.t().contiguous(), observe=False, wgrad=True)
            dx = st.gemm(gq, wt)
            dw = st.gemm(gt, xt)
        if "weight_grad" in st.casts:  # FP8-LM O1: the weight gradient itself travels in FP8
            dwq = st.cast(f"{layer.name}.weight_grad", "weight_grad", dw, observe=observe)
            dw = _dequantize_blocks(dwq) if dwq.granularity != "tensor" else st.backend.dequantize(
                dwq.codes, dwq.fmt, dwq.scale_inv, out_dtype=torch.float32)
        db = gy.sum(0).to(b_dtype) if b_dtype is not None else gy.new_zeros(0)
    if layer.transposed:
        dw = dw.t()  # (K, N), the stored layout
    return dx.to(x_dtype), dw.to(w_dtype).contiguous(), db


@_fp8_linear_backward_op.register_fake
def _(gy, s0, s1, s2, s3, key, observe, x_dtype, w_dtype, b_dtype):
    layer = _LAYERS[key]
    m, k, n = gy.shape[0], layer.in_features, layer.out_features
    w_shape = (k, n) if layer.transposed else (n, k)
    db = gy.new_empty((n,), dtype=b_dtype) if b_dtype is not None else gy.new_empty((0,), dtype=gy.dtype)
    return gy.new_empty((m, k), dtype=x_dtype), gy.new_empty(w_shape, dtype=w_dtype), db


def _fp8_linear_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, key, out_dtype, observe = inputs
    ctx.save_for_backward(*output[1:])
    ctx.key, ctx.observe = key, observe
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)


def _fp8_linear_autograd(ctx, gy, *unused):
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    dx, dw, db = _fp8_linear_backward_op(gy, *ctx.saved_tensors, ctx.key, ctx.observe, x_dtype, w_dtype, b_dtype)
    return dx, dw, (db if b_dtype is not None else None), None, None, None


_fp8_linear_op.register_autograd(_fp8_linear_autograd, setup_context=_fp8_linear_setup_context)


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a checkpointed forward is recomputed
    inside one, both by ``torch.utils.checkpoint`` and by Hugging Face's checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class Fp8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` (or a subclass, or Hugging Face's ``Conv1D``) whose GEMMs run
    in FP8 (see the module docstring).

    Shares ``weight``/``bias`` Parameters with the module it replaces, in their stored layout and
    dtype: ``transposed`` is True for ``Conv1D``, whose weight is (in, out) and ``y = x W + b``;
    the casts and traces see ``W`` as (out, in) either way, and the gradient comes back in the
    stored layout. ``name`` is its qualified module name (the prefix of its tensors' names in
    policies and traces).

    The output has the input's dtype, or autocast's (``torch.get_autocast_dtype``) inside an
    autocast region: the float32 GEMM result plus bias is rounded once to it. The policies
    observe only forwards in training mode with autograd enabled (``model.eval()`` or
    ``torch.no_grad()`` cast with the current scales and record nothing). The layer's share of
    the FP8 state (its tensors' policy states, the step) is its ``_extra_state`` in
    ``state_dict()``.
    """

    def __init__(self, module: nn.Module, name: str, state: Fp8State) -> None:
        super().__init__()
        self.transposed = is_hf_conv1d(module)
        if self.transposed:
            self.in_features, self.out_features = module.weight.shape
        else:
            self.in_features, self.out_features = module.in_features, module.out_features
        self.weight = module.weight
        self.bias = module.bias
        self.name = name
        self.state = state  # plain attribute: shared, not a submodule
        self._key = id(self)  # this layer in the custom ops' registry
        _LAYERS[self._key] = self

    def __setstate__(self, state: dict) -> None:  # copy.deepcopy, pickle: the copy is its own layer
        super().__setstate__(state)
        self._key = id(self)
        _LAYERS[self._key] = self

    def tensor_names(self) -> set[str]:
        """The names of this layer's tensors in the policies and traces."""
        return {f"{self.name}.{r}" for r in ("input", "weight", "grad_output", "weight_grad")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K), M = prod(lead)
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        observe = self.training and torch.is_grad_enabled()  # eval / no grad: nothing observed
        y = _fp8_linear_op(x2, self.weight, self.bias, self._key, out_dtype, observe)[0]  # (M, N)
        return y.view(*lead, self.out_features)

    # -- the FP8 state in state_dict() ----------------------------------------------------------
    def get_extra_state(self) -> dict:
        out = self.state.layer_state(self.tensor_names())
        if self.state.extra_states and fp8_linears_first(self):
            out["extra"] = {k: v.state_dict() for k, v in self.state.extra_states.items()}
        return out

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict) or "policies" not in state:
            raise ValueError(f"{self.name}: FP8 extra state must be a dict saved by Fp8Linear, got {type(state).__name__}")
        self.state.load_layer_state(self.tensor_names(), state)
        for key, sd in state.get("extra", {}).items():
            if key not in self.state.extra_states:
                raise ValueError(f"{self.name}: the saved FP8 state holds {key!r}, which this model was not "
                                 f"prepared with (prepare it as the saved one was)")
            self.state.extra_states[key].load_state_dict(sd)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a state dict saved before conversion has no FP8 state: the layer keeps its fresh one
        had = prefix + "_extra_state" in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not had and prefix + "_extra_state" in missing_keys:
            missing_keys.remove(prefix + "_extra_state")

    def extra_repr(self) -> str:
        roles = ", ".join(f"{r}={c.fmt}" for r, c in self.state.casts.items())
        layout = ", transposed (HF Conv1D)" if self.transposed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {roles}{layout}"


def fp8_linears_first(layer: Fp8Linear) -> bool:
    """Whether ``layer`` is the first converted layer of its state (it carries the shared extras)."""
    return layer.state.first_layer == layer.name


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (checked by class, without importing
    transformers): weight (in, out), ``y = x W + b``."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers.") for c in type(module).__mro__)
