"""Scaling policies: small stateful objects that choose the multiplier applied before each cast.

One policy object serves many tensors, keyed by name. Per training step and tensor, the caller

1. asks ``scale = policy.scale_for(name, fmt, current_amax=amax)`` (``current_amax`` is needed
   only when ``policy.just_in_time``; the others ignore it),
2. casts ``encode(float32(x) * scale)`` (see :func:`fp8sim.scaling.quantize_scaled`),
3. reports ``policy.observe(name, amax, fmt, **stats)`` once, after the cast.

:meth:`ScalingPolicy.quantize` does all three on an array. ``state_dict()`` /
``load_state_dict()`` hold plain Python data (floats, ints, lists, strings), so a run can resume
and a trace can be replayed step by step with the same results.

Policies and their exact rules (specs parsed by :func:`parse_policy`; ``fp8sim policies`` lists
them with their parameters):

* ``current`` -- just in time: :func:`fp8sim.scaling.scale_from_amax` of this step's amax
  (amax 0 / inf / NaN gives 1). ``gran`` picks per-row/col/block scales for :meth:`quantize`.
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
* ``mx`` -- MX block scaling (granularity ``mx`` / ``mx:rceil``, E8M0 scales per 32 elements);
  ``scale_for`` gives the multiplier of one block whose amax is ``current_amax``.
* ``nvfp4`` -- NVFP4 two-level scaling (:mod:`fp8sim.nvfp4`): E2M1 elements whatever ``fmt``
  says, an E4M3 scale per 16 elements (``layout`` 1x16, 16x1 or 16x16), a float32 tensor scale
  from this step's tensor amax, with the ``variant``'s rules (Transformer Engine by default).
  ``scale_for`` gives the multiplier of the block holding the tensor amax.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from fp8sim.formats import FloatFormat, get_format
from fp8sim.policy_params import (
    Param,
    bare_word,
    check_count,
    check_margin,
    coerce_params,
    split_items,
    format_param,
)
from fp8sim.nvfp4 import (NVFP4_VARIANTS, block_decode_scale, block_scales, cast_multiplier,
                          check_layout, check_variant, tensor_scale_for)  # fmt: skip
from fp8sim.scaling import (
    MX_RULES,
    ScaledTensor,
    compute_amax,
    mx_shared_scale,
    parse_granularity,
    quantize_scaled,
    scale_from_amax,
)

__all__ = [
    "ScalingPolicy",
    "CurrentScaling",
    "DelayedScaling",
    "MSAMPScaling",
    "AutoScale",
    "StaticScaling",
    "MXScaling",
    "NVFP4Scaling",
    "POLICY_SPECS",
    "parse_policy",
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


class ScalingPolicy:
    """Base class. Subclasses set ``NAME``, ``DESCRIPTION``, ``PARAMS`` and the four methods.

    Attributes:
        spec: canonical spec string, every parameter spelled out (``parse_policy(p.spec)``
            builds an equal policy).
        just_in_time: whether :meth:`scale_for` may need this step's amax (``current_amax``).
        granularity: the scaling granularity this policy casts with (``"tensor"`` unless
            noted); :meth:`quantize` uses it.
    """

    NAME: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    PARAMS: ClassVar[dict[str, Param]] = {}
    just_in_time: bool = False

    def __init__(self, **params: Any) -> None:
        self.params = coerce_params(self.NAME, self.PARAMS, params)
        self._tensors: dict[str, dict] = {}

    # -- identity ----------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        body = ",".join(f"{k}={format_param(v)}" for k, v in self.params.items())
        return f"{self.NAME}:{body}" if body else self.NAME

    @property
    def granularity(self) -> str:
        return "tensor"

    def __repr__(self) -> str:
        return f"parse_policy({self.spec!r})"

    # -- the protocol --------------------------------------------------------------------------
    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
        """The multiplier applied to tensor ``name`` before its cast to ``fmt`` this step."""
        raise NotImplementedError

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        """Record this step's ``amax`` of tensor ``name`` (once per step, after the cast).

        ``stats`` may carry ``numel`` and ``n_at_max`` (values cast to +-fmt.max) or
        ``overflow`` (the trace's count); policies that need none of them ignore them.
        """

    def state_dict(self) -> dict:
        """``{"policy": spec, "tensors": {name: plain-data state}}``."""
        return {
            "policy": self.spec,
            "tensors": {k: _copy_state(v) for k, v in self._tensors.items()},
        }

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict` of a policy with the same spec (ValueError otherwise)."""
        if not isinstance(d, dict) or "policy" not in d or "tensors" not in d:
            raise ValueError("load_state_dict: expected a dict with 'policy' and 'tensors' keys")
        if d["policy"] != self.spec:
            raise ValueError(
                f"load_state_dict: state is for {d['policy']!r}, this policy is {self.spec!r}"
            )
        self._tensors = {str(k): _copy_state(v) for k, v in d["tensors"].items()}

    # -- convenience ---------------------------------------------------------------------------
    def quantize(
        self, name: str, x: Any, fmt: FloatFormat | str, *, observe: bool = True, **cast: Any
    ) -> ScaledTensor:
        """amax -> :meth:`scale_for` -> :func:`~fp8sim.scaling.quantize_scaled` -> :meth:`observe`.

        ``cast``: ``rounding``, ``saturate``, ``seed``, ``srbits``. The tensor amax skips NaN
        (as Transformer Engine's ``fmaxf`` amax kernels do, and as the other granularities do);
        ``observe`` gets ``numel``, ``n_at_max`` and ``n_nan``.
        """
        fmt = get_format(fmt)
        amax = float(compute_amax(x, "tensor", ignore_nan=True))
        st = self._cast(name, x, fmt, amax, cast)
        if observe:
            mag = st.codes & (fmt.sign_mask - 1) if fmt.signed else st.codes
            self.observe(
                name,
                amax,
                fmt,
                numel=int(st.codes.size),
                n_at_max=int(np.count_nonzero(mag == fmt.max_code)),
                n_nan=st.nan_count,
            )
        return st

    def _cast(self, name: str, x: Any, fmt: FloatFormat, amax: float, cast: dict) -> ScaledTensor:
        scale = self.scale_for(name, fmt, current_amax=amax if self.just_in_time else None)
        return quantize_scaled(x, fmt, "tensor", scale=scale, **cast)

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
            raise ValueError(
                f"{self.spec}: scale_for({name!r}) needs current_amax "
                "(this policy scales just in time)"
            )
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


# -- current -----------------------------------------------------------------------------------


class CurrentScaling(ScalingPolicy):
    NAME = "current"
    DESCRIPTION = "just in time: scale = (fmax / amax) / 2**margin from this step's amax"
    PARAMS = {
        "pow2": Param(False, "round the scale down to a power of two"),
        "epsilon": Param(0.0, "amax below epsilon is taken as epsilon"),
        "margin": Param(0.0, "headroom in binades: amax maps to fmax / 2**margin"),
        "gran": Param("tensor", "granularity for quantize(): tensor, row, col, block:RxC"),
    }
    just_in_time = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        g = parse_granularity(self.params["gran"])
        if g.kind == "mx":
            raise ValueError("current: gran=mx is the mx policy (spec 'mx' or 'mx:rceil')")
        if g.kind == "nvfp4":
            raise ValueError("current: gran=nvfp4 is the nvfp4 policy (spec 'nvfp4', "
                             "'nvfp4:2d', 'nvfp4:layout=16x1,variant=torchao', ...)")  # fmt: skip
        self.params["gran"] = g.spec
        check_margin(self.NAME, self.params["margin"])
        eps = self.params["epsilon"]
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"current: epsilon must be finite and >= 0, got {eps}")

    @property
    def granularity(self) -> str:
        return self.params["gran"]

    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
        a = self._need_amax(name, current_amax)
        p = self.params
        return float(
            scale_from_amax(
                a, get_format(fmt), margin=p["margin"], pow2=p["pow2"], epsilon=p["epsilon"]
            )
        )

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        _check_amax(amax, f"current.observe({name!r})")

    def _cast(self, name: str, x: Any, fmt: FloatFormat, amax: float, cast: dict) -> ScaledTensor:
        if self.granularity == "tensor":
            return super()._cast(name, x, fmt, amax, cast)
        p = self.params
        return quantize_scaled(
            x,
            fmt,
            self.granularity,
            margin=p["margin"],
            pow2=p["pow2"],
            epsilon=p["epsilon"],
            **cast,
        )


# -- delayed (Transformer Engine) ---------------------------------------------------------------


#: the longest amax history ``delayed`` keeps (TE uses 1024; one list of this length per tensor)
_MAX_HISTORY = 1 << 20


class DelayedScaling(ScalingPolicy):
    NAME = "delayed"
    DESCRIPTION = "Transformer Engine DelayedScaling: scale from the amax history of previous steps"
    PARAMS = {
        "history": Param(1024, "amax_history_len: amaxes kept (rolled at each nonzero amax)"),
        "algo": Param("max", "amax_compute_algo: max of the history, or the most recent amax",
                      ("max", "most_recent")),  # fmt: skip
        "margin": Param(0.0, "scale = float32(fmax * 2**-margin) / amax (TE's order)"),
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        check_count(self.NAME, "history", self.params["history"], _MAX_HISTORY)
        check_margin(self.NAME, self.params["margin"])

    def _fresh_state(self) -> dict:
        return {"scale": 1.0, "amax_history": [0.0] * self.params["history"], "steps": 0}

    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
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
        if self.params["algo"] == "max":
            reduced = float(np.fmax.reduce(np.array([0.0] + hist, np.float32)))  # fmaxf from 0
        else:
            reduced = a
        if math.isfinite(reduced) and reduced > 0:
            st["scale"] = float(scale_from_amax(reduced, fmt, margin=self.params["margin"]))
        # else: amax 0, inf or NaN keeps the previous scale (never inf: it started at 1)


# -- MS-AMP ------------------------------------------------------------------------------------


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
    NAME = "msamp"
    DESCRIPTION = "MS-AMP: power-of-two scales from the max amax of a window of steps"
    PARAMS = {
        "window": Param(
            16, "amax window (MS-AMP: 16 activations/output grads, 1 weights/weight grads)"
        ),
        "margin": Param(0, "scale = 2**(floor(log2(fmax / amax)) - margin)"),
    }
    just_in_time = True
    # Note: MS-AMP itself always uses margin 0 (its cast and optimizer update hard-code it);
    # ``margin`` here applies to every scale this policy computes, the just-in-time warm-up
    # scales included, so margin=0 reproduces MS-AMP and margin>0 is an fp8sim extension.

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        check_count(self.NAME, "window", self.params["window"], _MAX_HISTORY)
        if abs(self.params["margin"]) > 126:
            raise ValueError(f"msamp: |margin| must be <= 126, got {self.params['margin']}")

    def _fresh_state(self) -> dict:
        # amax_window[0] is this step's slot (MS-AMP's meta.amax[0]); counter counts steps
        # since the start or the last non-finite amax
        return {"scale": 1.0, "amax_window": [0.0] * self.params["window"], "counter": 0}

    def _in_time(self, st: dict) -> bool:
        return self.params["window"] == 1 or st["counter"] < self.params["window"]

    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
        st = self._tensors.get(name) or self._fresh_state()
        if not self._in_time(st):
            return st["scale"]
        a = self._need_amax(name, current_amax)
        return _msamp_scale(a, st["scale"], get_format(fmt), self.params["margin"])

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        a = _check_amax(amax, f"msamp.observe({name!r})")
        fmt, margin = get_format(fmt), self.params["margin"]
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


# -- FP8-LM automatic scaling --------------------------------------------------------------------


class AutoScale(ScalingPolicy):
    NAME = "autoscale"
    DESCRIPTION = (
        "FP8-LM auto-scaling: factor mu halves when too many values hit fmax, else regrows"
    )
    PARAMS = {
        "ratio": Param(1e-5, "halve mu when the share of values at +-fmax exceeds this (0.001%)"),
        "window": Param(1000, "steps over which mu grows geometrically back to mu_max"),
        "mu_max": Param(2.0, "largest mu"),
        "mu_init": Param(1.0, "mu at the first step"),
        "base": Param(
            "current",
            "scale = mu * base: current amax scaling, pow2 of it, or none (1)",
            ("current", "pow2", "none"),
        ),
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        p = self.params
        if not 0 <= p["ratio"] < 1:
            raise ValueError(f"autoscale: ratio must be in [0, 1), got {p['ratio']}")
        if p["window"] < 1:
            raise ValueError(f"autoscale: window must be >= 1, got {p['window']}")
        if not (math.isfinite(p["mu_max"]) and 0 < p["mu_init"] <= p["mu_max"]):
            raise ValueError(
                f"autoscale: need 0 < mu_init <= mu_max (finite), got {p['mu_init']}, {p['mu_max']}"
            )
        self.just_in_time = p["base"] != "none"

    def _fresh_state(self) -> dict:
        mu = self.params["mu_init"]
        return {"mu": mu, "mu_from": mu, "clean_steps": 0, "halvings": 0}

    def mu(self, name: str) -> float:
        """The current factor mu of tensor ``name``."""
        st = self._tensors.get(name)
        return self.params["mu_init"] if st is None else st["mu"]

    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
        mu = self.mu(name)
        if self.params["base"] == "none":
            return _f32(mu)
        a = self._need_amax(name, current_amax)
        base = scale_from_amax(a, get_format(fmt), pow2=self.params["base"] == "pow2")
        with np.errstate(over="ignore"):
            scale = np.float32(mu) * np.float32(base)
        return float(min(scale, _F32_MAX))  # mu * base may pass float32 max: clamp, never inf

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        _check_amax(amax, f"autoscale.observe({name!r})")
        share = _share_at_max(name, stats)
        p, st = self.params, self._state(name)
        if share > p["ratio"]:
            st["mu"] = max(st["mu"] / 2, _MU_FLOOR)
            st["mu_from"], st["clean_steps"] = st["mu"], 0
            st["halvings"] += 1
            return
        st["clean_steps"] += 1
        k, mu0, top = st["clean_steps"], st["mu_from"], p["mu_max"]
        if k >= p["window"] or mu0 >= top:
            st["mu"] = top
        else:
            st["mu"] = min(top, mu0 * (top / mu0) ** (k / p["window"]))


def _share_at_max(name: str, stats: dict) -> float:
    at_max = stats.get("n_at_max", stats.get("overflow"))
    numel = stats.get("numel")
    if at_max is None or numel is None:
        raise ValueError(
            f"autoscale.observe({name!r}) needs numel= and n_at_max= (or overflow=) stats: "
            "the share of values cast to +-fmax steers mu"
        )
    numel, at_max = int(numel), int(at_max)
    if numel < 0 or not 0 <= at_max <= max(numel, 0):
        raise ValueError(
            f"autoscale.observe({name!r}): need 0 <= n_at_max <= numel, got {at_max}, {numel}"
        )
    return at_max / numel if numel else 0.0


# -- static and MX -----------------------------------------------------------------------------


class StaticScaling(ScalingPolicy):
    NAME = "static"
    DESCRIPTION = "a fixed scale"
    PARAMS = {"scale": Param(1.0, "the multiplier applied before every cast")}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        s = self.params["scale"]
        f = _f32(s) if math.isfinite(s) and abs(s) < _F32_MAX + 2.0**103 else math.inf
        if not 0 < f <= _F32_MAX:  # as scale_for uses it (a float32; max + ulp/2 rounds to inf)
            raise ValueError(f"static: scale must be finite and > 0 as a float32 (at most "
                             f"3.4028235e+38, at least 1.4e-45), got {s}")  # fmt: skip

    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
        return _f32(self.params["scale"])

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        _check_amax(amax, f"static.observe({name!r})")


class MXScaling(ScalingPolicy):
    NAME = "mx"
    DESCRIPTION = "MX block scaling: one E8M0 scale per 32 elements along the last axis"
    PARAMS = {
        "rule": Param("floor", "E8M0 scale rule: OCP MX floor, or rceil (cuBLAS/TE)", MX_RULES)
    }
    just_in_time = True

    @property
    def granularity(self) -> str:
        return "mx" if self.params["rule"] == "floor" else f"mx:{self.params['rule']}"

    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
        """The multiplier ``1 / X`` of one block with amax ``current_amax`` (NaN if not finite)."""
        a = self._need_amax(name, current_amax)
        return float(np.float32(1) / mx_shared_scale(a, get_format(fmt), self.params["rule"]))

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        _check_amax(amax, f"mx.observe({name!r})")

    def _cast(self, name: str, x: Any, fmt: FloatFormat, amax: float, cast: dict) -> ScaledTensor:
        return quantize_scaled(x, fmt, self.granularity, **cast)


class NVFP4Scaling(ScalingPolicy):
    NAME = "nvfp4"
    DESCRIPTION = ("NVFP4: E2M1 elements (whatever the format), an E4M3 scale per 16 elements, "
                   "a float32 tensor scale from this step's amax")  # fmt: skip
    PARAMS = {
        "layout": Param("1x16", "block: 1x16 along rows, 16x1 along columns, 16x16 (2d: weights)",
                        ("1x16", "16x1", "16x16", "2d")),  # fmt: skip
        "variant": Param("te", "scale rules of Transformer Engine, torchao (two-level or "
                               "torchao-block: one level) or compressed-tensors (ct)",
                         (*NVFP4_VARIANTS, "ct")),  # fmt: skip
    }
    just_in_time = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        if self.params["layout"] == "2d":
            self.params["layout"] = "16x16"
        check_layout(self.params["layout"])
        self.params["variant"] = check_variant(self.params["variant"])  # ct: compressed-tensors

    @property
    def granularity(self) -> str:
        """The ``nvfp4[:LAYOUT][:VARIANT]`` granularity (:func:`fp8sim.scaling.parse_granularity`)."""
        lay = {"1x16": "", "16x1": ":16x1", "16x16": ":2d"}[self.params["layout"]]
        var = self.params["variant"]
        return f"nvfp4{lay}" + ("" if var == "te" else f":{var}")

    def scale_for(
        self, name: str, fmt: FloatFormat | str, current_amax: float | None = None
    ) -> float:
        """The float32 multiplier of the block holding the tensor amax ``current_amax`` (its
        block amax is the tensor amax): :func:`fp8sim.nvfp4.cast_multiplier` of its E4M3 scale;
        compressed-tensors divides by ``b / G``, so its value is ``float32(1 / float32(b / G))``.
        ``fmt`` is ignored (NVFP4 elements are E2M1). NaN where the variant's rule gives NaN
        (torchao for an amax of 0)."""
        a = self._need_amax(name, current_amax)
        var = self.params["variant"]
        _, b = block_scales(np.float32(a), a, var)
        if var != "compressed-tensors":
            return float(cast_multiplier(b, a, var))
        d = block_decode_scale(b, tensor_scale_for(a, var), var)  # b / G
        with np.errstate(divide="ignore"):
            return float(np.float32(1) / d)

    def observe(self, name: str, amax: float, fmt: FloatFormat | str, **stats: Any) -> None:
        _check_amax(amax, f"nvfp4.observe({name!r})")

    def quantize(self, name: str, x: Any, fmt: FloatFormat | str = "e2m1", *, observe: bool = True,
                 **cast: Any) -> ScaledTensor:  # fmt: skip
        """:meth:`ScalingPolicy.quantize` with NVFP4's cast: E2M1 whatever ``fmt`` says; the
        tensor scale from ``x``'s amax (NaN skipped). ``cast``: ``rounding``, ``seed``,
        ``srbits`` (``saturate=False`` is refused: E2M1 has no inf or NaN)."""
        return super().quantize(name, x, "e2m1", observe=observe, **cast)

    def _cast(self, name: str, x: Any, fmt: FloatFormat, amax: float, cast: dict) -> ScaledTensor:
        return quantize_scaled(x, "e2m1", self.granularity, **cast)


# -- specs ---------------------------------------------------------------------------------------

_POLICIES: dict[str, type[ScalingPolicy]] = {
    cls.NAME: cls
    for cls in (CurrentScaling, DelayedScaling, MSAMPScaling, AutoScale, StaticScaling, MXScaling,
                NVFP4Scaling)  # fmt: skip
}

#: name -> {"description", "params": {key: {"default", "help", "choices"}}} (plain data)
POLICY_SPECS: dict[str, dict] = {
    name: {
        "description": cls.DESCRIPTION,
        "params": {
            k: {
                "default": p.default,
                "help": p.help,
                "choices": list(p.choices) if p.choices else None,
            }
            for k, p in cls.PARAMS.items()
        },
    }
    for name, cls in _POLICIES.items()
}


def parse_policy(spec: str | ScalingPolicy) -> ScalingPolicy:
    """Build a policy from ``"name"`` or ``"name:key=value,key=value"``.

    A bare word after the colon sets a boolean parameter (``"current:pow2"``) or picks a choice
    (``"mx:rceil"``, ``"delayed:most_recent"``). Unknown names, keys or values raise ValueError
    naming the valid ones. Examples: ``"delayed:history=16,margin=1,algo=max"``, ``"current"``,
    ``"msamp:window=1"``, ``"autoscale:ratio=1e-5,window=1000"``, ``"static:scale=1"``.
    """
    if isinstance(spec, ScalingPolicy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"policy spec must be a string, got {type(spec).__name__}")
    name, _, body = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in _POLICIES:
        raise ValueError(f"unknown scaling policy {name!r}; valid: {', '.join(_POLICIES)}")
    cls = _POLICIES[name]
    params: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in split_items(body))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq:
            key, value = bare_word(name, cls.PARAMS, key)
        if key in params:
            raise ValueError(f"policy {name!r}: parameter {key!r} given twice")
        params[key] = value.strip() if isinstance(value, str) else value
    return cls(**params)
