"""Training recipes: frozen dataclasses, one per level, built by name.

Levels (torchao-style):

* :class:`CastConfig` -- one cast: target format, scaling policy spec (parsed by
  :func:`fp8sim.policies.parse_policy`), scaling granularity, rounding mode.
* :class:`LinearRecipe` -- one FP8 linear layer: the casts of its input, weight and output
  gradient (the three GEMM operands), optionally of its weight gradient, and which modules stay in
  high precision.
* :class:`Recipe` -- a whole run: autocast dtype for the non-FP8 ops, the linear recipe (None: no
  FP8), and the optimizer / gradient-communication / weight-storage levels.

The last three fields are where the FP8-LM levels (O1: FP8 weight gradients and all-reduce,
O2: FP8 Adam states, O3: FP8 weights sharded ZeRO-style) plug in: they add recipes through
:func:`register_recipe` with other values there; code that cannot run a level raises
NotImplementedError naming it, never silently trains something else.

Built-in recipes: ``fp32``, ``bf16`` (autocast), ``te-delayed`` (Transformer Engine hybrid: E4M3
forward, E5M2 output gradients, delayed scaling), ``te-current`` (hybrid, current scaling),
``mx`` (MXFP8: E4M3 everywhere, one E8M0 scale per 32 elements along the GEMM reduction axis),
and FP8-LM's levels ``fp8lm-o1`` / ``-o2`` / ``-o3`` (MS-AMP's power-of-two scaling; E4M3 weight
gradients averaged by the FP8 all-reduce with AutoScale; O2 adds the FP8-LM Adam, O3 E4M3 weights
sharded ZeRO-style), which train through :func:`fp8sim.training.distributed.train_distributed`.
Their ``extra`` holds ``grad_scaling`` (``autoscale`` | ``msamp``) and ``fp8_grads``: ``all`` (every
parameter's gradient is E4M3 with a per-tensor scale -- in the all-reduce and as the optimizer's
stored gradient; the paper's 6 bytes per parameter count all parameters) or ``linear`` (only the
FP8 linears' weight gradients, as MS-AMP does; the rest travel in bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

__all__ = [
    "CastConfig",
    "LinearRecipe",
    "Recipe",
    "get_recipe",
    "list_recipes",
    "register_recipe",
    "OPTIMIZERS",
    "GRAD_COMMS",
    "WEIGHT_STORAGES",
]

GRANULARITIES = ("tensor", "mx")
AUTOCAST_DTYPES = (None, "bfloat16")
#: optimizer levels; this package trains "adamw" (torch.optim.AdamW, float32 states)
OPTIMIZERS = ("adamw", "fp8-adamw")
#: gradient communication levels; single process trains "none"
GRAD_COMMS = ("none", "fp32", "bf16", "fp8")
#: how weights are stored between steps
WEIGHT_STORAGES = ("fp32", "fp8")

#: Transformer Engine DelayedScaling defaults, with a history short enough for short runs
TE_DELAYED_POLICY = "delayed:history=16,margin=0,algo=max"


@dataclass(frozen=True)
class CastConfig:
    """One FP8 cast.

    Attributes:
        fmt: target format name (``fp8sim.get_format``), e.g. ``"e4m3"``.
        policy: scaling policy spec, e.g. ``"delayed:history=16,margin=0,algo=max"``, ``"current"``.
        granularity: ``"tensor"`` (one scale) or ``"mx"`` (one E8M0 scale per 32 elements along
            the reduction axis of the GEMM that consumes the tensor).
        rounding: rounding mode of the cast (``"rne"``: round to nearest, ties to even);
            saturating (overflow clamps to +-max).
    """

    fmt: str = "e4m3"
    policy: str = "current"
    granularity: str = "tensor"
    rounding: str = "rne"

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"CastConfig.granularity must be one of {GRANULARITIES}, got {self.granularity!r}")


@dataclass(frozen=True)
class LinearRecipe:
    """The casts of one FP8 linear ``y = x W^T + b``.

    Forward GEMM on ``input`` x ``weight``; backward GEMMs ``dX = dY W`` and ``dW = dY^T X`` on
    ``grad_output`` with the saved FP8 weight and input. ``weight_grad`` (None: kept in float32)
    casts the weight gradient after the wgrad GEMM (FP8-LM O1). Modules whose qualified name
    ends with one of ``skip`` stay ``nn.Linear``.
    """

    input: CastConfig
    weight: CastConfig
    grad_output: CastConfig
    weight_grad: CastConfig | None = None
    skip: tuple[str, ...] = ("lm_head",)

    def casts(self) -> dict[str, CastConfig]:
        """Role -> cast, for the roles this recipe casts (the trace roles of docs/design.md)."""
        out = {"activation": self.input, "weight": self.weight, "grad_output": self.grad_output}
        if self.weight_grad is not None:
            out["weight_grad"] = self.weight_grad
        return out


@dataclass(frozen=True)
class Recipe:
    """A training recipe.

    Attributes:
        name: registry name.
        description: one line for ``fp8sim train --help`` and reports.
        autocast: None (float32 everywhere outside FP8 GEMMs) or ``"bfloat16"`` (CPU autocast).
        linear: the FP8 linear recipe, or None for no FP8 GEMMs.
        optimizer: one of :data:`OPTIMIZERS`.
        grad_comm: one of :data:`GRAD_COMMS`.
        weight_storage: one of :data:`WEIGHT_STORAGES`.
    """

    name: str
    description: str
    autocast: str | None = None
    linear: LinearRecipe | None = None
    optimizer: str = "adamw"
    grad_comm: str = "none"
    weight_storage: str = "fp32"
    extra: tuple[tuple[str, str], ...] = field(default=())  # free-form (key, value) for later levels

    def __post_init__(self) -> None:
        for attr, allowed in (
            ("autocast", AUTOCAST_DTYPES),
            ("optimizer", OPTIMIZERS),
            ("grad_comm", GRAD_COMMS),
            ("weight_storage", WEIGHT_STORAGES),
        ):
            if getattr(self, attr) not in allowed:
                raise ValueError(f"Recipe {self.name}: {attr} must be one of {allowed}, got {getattr(self, attr)!r}")

    @property
    def is_fp8(self) -> bool:
        return self.linear is not None

    def to_dict(self) -> dict:
        """Plain-data form, for run configs and traces."""
        from dataclasses import asdict

        return asdict(self)


def _fp32() -> Recipe:
    return Recipe("fp32", "float32 everywhere (the reference)")


def _bf16() -> Recipe:
    return Recipe("bf16", "bfloat16 autocast, float32 weights and optimizer states", autocast="bfloat16")


def _te(policy: str, name: str, what: str) -> Recipe:
    return Recipe(
        name,
        f"Transformer Engine hybrid FP8: E4M3 input/weight, E5M2 output gradient, {what}",
        linear=LinearRecipe(
            input=CastConfig("e4m3", policy),
            weight=CastConfig("e4m3", policy),
            grad_output=CastConfig("e5m2", policy),
        ),
    )


def _mx() -> Recipe:
    cast = CastConfig("e4m3", "mx:rceil", granularity="mx")  # E8M0 scale rounded up, as TE and cuBLAS
    return Recipe(
        "mx",
        "MXFP8: E4M3 operands, one E8M0 scale per 32 elements along the reduction axis",
        linear=LinearRecipe(input=cast, weight=cast, grad_output=cast),
    )


def _fp8lm(level: int) -> Recipe:
    # MS-AMP's scaling: power-of-two scales, amax window 16 for activations and output gradients,
    # 1 for weights and weight gradients; weight gradients cast to E4M3 (FP8-LM O1); every
    # gradient (not only the FP8 linears') in E4M3 through the all-reduce and the optimizer
    lin = LinearRecipe(
        input=CastConfig("e4m3", "msamp"),
        weight=CastConfig("e4m3", "msamp:window=1"),
        grad_output=CastConfig("e5m2", "msamp"),
        weight_grad=CastConfig("e4m3", "msamp:window=1"),
    )
    what = {
        1: "FP8 GEMMs, E4M3 weight gradients, FP8 gradient all-reduce with AutoScale",
        2: "O1 + FP8-LM Adam: E4M3 first moment, FP16 second moment, FP16 master weights (scaled)",
        3: "O2 + E4M3 weights sharded ZeRO-style with their FP16 masters (whole tensors, greedy)",
    }[level]
    return Recipe(
        f"fp8lm-o{level}", f"FP8-LM O{level}: {what}", linear=lin,
        optimizer="adamw" if level == 1 else "fp8-adamw", grad_comm="fp8",
        weight_storage="fp8" if level == 3 else "fp32", extra=(("grad_scaling", "autoscale"), ("fp8_grads", "all")),
    )


_REGISTRY: dict[str, Callable[[], Recipe]] = {
    "fp32": _fp32,
    "bf16": _bf16,
    "te-delayed": lambda: _te(TE_DELAYED_POLICY, "te-delayed", "delayed scaling (amax history 16, max)"),
    "te-current": lambda: _te("current", "te-current", "current (just-in-time) scaling"),
    "mx": _mx,
    "fp8lm-o1": lambda: _fp8lm(1),
    "fp8lm-o2": lambda: _fp8lm(2),
    "fp8lm-o3": lambda: _fp8lm(3),
}


def register_recipe(name: str, factory: Callable[[], Recipe]) -> None:
    """Add a named recipe (e.g. the FP8-LM levels). Re-registering a name raises ValueError."""
    if name in _REGISTRY:
        raise ValueError(f"recipe {name!r} is already registered")
    _REGISTRY[name] = factory


def list_recipes() -> list[str]:
    """Registered recipe names, in registration order."""
    return list(_REGISTRY)


def get_recipe(name: str, **overrides) -> Recipe:
    """Build the recipe ``name``; keyword overrides replace top-level fields (``dataclasses.replace``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(_REGISTRY)}")
    recipe = _REGISTRY[name]()
    return replace(recipe, **overrides) if overrides else recipe
