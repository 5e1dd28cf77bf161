"""Scaling policies: the rules that choose the multiplier applied before each cast, over steps.

Two objects per policy:

* a **config** -- a frozen, typed dataclass (:class:`CurrentScalingConfig`,
  :class:`DelayedScalingConfig`, :class:`MSAMPScalingConfig`, :class:`AutoScaleConfig`,
  :class:`StaticScalingConfig`): what a recipe holds and what ``"name:key=value"`` specs parse
  into (:func:`parse_scaling`, once, at the edges);
* a **policy** -- the stateful object built from it (:func:`build_policy`), holding per-tensor
  state keyed by tensor name: ``scale_for(name, fmt, current_amax)``, ``observe(name, amax, fmt,
  **stats)``, ``state_dict()`` / ``load_state_dict()`` (plain Python data, so a run resumes and a
  trace replays step by step with the same results).

Casts go through :class:`fp8sim.quantizer.Quantizer` (policy + granularity + format + rounding),
the one place that runs amax -> scale -> cast -> observe, for training, replay and analysis alike.
A scaling config says *when* the amax is taken (this step's, a history's); the granularity
(:class:`fp8sim.scaling.Granularity`: tensor, row, block, MX, NVFP4) says *over what*. Block
granularities take their scales just in time from each block's amax with the ``current`` rule
(MX: the E8M0 rule; NVFP4: the two-level rule).

Policies and their exact rules (``fp8sim policies`` lists them with their parameters):

* ``current`` -- just in time: :func:`fp8sim.scaling.scale_from_amax` of this step's amax
  (amax 0 / inf / NaN gives 1), with ``margin``, ``pow2`` and ``epsilon``.
* ``delayed`` -- Transformer Engine's ``DelayedScaling``: the amax history holds the last
  ``history`` amaxes (zeros before the first steps), rolled at every step whose amax is not 0 (TE's
  bulk update leaves history and scale alone on an amax of 0); the reduced amax is their maximum
  (``algo=max``; NaN entries are skipped as CUDA ``fmaxf`` does, an inf is kept) or this step's
  amax (``most_recent``). If it is finite and > 0 the new scale is
  ``float32(float32(fmax * 2**-margin) / amax)`` (TE's order; inf -> float32 max), else the
  previous scale stays. The scale computed after step ``t`` is used at step ``t + 1``; step 0: 1.
* ``msamp`` -- MS-AMP's ``ScalingMeta``: power-of-two scales
  ``2**(floor(log2(fmax / amax)) - margin)``. Just in time (this step's amax) while warming up
  (the first ``window`` steps, again after a non-finite amax) and always for ``window=1``; then the
  scale computed after the previous step from the max over the last ``window`` amaxes
  (NaN-propagating, as ``torch.max``). A non-finite amax keeps the scale and restarts the warm-up.
  MS-AMP uses window 16 for activations and output gradients, 1 for weights and weight gradients.
* ``autoscale`` -- FP8-LM's automatic scaling of gradients (arXiv:2310.18313, section 2.2): the
  scale is ``mu * base`` (``base``: ``current`` amax scaling, ``pow2`` the same rounded down to a
  power of two, or ``none`` = 1). After each step, if the share of values that landed on
  ``+-fmt.max`` exceeds ``ratio``, ``mu`` halves; otherwise it grows geometrically from its value
  right after the last halving, ``mu_0``, to ``mu_max`` over ``window`` steps:
  ``mu_k = mu_0 * (mu_max / mu_0) ** (k / window)`` after ``k`` clean steps, exactly ``mu_max`` from
  ``k = window`` on (and never above it). ``mu`` starts at ``mu_init`` and never drops below
  ``2**-126``. With one process and ``base=current`` the amax maps to ``mu * fmt.max``, so
  ``mu > 1`` deliberately saturates the top of the range: ``mu`` is the headroom an all-reduce sum
  needs, and the observed share of saturated values steers it.
* ``static`` -- a fixed scale.
* ``torchao`` -- torchao.float8's dynamic scaling (:class:`TorchaoScalingConfig`): this step's
  amax, ``float32(fmax / max(float64(amax), 1e-12))``, optionally ``exp2(floor(log2(scale)))``.

Spec strings also name block scalings, which parse into a granularity and ``current``:
``mx`` / ``mx:rceil`` (E8M0 scales per 32 elements), ``nvfp4[:layout=..,variant=..]`` (NVFP4's
two levels) and ``current:gran=row|col|block:RxC``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import fields
from typing import Any, ClassVar

import numpy as np

from fp8sim.formats import FloatFormat, get_format
from fp8sim.policy_params import format_param
from fp8sim.scaling import (Granularity, ScaledTensor, block_multiplier, compute_amax, quantize_scaled,
                            scale_from_amax)  # fmt: skip
from fp8sim.scaling_config import (POLICY_SPECS, AmaxAlgo, AutoScaleBase, AutoScaleConfig, CurrentScalingConfig,
                                   DelayedScalingConfig, MSAMPScalingConfig, ScalingConfig, StaticScalingConfig,
                                   TorchaoScalingConfig, parse_scaling, scaling_spec)  # fmt: skip
from fp8sim.scaling_config import plain_value

# the configs and the spec language are fp8sim.scaling_config's (imported here for the policies)
__all__ = [
    "ScalingPolicy",
    "CurrentScaling",
    "DelayedScaling",
    "MSAMPScaling",
    "AutoScale",
    "StaticScaling",
    "TorchaoScaling",
    "MXScaling",
    "NVFP4Scaling",
    "POLICY_SPECS",
    "parse_scaling",
    "scaling_spec",
    "parse_policy",
    "build_policy",
    "format_param",
]

_F32_MAX = float(np.finfo(np.float32).max)
_MU_FLOOR = 2.0**-126


def _f32(v: float) -> float:
    """``v`` rounded to float32, as a Python float (the value a GPU would hold)."""
    return float(np.float32(v))


def _check_amax(amax: Any, where: str) -> float:
    try:
        a = float(amax)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: amax must be a real number, got {type(amax).__name__}") from None
    if a < 0:
        raise ValueError(f"{where}: amax must be >= 0 (a max of |x|), got {a}")
    return _f32(a)


# -- policies: the state over steps ------------------------------------------------------------------


class ScalingPolicy:
    """Base of the stateful policies: one object serves many tensors, keyed by name.

    Per step and tensor the caller (:class:`fp8sim.quantizer.Quantizer`) asks
    ``scale_for(name, fmt, current_amax=amax)`` (``current_amax`` needed only when
    ``just_in_time``), casts, then reports ``observe(name, amax, fmt, **stats)`` once.

    Attributes:
        config: the frozen :class:`ScalingConfig`.
        spec: canonical spec string (:func:`parse_policy` of it builds an equal policy).
        just_in_time: whether :meth:`scale_for` may need this step's amax.
        granularity: the granularity a spec named (``"tensor"`` unless ``gran=``, ``mx``,
            ``nvfp4``): what :meth:`quantize` casts with.
    """

    Config: ClassVar[type[ScalingConfig]] = ScalingConfig

    def __init__(self, config: ScalingConfig | None = None, /, **params: Any) -> None:
        if config is None:
            config = self.Config.from_params(params)
        elif params or not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__}: pass a {self.Config.__name__} or keyword parameters")
        self.config = config
        self._granularity = Granularity.tensor()
        self._tensors: dict[str, dict] = {}

    # -- identity ----------------------------------------------------------------------------
    @property
    def NAME(self) -> str:  # noqa: N802 (the spec name, as the classes' old attribute)
        return self.config.NAME

    @property
    def params(self) -> dict[str, Any]:
        """The spec's parameters as plain data (enum members as their values)."""
        g = self._granularity
        if g.kind == "mx":
            return {"rule": g.mx_rule.value}
        if g.kind == "nvfp4":
            return {"layout": "x".join(map(str, g.block)), "variant": g.variant}
        out = {f.name: plain_value(getattr(self.config, f.name)) for f in fields(self.config)}
        if isinstance(self.config, (CurrentScalingConfig, TorchaoScalingConfig)):
            out["gran"] = g.spec
        return out

    @property
    def spec(self) -> str:
        return scaling_spec(self.config, self._granularity)

    @property
    def granularity(self) -> str:
        return self._granularity.spec

    @property
    def just_in_time(self) -> bool:
        return self.config.just_in_time

    def __repr__(self) -> str:
        return f"parse_policy({self.spec!r})"

    # -- the protocol --------------------------------------------------------------------------
    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        """The multiplier applied to tensor ``name`` before its cast to ``fmt`` this step."""
        raise NotImplementedError

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        """Record this step's ``amax`` of tensor ``name`` (once per step, after the cast).

        ``stats`` may carry ``numel`` and ``n_at_max`` (values cast to +-fmt.max) or
        ``overflow`` (the trace's count); policies that need none of them ignore them."""
        _check_amax(amax, f"{self.NAME}.observe({name!r})")

    def state_dict(self) -> dict:
        """``{"policy": spec, "tensors": {name: plain-data state}}``."""
        return {"policy": self.spec, "tensors": {k: _copy_state(v) for k, v in self._tensors.items()}}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict` of a policy with the same spec (ValueError otherwise)."""
        if not isinstance(d, dict) or "policy" not in d or "tensors" not in d:
            raise ValueError("load_state_dict: expected a dict with 'policy' and 'tensors' keys")
        if d["policy"] != self.spec:
            raise ValueError(f"load_state_dict: state is for {d['policy']!r}, this policy is {self.spec!r}")
        self._tensors = {str(k): _copy_state(v) for k, v in d["tensors"].items()}

    def quantize(self, name: str, x: Any, fmt: FloatFormat | str, *, observe: bool = True, **cast: Any) -> ScaledTensor:
        """Deprecated (casting is the quantizer's; a policy decides scales): amax -> scale -> cast
        -> observe of a numpy array or CPU tensor with the numpy reference cast
        (:func:`fp8sim.scaling.quantize_scaled`; ``cast``: ``rounding``, ``saturate``, ``seed``,
        ``srbits``). Use ``fp8sim.quantizer.Quantizer(CastConfig(fmt, policy.config,
        granularity), backend).quantize``."""
        warnings.warn("ScalingPolicy.quantize is deprecated and will be removed in the next release; use "
                      "fp8sim.quantizer.Quantizer(CastConfig(fmt, policy.config, granularity), backend).quantize",
                      DeprecationWarning, stacklevel=2)
        g = self._granularity
        fmt = get_format("e2m1" if g.kind == "nvfp4" else fmt)
        amax = float(compute_amax(x, "tensor", ignore_nan=True))
        if g.kind == "tensor":
            st = quantize_scaled(x, fmt, g, scale=self.scale_for(name, fmt, current_amax=amax), **cast)
        else:
            c = self.config
            rule = {} if g.kind in ("mx", "nvfp4") else {"margin": c.margin, "pow2": c.pow2, "epsilon": c.epsilon}
            st = quantize_scaled(x, fmt, g, **rule, **cast)
        if observe:
            mag = st.codes & (fmt.sign_mask - 1) if fmt.signed else st.codes
            self.observe(name, amax, fmt, numel=int(st.codes.size),
                         n_at_max=int(np.count_nonzero(mag == fmt.max_code)), n_nan=st.nan_count)
        return st

    # -- helpers of the subclasses ---------------------------------------------------------------
    def _state(self, name: str) -> dict:
        if not isinstance(name, str):
            raise TypeError(f"{self.NAME}: tensor name must be a string, got {type(name).__name__}")
        st = self._tensors.get(name)
        if st is None:
            st = self._tensors[name] = self._fresh_state()
        return st

    def _fresh_state(self) -> dict:
        return {}

    def _need_amax(self, name: str, current_amax: float | None) -> float:
        if current_amax is None:
            raise ValueError(f"{self.spec}: scale_for({name!r}) needs current_amax (this policy scales just in time)")
        return _check_amax(current_amax, f"{self.NAME}.scale_for({name!r})")


def _copy_state(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _copy_state(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_copy_state(x) for x in v]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    return v


class CurrentScaling(ScalingPolicy):
    Config = CurrentScalingConfig

    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        a = self._need_amax(name, current_amax)
        c = self.config
        return float(scale_from_amax(a, get_format(fmt), margin=c.margin, pow2=c.pow2, epsilon=c.epsilon))


class DelayedScaling(ScalingPolicy):
    Config = DelayedScalingConfig

    def _fresh_state(self) -> dict:
        return {"scale": 1.0, "amax_history": [0.0] * self.config.history, "steps": 0}

    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        st = self._tensors.get(name)
        return 1.0 if st is None else st["scale"]

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        a = _check_amax(amax, f"delayed.observe({name!r})")
        fmt = get_format(fmt)
        st = self._state(name)
        if a == 0.0:
            # Transformer Engine's fused update (delayed_scaling.cu, kernel_bulk) neither rolls
            # the history nor changes the scale for an amax of 0
            return
        hist = st["amax_history"][1:] + [a]  # oldest first; the window includes this step
        st["amax_history"] = hist
        st["steps"] += 1
        if self.config.algo == AmaxAlgo.MAX:
            reduced = float(np.fmax.reduce(np.array([0.0] + hist, np.float32)))  # fmaxf from 0
        else:
            reduced = a
        if math.isfinite(reduced) and reduced > 0:
            st["scale"] = float(scale_from_amax(reduced, fmt, margin=self.config.margin))
        # else: amax 0, inf or NaN keeps the previous scale (never inf: it started at 1)


def _msamp_scale(amax: float, prev: float, fmt: FloatFormat, margin: int) -> float:
    """``2**(floor(log2(fmax / amax)) - margin)``, the exponent clamped to [-126, 127];
    ``prev`` for amax 0, inf or NaN. The floor is exact on the float32 quotient (an inf
    quotient counts as float32 max, so a tiny amax gives 2**127, not MS-AMP's inf)."""
    if not (math.isfinite(amax) and amax > 0):
        return prev
    s = scale_from_amax(amax, fmt, pow2=True)
    e = int(np.frexp(s)[1]) - 1 - int(margin)
    return 2.0 ** min(max(e, -126), 127)


class MSAMPScaling(ScalingPolicy):
    Config = MSAMPScalingConfig

    def _fresh_state(self) -> dict:
        # amax_window[0] is this step's slot (MS-AMP's meta.amax[0]); counter counts steps
        # since the start or the last non-finite amax
        return {"scale": 1.0, "amax_window": [0.0] * self.config.window, "counter": 0}

    def _in_time(self, st: dict) -> bool:
        return self.config.window == 1 or st["counter"] < self.config.window

    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        st = self._tensors.get(name) or self._fresh_state()
        if not self._in_time(st):
            return st["scale"]
        a = self._need_amax(name, current_amax)
        return _msamp_scale(a, st["scale"], get_format(fmt), self.config.margin)

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        a = _check_amax(amax, f"msamp.observe({name!r})")
        fmt, margin = get_format(fmt), self.config.margin
        st = self._state(name)
        window = st["amax_window"]
        window[0] = a
        if self._in_time(st):  # the cast recomputed the scale from this amax
            st["scale"] = _msamp_scale(a, st["scale"], fmt, margin)
        # end of step (MS-AMP's optimizer): scale from the window max, then roll
        wmax = float(np.max(np.array(window, np.float32)))  # NaN-propagating
        if math.isfinite(a):
            st["scale"] = _msamp_scale(wmax, st["scale"], fmt, margin)
            st["counter"] += 1
        else:
            st["counter"] = 0
        st["amax_window"] = window[-1:] + window[:-1]


class AutoScale(ScalingPolicy):
    Config = AutoScaleConfig

    def _fresh_state(self) -> dict:
        mu = self.config.mu_init
        return {"mu": mu, "mu_from": mu, "clean_steps": 0, "halvings": 0}

    def mu(self, name: str) -> float:
        """The current factor mu of tensor ``name``."""
        st = self._tensors.get(name)
        return self.config.mu_init if st is None else st["mu"]

    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        mu = self.mu(name)
        if self.config.base == AutoScaleBase.NONE:
            return _f32(mu)
        a = self._need_amax(name, current_amax)
        base = scale_from_amax(a, get_format(fmt), pow2=self.config.base == AutoScaleBase.POW2)
        with np.errstate(over="ignore"):
            scale = np.float32(mu) * np.float32(base)
        return float(min(scale, _F32_MAX))  # mu * base may pass float32 max: clamp, never inf

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        _check_amax(amax, f"autoscale.observe({name!r})")
        share = _share_at_max(name, stats)
        c, st = self.config, self._state(name)
        if share > c.ratio:
            st["mu"] = max(st["mu"] / 2, _MU_FLOOR)
            st["mu_from"], st["clean_steps"] = st["mu"], 0
            st["halvings"] += 1
            return
        st["clean_steps"] += 1
        k, mu0, top = st["clean_steps"], st["mu_from"], c.mu_max
        if k >= c.window or mu0 >= top:
            st["mu"] = top
        else:
            st["mu"] = min(top, mu0 * (top / mu0) ** (k / c.window))


def _share_at_max(name: str, stats: dict) -> float:
    at_max = stats.get("n_at_max", stats.get("overflow"))
    numel = stats.get("numel")
    if at_max is None or numel is None:
        raise ValueError(f"autoscale.observe({name!r}) needs numel= and n_at_max= (or overflow=) stats: "
                         "the share of values cast to +-fmax steers mu")
    numel, at_max = int(numel), int(at_max)
    if numel < 0 or not 0 <= at_max <= max(numel, 0):
        raise ValueError(f"autoscale.observe({name!r}): need 0 <= n_at_max <= numel, got {at_max}, {numel}")
    return at_max / numel if numel else 0.0


class StaticScaling(ScalingPolicy):
    Config = StaticScalingConfig

    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        return _f32(self.config.scale)


class TorchaoScaling(ScalingPolicy):
    Config = TorchaoScalingConfig

    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        import torch

        from fp8sim.scaling_torch import torchao_scale

        a = torch.tensor(float(self._need_amax(name, current_amax)), dtype=torch.float32)
        return float(torchao_scale(a, fmt, pow2=self.config.pow2))


class _BlockPolicy(CurrentScaling):
    """``current`` on a block granularity, as the ``mx`` and ``nvfp4`` spec names build it:
    ``scale_for`` gives the multiplier of the block whose amax is ``current_amax``
    (:func:`fp8sim.scaling.block_multiplier`)."""

    def scale_for(self, name: str, fmt: FloatFormat | str, current_amax: float | None = None) -> float:
        a = self._need_amax(name, current_amax)
        return float(block_multiplier(self._granularity, a, fmt))


class MXScaling(_BlockPolicy):
    """Deprecated view of ``Granularity.mx(rule)`` with ``current`` scaling (spec ``mx``)."""

    def __init__(self, config: ScalingConfig | None = None, /, rule: str = "floor") -> None:
        super().__init__(config)
        self._granularity = Granularity.mx(rule)


class NVFP4Scaling(_BlockPolicy):
    """Deprecated view of ``Granularity.nvfp4(layout, variant)`` with ``current`` (spec ``nvfp4``)."""

    def __init__(self, config: ScalingConfig | None = None, /, layout: str = "1x16", variant: str = "te") -> None:
        super().__init__(config)
        self._granularity = Granularity.nvfp4(layout, variant)

    def quantize(self, name: str, x: Any, fmt: FloatFormat | str = "e2m1", *, observe: bool = True,
                 **cast: Any) -> ScaledTensor:  # fmt: skip
        """NVFP4's cast: E2M1 whatever ``fmt`` says (``saturate=False`` is refused)."""
        return super().quantize(name, x, "e2m1", observe=observe, **cast)


_POLICY_OF: dict[type[ScalingConfig], type[ScalingPolicy]] = {
    p.Config: p for p in (CurrentScaling, DelayedScaling, MSAMPScaling, AutoScale, StaticScaling, TorchaoScaling)
}


def build_policy(config: ScalingConfig) -> ScalingPolicy:
    """A fresh stateful policy with ``config`` (its class is the config's: ``DelayedScalingConfig``
    builds a :class:`DelayedScaling`, ...)."""
    return _POLICY_OF[type(config)](config)

def parse_policy(spec: str | ScalingPolicy) -> ScalingPolicy:
    """A fresh stateful policy from a spec (see :func:`parse_scaling`); a policy is returned
    as is. ``mx`` and ``nvfp4`` specs give :class:`MXScaling` / :class:`NVFP4Scaling`, which
    cast with their block granularity."""
    if isinstance(spec, ScalingPolicy):
        return spec
    config, gran = parse_scaling(spec)
    if gran.kind == "mx":
        return _with_granularity(MXScaling(config), gran)
    if gran.kind == "nvfp4":
        return _with_granularity(NVFP4Scaling(config), gran)
    return _with_granularity(build_policy(config), gran)


def _with_granularity(policy: ScalingPolicy, gran: Granularity) -> ScalingPolicy:
    policy._granularity = gran
    return policy

