"""The shared state of a model's FP8 linear layers: :class:`Fp8State` (casts, scaling policies,
the step, event counts, the FP8 GEMM) and :class:`Fp8Operand` (codes with their scales). The
layer and its custom ops: :mod:`fp8sim.training.fp8_linear`; the semantics of the casts and
GEMMs: that module's docstring.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from fp8sim.formats import FloatFormat, get_format
from fp8sim.scaling import parse_granularity
from fp8sim.trace import cast_thresholds
from fp8sim.training.recipes import CastConfig, LinearRecipe

__all__ = ["Fp8State", "Fp8Operand", "Tap", "dequantize_blocks"]

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
            return dequantize_blocks(a) @ dequantize_blocks(b).t()
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


def dequantize_blocks(op: Fp8Operand) -> torch.Tensor:
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
