"""The shared state of a model's FP8 linear layers: :class:`Fp8State` (casts, scaling policies,
the step, event counts, the FP8 GEMM) and :class:`Fp8Operand` (codes with their scales). The
layer and its custom ops: :mod:`fp8sim.training.fp8_linear`; the semantics of the casts and
GEMMs: that module's docstring.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

from fp8sim.quantizer import QuantizedTensor, Quantizer, stochastic_seed
from fp8sim.recipes import CastConfig, GemmRule, LinearRecipe
from fp8sim.trace import cast_thresholds
from fp8sim.training.forward_calls import CastRecord, ForwardCall, ForwardCalls

__all__ = ["Fp8State", "Fp8Operand", "Tap", "ExpertTap", "encode_extra_state", "decode_extra_state",
           "dequantize_blocks"]

#: a recorder tap: (tensor name, role, float tensor as cast, cast config, scale used, operand)
Tap = Callable[[str, str, torch.Tensor, CastConfig, Any, QuantizedTensor], None]

#: a tap of the MoE experts' casts: a :data:`Tap`'s arguments and the expert's index
ExpertTap = Callable[[str, str, torch.Tensor, CastConfig, Any, QuantizedTensor, int], None]

#: the cast tensor of the training path (the quantizer's one result type)
Fp8Operand = QuantizedTensor


class Fp8State:
    """What the FP8 linears of one model share: backend, one quantizer per role, step, counters.

    Attributes:
        backend: the backend object doing every cast and GEMM.
        quantizers: role -> :class:`fp8sim.quantizer.Quantizer` (``activation``, ``weight``,
            ``grad_output``, optionally ``weight_grad``); ``policies`` gives their policies.
        step: the training step the casts belong to (set by the trainer, used for stochastic
            rounding seeds and by recorders).
        events: ``{"overflow": n, "underflow": n}`` since the last :meth:`pop_events`.
        taps: recorder callbacks, called once per observed cast of a linear layer;
            ``expert_taps``: the same for MoE experts' casts, with the expert's index.
        summary: which parameters run in FP8, which stay in high precision and why
            (:class:`~fp8sim.training.coverage.Fp8Summary`, set by ``convert_to_fp8``).
        observing: False in evaluation: casts use the current scales but update no policy,
            count nothing and call no tap.
        gemm_rule: the recipe's :class:`~fp8sim.recipes.GemmRule`.
        gemm_accumulate: the ``accumulate=`` of the ``exact`` rule's tensor-scaled GEMMs
            (``"float32"`` or ``"float64"``, see :mod:`fp8sim.training.fp8_linear`), or None for
            a backend that takes none.
        amax_reduction: how each cast's tensor amax (and NVFP4's global amax; never block amaxes)
            is reduced across processes before its scale is decided: None (each process its
            own), a ``torch.distributed`` process group (MAX across it,
            :func:`fp8sim.quantizer.max_across`), a callable on a float32 tensor of amaxes, or
            ``"auto"``: decided at the first cast -- MAX across the default process group when
            ``torch.distributed`` is initialized with more than one rank, else none (Transformer
            Engine's amax reduction group). With a reduction every rank must run the same casts
            in the same order (they are collectives), and the scaling policies see the same
            amaxes, so their states are identical on every rank.
    """

    def __init__(self, recipe: LinearRecipe, backend: str | Any, *, count_events: bool = True,
                 gemm_accumulate: str | None = "float32", recipe_name: str | None = None,
                 amax_reduction: Any = None) -> None:
        from fp8sim import backends

        self.recipe = recipe
        self.backend = backends.get(backend) if isinstance(backend, str) else backend
        self.backend_name = backend if isinstance(backend, str) else type(backend).__name__
        self.casts = recipe.casts()
        self._auto_reduction = isinstance(amax_reduction, str)
        if self._auto_reduction and amax_reduction != "auto":
            raise ValueError(f"Fp8State: amax_reduction must be None, 'auto', a process group or a callable, "
                             f"got {amax_reduction!r}")
        reduction = None if self._auto_reduction else amax_reduction
        self.quantizers = {role: Quantizer(c, self.backend, amax_reduction=reduction)
                           for role, c in self.casts.items()}
        if recipe.weight_dgrad is not None:  # the weight's re-cast for the dX GEMM (observes nothing)
            self.quantizers["weight_dgrad"] = Quantizer(recipe.weight_dgrad, self.backend, amax_reduction=reduction)
        self.formats = {role: c.fmt for role, c in self.casts.items()}
        self.gemm_rule = recipe.gemm_rule
        self._check_casts(recipe_name)
        self._step = 0
        self._explicit_step = False
        #: the live observed forward calls, for activation checkpointing's recompute
        #: (:mod:`fp8sim.training.forward_calls`)
        self.calls = ForwardCalls()
        self._last_cast: dict[str, CastRecord] = {}  # tensor name -> its last observed cast
        #: objects with state_dict/load_state_dict whose state travels with the model's state
        #: dict (in the first FP8 layer's ``_extra_state``), e.g. FP8-LM's gradient reducer
        self.extra_states: dict[str, Any] = {}
        self.count_events = count_events
        self.events: Counter = Counter()
        self.taps: list[Tap] = []
        #: taps of the MoE experts' casts, called as ``tap(name, role, x, cast, scale, op, expert)``
        #: with the expert's index (one grouped GEMM casts every expert's operands)
        self.expert_taps: list[ExpertTap] = []
        self.observing = True
        self.first_layer: str | None = None  # the converted layer that carries extra_states
        #: what :func:`~fp8sim.training.convert.convert_to_fp8` runs in FP8 and what it keeps in high
        #: precision (:class:`~fp8sim.training.coverage.Fp8Summary`)
        self.summary: Any = None
        self._root_hook: Any = None  # the handle of convert_to_fp8's step hook on the root module
        self.gemm_accumulate = gemm_accumulate

    @property
    def policies(self) -> dict[str, Any]:
        """Role -> the stateful scaling policy of its quantizer."""
        return {role: q.policy for role, q in self.quantizers.items()}

    @property
    def gemm_accumulate(self) -> str | None:
        return self._accumulate

    @gemm_accumulate.setter
    def gemm_accumulate(self, mode: str | None) -> None:
        from fp8sim.backends.base import GEMM_ACCUMULATIONS

        if mode is not None and mode not in GEMM_ACCUMULATIONS:
            raise ValueError(f"Fp8State: gemm_accumulate must be one of "
                             f"{', '.join(GEMM_ACCUMULATIONS)} or None, got {mode!r}")
        if mode == "float64" and self.gemm_rule != GemmRule.EXACT:
            raise ValueError(f"Fp8State: gemm_accumulate='float64' is the exact GEMM rule's; this recipe's GEMMs "
                             f"follow the {self.gemm_rule.value} rule")
        if mode == "float64" and any(c.granularity.kind not in ("tensor", "row") for c in self.casts.values()):
            raise ValueError("Fp8State: gemm_accumulate='float64' is for per-tensor scaled GEMMs; the block-scaled "
                             "ones (mx, block, nvfp4) accumulate in float32 (see fp8sim.backends.gemms)")
        modes = tuple(getattr(self.backend, "gemm_accumulations", ()))
        if mode == "float32" and not modes:  # the default: the backend's own float32 GEMM
            mode = None
        if mode is not None and mode not in modes:
            raise NotImplementedError(
                f"Fp8State: backend {self.backend_name} has no accumulate={mode!r} GEMM "
                f"(it offers {', '.join(modes) or 'only its own float32 GEMM'})"
            )
        self._accumulate = mode

    def _check_casts(self, recipe_name: str | None) -> None:
        """Refuse, before any step, a cast or GEMM this backend cannot do (one clear line)."""
        what = f"recipe {recipe_name}" if recipe_name else "FP8 recipe"
        for role, c in self.casts.items():
            if c.granularity.kind == "nvfp4" and not getattr(self.backend, "has_nvfp4", False):
                why = {"torch": "torch has no float32 -> E2M1 cast and no stochastic rounding"}.get(
                    self.backend_name, "it has no NVFP4 quantize")
                raise NotImplementedError(f"{what}: {role} granularity {c.granularity.spec} needs NVFP4 casts, "
                                          f"which backend {self.backend_name} does not offer ({why}); use the "
                                          f"emulator backend")
        if self.gemm_rule == GemmRule.ACCUMULATOR and type(self.backend).gemm_accumulator is _base_accumulator():
            raise NotImplementedError(f"{what}: gemm_rule 'accumulator' (fp8sim.gemm's model, numba on the host) "
                                      f"runs on the emulator backend, not {self.backend_name}")

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
    def forward_call(self, layer: str, x: torch.Tensor, *, observe: bool, recompute: bool,
                     checkpointed: bool) -> ForwardCall | None:
        """The :class:`~fp8sim.training.forward_calls.ForwardCall` a forward of ``layer`` on input
        ``x`` casts through, or None for a forward that observes nothing (eval, no grad).
        ``recompute``: activation checkpointing's recompute inside backward, a replay of the
        observed call with the same input; ``checkpointed``: a forward checkpointing may
        recompute (:meth:`ForwardCalls.begin`)."""
        if not (observe and self.observing):
            return None
        return self.calls.begin(layer, x, recompute=recompute, checkpointed=checkpointed)

    def cast(self, name: str, role: str, x: torch.Tensor, *, observe: bool = True,
             call: ForwardCall | None = None, wgrad: bool = False, expert: int | None = None) -> QuantizedTensor:
        """Cast ``x`` (2-D; blocks, if any, along the last axis) for tensor ``name`` in ``role``
        through its role's quantizer (:meth:`fp8sim.quantizer.Quantizer.quantize`).

        ``observe=False`` re-casts a tensor already cast this step (column-wise copies, eval
        and no-grad forwards): no policy update, no count, no tap. ``call``: the forward call
        the cast belongs to (:meth:`forward_call`); an observed call records the cast's step,
        scale and NVFP4 tensor amax, and a replay (activation checkpointing's recompute) casts
        with exactly those -- so with the same codes, its input being the same -- and observes
        nothing. ``wgrad=True``: ``x`` is the transposed copy (K or N, M) for the
        weight-gradient GEMM (the quantizer applies the cast's RHT), and stochastic rounding
        keys its stream with ``name + "^T"``. ``expert``: the MoE expert the cast belongs to
        (its observed casts go to :attr:`expert_taps` instead of :attr:`taps`).
        """
        if self._auto_reduction:
            self._resolve_auto_reduction()
        q = self.quantizers[role]
        record = call.casts.get(name) if call is not None and call.replay else None
        if call is not None and call.unmatched:  # see ForwardCall.unmatched
            last = self._last_cast.get(name)
            record = last if last is not None and last.step == self._step else None
        step = self._step if record is None else record.step
        observe = observe and self.observing and record is None
        seed = (stochastic_seed(step, name + "^T" if wgrad else name)
                if q.cast.rounding == "stochastic" else None)
        scale = record.scale if record is not None and q.granularity.kind == "tensor" else None
        op = q.quantize(name, x, observe=observe, scale=scale, seed=seed, wgrad=wgrad,
                        global_amax=None if record is None else record.global_amax)
        if not observe:  # re-casts, replays and eval passes leave no trace
            return op
        if call is not None:
            call.casts[name] = self._last_cast[name] = CastRecord(step, op.scale, op.global_amax)
        scale = float(op.scale) if op.granularity.kind == "tensor" else None  # per-row scales: see _count
        if self.count_events:
            self._count(x.detach(), op, scale, op.amax)
        if expert is None:
            for tap in self.taps:
                tap(name, role, x.detach(), self.casts[role], scale, op)
        else:
            for tap in self.expert_taps:
                tap(name, role, x.detach(), self.casts[role], scale, op, expert)
        return op

    def _resolve_auto_reduction(self) -> None:
        """``amax_reduction="auto"`` at the first cast: MAX across the default process group
        when one with more than one rank exists, else no reduction."""
        import torch.distributed as dist
        from fp8sim.quantizer import max_across

        self._auto_reduction = False
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            reduce = max_across(None)
            for q in self.quantizers.values():
                q.amax_reduction = reduce

    def seed_for(self, name: str) -> int:
        """The Philox key of a stochastic cast of tensor ``name`` at the current step
        (:func:`fp8sim.quantizer.stochastic_seed`; the column-wise copy of a weight-gradient
        operand is keyed by ``name + "^T"``), so a step's rounding is reproducible."""
        return stochastic_seed(self.step, name)

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
        if scale is None:  # row, MX, block:RxC: the block scale keeps every block's amax within max
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
    def gemm(self, a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
        """``A B^T`` in float32 for ``a`` (M, K) and ``b`` (N, K), both reduced along K: the
        backend's GEMM under the recipe's rule (:func:`fp8sim.backends.gemms.gemm`)."""
        return self.backend.gemm(a, b, self.gemm_rule, accumulate=self._accumulate)

    def grouped_gemm(self, a: list[QuantizedTensor], b: list[QuantizedTensor]) -> list[torch.Tensor]:
        """``A_g B_g^T`` in float32 for each pair of ``a`` (M_g, K_g) and ``b`` (N_g, K_g) -- the
        MoE experts' GEMMs, each on its own scales: the backend's grouped GEMM under the recipe's
        rule (:meth:`fp8sim.backends.base.Backend.grouped_gemm`)."""
        return self.backend.grouped_gemm(a, b, self.gemm_rule, accumulate=self._accumulate)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "policies": {r: p.state_dict() for r, p in self.policies.items()}}

    def load_state_dict(self, d: dict) -> None:
        self._step = int(d["step"])  # not the setter: a loop that never set the step still need not
        self._last_cast.clear()
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
        self._last_cast.clear()
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


def encode_extra_state(state: dict) -> torch.Tensor:
    """An FP8 layer's ``_extra_state`` as ``state_dict()`` holds it: the plain-data dict as UTF-8
    JSON in a uint8 tensor, so every state-dict format stores it (safetensors, through
    ``save_pretrained``; ``torch.load(weights_only=True)``) and loading it runs no code
    (floats round-trip exactly; inf and NaN as JSON's ``Infinity``/``NaN``)."""
    data = json.dumps(state, sort_keys=True, allow_nan=True).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_extra_state(value: Any, what: str) -> dict:
    """The dict of :func:`encode_extra_state` (a dict, as older checkpoints hold it, is taken as
    is); ValueError naming ``what`` for anything else."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        try:
            value = json.loads(value.cpu().numpy().tobytes().decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{what}: FP8 extra state is not the JSON an FP8 layer saves ({exc})") from None
    if not isinstance(value, dict) or "policies" not in value:
        raise ValueError(f"{what}: FP8 extra state must be what an FP8 layer saves (a uint8 tensor of JSON), "
                         f"got {type(value).__name__}")
    return value


def dequantize_blocks(op: QuantizedTensor, backend: Any = None) -> torch.Tensor:
    """Deprecated: the float32 values of a cast are ``backend.to_float(op)``."""
    from fp8sim import backends

    return (backend or backends.get("emulator")).to_float(op)


def _base_accumulator() -> Any:
    from fp8sim.backends.base import Backend

    return Backend.gemm_accumulator


def _nvfp4_events(x: torch.Tensor, op: Fp8Operand, mag: torch.Tensor) -> tuple[int, int]:
    """(overflow, underflow) of an NVFP4 cast. Underflow: a finite nonzero ``x`` that decodes to
    0 -- its code is 0, or its block scale rounded to 0 in E4M3 (the whole block decodes to 0,
    whatever codes its elements got). Overflow: in a block with a nonzero scale, ``y`` rounds above
    E2M1's max and is clamped to +-6 (``y = float32(x * r)`` with the block multiplier of
    :func:`fp8sim.nvfp4.cast_multiplier`; compressed-tensors ``x / (b / G)``; round to nearest
    even); this happens when an E4M3 block scale rounds down by more than 1/6, i.e. it is
    subnormal."""
    from fp8sim.backends.gemms import expand_grid as _expand_grid
    from fp8sim.nvfp4 import cast_multiplier

    gran = op.granularity
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
