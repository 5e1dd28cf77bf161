"""Scaling configs: the frozen, typed description of a scaling policy, and the spec language.

A config (:class:`CurrentScalingConfig`, :class:`DelayedScalingConfig`,
:class:`MSAMPScalingConfig`, :class:`AutoScaleConfig`, :class:`StaticScalingConfig`) is what a
recipe holds; :func:`fp8sim.policies.build_policy` gives the stateful policy (where every rule is
stated). Spec strings (``"delayed:history=16,margin=1"``, ``"mx:rceil"``,
``"current:gran=block:1x128,pow2"``) are parsed into a config and a granularity once, at the
edges, by :func:`parse_scaling`; :func:`scaling_spec` writes the canonical spelling back.

A light module (numpy only), so the command line can list recipes without loading numba.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

import numpy as np

from fp8sim.granularity import Granularity, parse_granularity, E8M0Rule
from fp8sim.policy_params import Param, bare_word, coerce_params, format_param, split_items

__all__ = [
    "AmaxAlgo",
    "AutoScaleBase",
    "ScalingConfig",
    "CurrentScalingConfig",
    "DelayedScalingConfig",
    "MSAMPScalingConfig",
    "AutoScaleConfig",
    "StaticScalingConfig",
    "TorchaoScalingConfig",
    "POLICY_SPECS",
    "parse_scaling",
    "scaling_spec",
]

_F32_MAX = float(np.finfo(np.float32).max)
#: the longest amax history / window kept (TE uses 1024; one list of this length per tensor)
MAX_HISTORY = 1 << 20


def _f32(v: float) -> float:
    return float(np.float32(v))


class AmaxAlgo(str, Enum):
    """How :class:`DelayedScalingConfig` reduces its amax history (TE's ``amax_compute_algo``)."""

    MAX = "max"  #: the maximum of the history (NaN entries skipped, an inf kept)
    MOST_RECENT = "most_recent"  #: this step's amax

    def __str__(self) -> str:
        return self.value


class AutoScaleBase(str, Enum):
    """What :class:`AutoScaleConfig`'s factor ``mu`` multiplies."""

    CURRENT = "current"  #: the current amax scale ``fmax / amax``
    POW2 = "pow2"  #: the same rounded down to a power of two
    NONE = "none"  #: 1: the scale is ``mu`` alone

    def __str__(self) -> str:
        return self.value


def _param(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


# -- configs: frozen, typed ------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingConfig:
    """Base of the scaling configs. Fields are checked when built: a value of the wrong type
    (``pow2="no"``) is a TypeError, one out of range a ValueError, each naming the field."""

    NAME: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    #: whether the scale of a step needs that step's amax
    JUST_IN_TIME: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for f in fields(self):
            v, kind = getattr(self, f.name), type(f.default)
            where = f"{type(self).__name__}.{f.name}"
            if issubclass(kind, Enum):
                try:
                    object.__setattr__(self, f.name, kind(v))
                except ValueError:
                    raise ValueError(f"{where} must be one of {', '.join(m.value for m in kind)}, got {v!r}") from None
            elif kind is bool and not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{where} must be True or False, got {v!r}")
            elif kind is int and (isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))):
                raise TypeError(f"{where} must be an integer, got {v!r}")
            elif kind is float and (isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number))):
                raise TypeError(f"{where} must be a number, got {v!r}")
            elif kind is float:
                if math.isnan(v):
                    raise ValueError(f"{where} must be a number, got NaN")
                object.__setattr__(self, f.name, float(v))
            elif kind is bool or kind is int:
                object.__setattr__(self, f.name, kind(v))
        self._check()

    def _check(self) -> None:
        """Range checks of a subclass (ValueError naming the field)."""

    @classmethod
    def params(cls) -> dict[str, Param]:
        """The parameters of the spec language: default, help, choices (from the fields)."""
        out = {}
        for f in fields(cls):
            d = f.default
            choices = tuple(m.value for m in type(d)) if isinstance(d, Enum) else None
            out[f.name] = Param(d.value if isinstance(d, Enum) else d, f.metadata["help"], choices)
        return out

    @classmethod
    def from_params(cls, given: dict[str, Any]) -> "ScalingConfig":
        """A config from spec parameters (strings converted, unknown keys refused)."""
        return cls(**coerce_params(cls.NAME, cls.params(), given))

    @property
    def spec(self) -> str:
        """``"name:key=value,..."``, every parameter spelled out (:func:`parse_scaling` of it
        gives this config back)."""
        body = ",".join(f"{f.name}={format_param(plain_value(getattr(self, f.name)))}" for f in fields(self))
        return f"{self.NAME}:{body}" if body else self.NAME

    @property
    def just_in_time(self) -> bool:
        return self.JUST_IN_TIME


def plain_value(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


@dataclass(frozen=True)
class CurrentScalingConfig(ScalingConfig):
    """Just-in-time scaling from this step's amax (Transformer Engine's current scaling)."""

    NAME: ClassVar[str] = "current"
    DESCRIPTION: ClassVar[str] = "just in time: scale = (fmax / amax) / 2**margin from this step's amax"
    pow2: bool = _param(False, "round the scale down to a power of two")
    epsilon: float = _param(0.0, "amax below epsilon is taken as epsilon")
    margin: float = _param(0.0, "headroom in binades: amax maps to fmax / 2**margin")

    def _check(self) -> None:
        _check_margin(self, self.margin)
        if not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"current: epsilon must be finite and >= 0, got {self.epsilon}")


@dataclass(frozen=True)
class DelayedScalingConfig(ScalingConfig):
    """Transformer Engine's ``DelayedScaling``: the scale from the amax history of past steps."""

    NAME: ClassVar[str] = "delayed"
    DESCRIPTION: ClassVar[str] = "Transformer Engine DelayedScaling: scale from the amax history of previous steps"
    JUST_IN_TIME: ClassVar[bool] = False
    history: int = _param(1024, "amax_history_len: amaxes kept (rolled at each nonzero amax)")
    algo: AmaxAlgo = _param(AmaxAlgo.MAX, "amax_compute_algo: max of the history, or the most recent amax")
    margin: float = _param(0.0, "scale = float32(fmax * 2**-margin) / amax (TE's order)")

    def _check(self) -> None:
        _check_count(self, "history", self.history)
        _check_margin(self, self.margin)


@dataclass(frozen=True)
class MSAMPScalingConfig(ScalingConfig):
    """MS-AMP's ``ScalingMeta``: power-of-two scales from a window of amaxes.

    MS-AMP itself always uses margin 0 (its cast and optimizer update hard-code it); ``margin``
    here applies to every scale this policy computes, so margin 0 reproduces MS-AMP."""

    NAME: ClassVar[str] = "msamp"
    DESCRIPTION: ClassVar[str] = "MS-AMP: power-of-two scales from the max amax of a window of steps"
    window: int = _param(16, "amax window (MS-AMP: 16 activations/output grads, 1 weights/weight grads)")
    margin: int = _param(0, "scale = 2**(floor(log2(fmax / amax)) - margin)")

    def _check(self) -> None:
        _check_count(self, "window", self.window)
        if abs(self.margin) > 126:
            raise ValueError(f"msamp: |margin| must be <= 126, got {self.margin}")


@dataclass(frozen=True)
class AutoScaleConfig(ScalingConfig):
    """FP8-LM's automatic scaling of gradients (see the module docstring)."""

    NAME: ClassVar[str] = "autoscale"
    DESCRIPTION: ClassVar[str] = "FP8-LM auto-scaling: factor mu halves when too many values hit fmax, else regrows"
    ratio: float = _param(1e-5, "halve mu when the share of values at +-fmax exceeds this (0.001%)")
    window: int = _param(1000, "steps over which mu grows geometrically back to mu_max")
    mu_max: float = _param(2.0, "largest mu")
    mu_init: float = _param(1.0, "mu at the first step")
    base: AutoScaleBase = _param(AutoScaleBase.CURRENT, "scale = mu * base: current amax scaling, pow2 of it, or none (1)")

    def _check(self) -> None:
        if not 0 <= self.ratio < 1:
            raise ValueError(f"autoscale: ratio must be in [0, 1), got {self.ratio}")
        if self.window < 1:
            raise ValueError(f"autoscale: window must be >= 1, got {self.window}")
        if not (math.isfinite(self.mu_max) and 0 < self.mu_init <= self.mu_max):
            raise ValueError(f"autoscale: need 0 < mu_init <= mu_max (finite), got {self.mu_init}, {self.mu_max}")

    @property
    def just_in_time(self) -> bool:
        return self.base != AutoScaleBase.NONE


@dataclass(frozen=True)
class StaticScalingConfig(ScalingConfig):
    """A fixed scale."""

    NAME: ClassVar[str] = "static"
    DESCRIPTION: ClassVar[str] = "a fixed scale"
    JUST_IN_TIME: ClassVar[bool] = False
    scale: float = _param(1.0, "the multiplier applied before every cast")

    def _check(self) -> None:
        s = self.scale
        f = _f32(s) if math.isfinite(s) and abs(s) < _F32_MAX + 2.0**103 else math.inf
        if not 0 < f <= _F32_MAX:  # as scale_for uses it (a float32; max + ulp/2 rounds to inf)
            raise ValueError(f"static: scale must be finite and > 0 as a float32 (at most "
                             f"3.4028235e+38, at least 1.4e-45), got {s}")  # fmt: skip


@dataclass(frozen=True)
class TorchaoScalingConfig(ScalingConfig):
    """torchao.float8's dynamic scaling (0.18, ``float8_utils.amax_to_scale``): this step's amax,
    ``scale = float32(fmax / max(float64(amax), 1e-12))`` (an amax of 0 gives ``fmax * 1e12``, an
    inf amax 0, a NaN amax NaN), then with ``pow2`` ``exp2(floor(log2(scale)))`` on the float32
    scale as torch computes it -- which rounds a scale a few ulps below ``2**k`` up to ``2**k``
    (Transformer Engine's power-of-two rule drops the mantissa: an exact floor)."""

    NAME: ClassVar[str] = "torchao"
    DESCRIPTION: ClassVar[str] = "torchao.float8 dynamic scaling: fmax / max(amax, 1e-12) in float64, optional pow2"
    pow2: bool = _param(False, "round_scales_to_power_of_2: exp2(floor(log2(scale))) in float32")


def _check_margin(cfg: ScalingConfig, margin: float) -> None:
    if not math.isfinite(margin) or abs(margin) > 126:
        raise ValueError(f"{cfg.NAME}: margin must be finite with |margin| <= 126, got {margin}")


def _check_count(cfg: ScalingConfig, key: str, n: int) -> None:
    if not 1 <= n <= MAX_HISTORY:
        raise ValueError(f"{cfg.NAME}: {key} must be >= 1 and <= {MAX_HISTORY}, got {n:.6g}")


_CONFIGS: dict[str, type[ScalingConfig]] = {
    c.NAME: c for c in (CurrentScalingConfig, DelayedScalingConfig, MSAMPScalingConfig, AutoScaleConfig,
                        StaticScalingConfig, TorchaoScalingConfig)  # fmt: skip
}

# the block scalings of the spec language: their own parameters, parsed into a granularity
_BLOCK_SPECS: dict[str, dict[str, Any]] = {
    "mx": {"description": "MX block scaling: one E8M0 scale per 32 elements along the last axis",
           "params": {"rule": Param("floor", "E8M0 scale rule: OCP MX floor, or rceil (cuBLAS/TE)",
                                    tuple(r.value for r in E8M0Rule))}},
    "nvfp4": {"description": "NVFP4: E2M1 elements (whatever the format), an E4M3 scale per 16 elements, "
                             "a float32 tensor scale from this step's amax",
              "params": {"layout": Param("1x16", "block: 1x16 along rows, 16x1 along columns, 16x16 (2d: weights)",
                                         ("1x16", "16x1", "16x16", "2d")),
                         "variant": Param("te", "scale rules of Transformer Engine, torchao (two-level or "
                                                "torchao-block: one level) or compressed-tensors (ct)",
                                          ("te", "torchao", "torchao-block", "compressed-tensors", "ct"))}},
}  # fmt: skip
_GRAN_PARAM = Param("tensor", "granularity for quantize(): tensor, row, col, block:RxC")


def _spec_params(name: str) -> dict[str, Param]:
    if name in _BLOCK_SPECS:
        return _BLOCK_SPECS[name]["params"]
    params = _CONFIGS[name].params()
    return params | {"gran": _GRAN_PARAM} if name in ("current", "torchao") else params


#: name -> {"description", "params": {key: {"default", "help", "choices"}}} (plain data)
POLICY_SPECS: dict[str, dict] = {
    name: {
        "description": _CONFIGS[name].DESCRIPTION if name in _CONFIGS else _BLOCK_SPECS[name]["description"],
        "params": {k: {"default": p.default, "help": p.help, "choices": list(p.choices) if p.choices else None}
                   for k, p in _spec_params(name).items()},
    }
    for name in (*_CONFIGS, *_BLOCK_SPECS)
}


def parse_scaling(spec: str) -> tuple[ScalingConfig, Granularity]:
    """Parse a policy spec into its typed config and granularity (the edge parser).

    ``"name"`` or ``"name:key=value,key=value"``; a bare word after the colon sets a boolean
    parameter (``"current:pow2"``) or picks a choice (``"mx:rceil"``, ``"delayed:most_recent"``).
    ``mx[:rule]`` and ``nvfp4[:layout=..,variant=..]`` give :class:`CurrentScalingConfig` with
    that block granularity, ``current:gran=G`` the granularity ``G`` (tensor, row, col,
    block:RxC). Unknown names, keys or values raise ValueError naming the valid ones. Examples:
    ``"delayed:history=16,margin=1,algo=max"``, ``"msamp:window=1"``, ``"static:scale=1"``.
    """
    if not isinstance(spec, str):
        raise TypeError(f"policy spec must be a string, got {type(spec).__name__}")
    name, _, body = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in POLICY_SPECS:
        raise ValueError(f"unknown scaling policy {name!r}; valid: {', '.join(POLICY_SPECS)}")
    schema = _spec_params(name)
    params: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in split_items(body))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq:
            key, value = bare_word(name, schema, key)
        if key in params:
            raise ValueError(f"policy {name!r}: parameter {key!r} given twice")
        params[key] = value.strip() if isinstance(value, str) else value
    if name in _BLOCK_SPECS:
        p = coerce_params(name, schema, params)
        gran = Granularity.mx(p["rule"]) if name == "mx" else Granularity.nvfp4(p["layout"], p["variant"])
        return CurrentScalingConfig(), gran
    gran = Granularity.tensor()
    if name in ("current", "torchao") and "gran" in params:
        gran = parse_granularity(str(params.pop("gran")))
        if gran.kind == "mx":
            raise ValueError("current: gran=mx is the mx policy (spec 'mx' or 'mx:rceil')")
        if gran.kind == "nvfp4":
            raise ValueError("current: gran=nvfp4 is the nvfp4 policy (spec 'nvfp4', "
                             "'nvfp4:2d', 'nvfp4:layout=16x1,variant=torchao', ...)")  # fmt: skip
    return _CONFIGS[name].from_params(params), gran


def scaling_spec(config: ScalingConfig, granularity: Granularity | None = None) -> str:
    """The canonical spec of a config on a granularity (:func:`parse_scaling`'s inverse):
    ``mx:rule=..`` and ``nvfp4:layout=..,variant=..`` for those granularities with current
    scaling, ``current:...,gran=G`` for the others."""
    g = granularity or Granularity.tensor()
    if g.kind == "mx" and isinstance(config, CurrentScalingConfig) and config == CurrentScalingConfig():
        return f"mx:rule={g.mx_rule.value}"
    if g.kind == "nvfp4" and isinstance(config, CurrentScalingConfig) and config == CurrentScalingConfig():
        return f"nvfp4:layout={'x'.join(map(str, g.block))},variant={g.variant}"
    per_group = (CurrentScalingConfig, TorchaoScalingConfig)
    if g.kind in ("mx", "nvfp4") or (g.kind != "tensor" and not isinstance(config, per_group)):
        raise ValueError(f"{config.NAME} scaling has no spec on granularity {g.spec} (block granularities "
                         f"take their scales just in time: current scaling)")
    return config.spec + (f",gran={g.spec}" if isinstance(config, per_group) else "")
