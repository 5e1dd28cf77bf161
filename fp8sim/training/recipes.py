"""Training recipes: frozen dataclasses, one per level, built by name.

Levels (torchao-style):

* :class:`CastConfig` -- one cast: target format, scaling policy spec (parsed by
  :func:`fp8sim.policies.parse_policy`), scaling granularity, rounding mode.
* :class:`LinearRecipe` -- one FP8 linear layer: the casts of its input, weight and output
  gradient (the three GEMM operands), optionally of its weight gradient, and which modules stay in
  high precision.
* :class:`Recipe` -- a whole run: autocast dtype for the non-FP8 ops, the linear recipe (None: no
  FP8), and the optimizer / gradient-communication / weight-storage levels.

Every built-in recipe keeps ``lm_head`` (the last linear layer) in high precision; the paper
keeps about 16% of its linear layers in BF16, mostly the last blocks, which
``LinearRecipe.keep_last_blocks`` adds (default 0).

The last three fields are where the FP8-LM levels (O1: FP8 weight gradients and all-reduce,
O2: FP8 Adam states, O3: FP8 weights sharded ZeRO-style) plug in: they add recipes through
:func:`register_recipe` with other values there; code that cannot run a level raises
NotImplementedError naming it, never silently trains something else.

Built-in recipes: ``fp32``, ``bf16`` (autocast), ``te-delayed`` (Transformer Engine hybrid: E4M3
forward, E5M2 output gradients, delayed scaling), ``te-current`` (hybrid, current scaling),
``mx`` (MXFP8: E4M3 everywhere, one E8M0 scale per 32 elements along the GEMM reduction axis),
``te-block`` (Transformer Engine 2.x ``Float8BlockScaling`` defaults: E4M3 forward and backward,
float32 power-of-two scales, amax epsilon 0, one scale per 1x128 block of inputs and output
gradients along each GEMM's reduction axis and per 128x128 tile of weights), the NVFP4 recipes of
arXiv 2509.25149 / Transformer Engine 2.x ``NVFP4BlockScaling``: ``nvfp4`` (E2M1 with an E4M3
scale per 16 elements and a float32 tensor scale, TE's rules; 1x16 blocks of inputs and output
gradients along each GEMM's reduction axis, 16x16 weight tiles so forward and backward see the
same quantized weight, stochastic rounding of the output gradient in both backward GEMMs, the
Random Hadamard Transform with TE's sign vector on both weight-gradient GEMM operands along the
token axis), its ablations ``nvfp4-no-rht``, ``nvfp4-no-sr`` and ``nvfp4-no-rht-no-sr``, and
FP8-LM's levels ``fp8lm-o1`` / ``-o2`` / ``-o3`` (MS-AMP's power-of-two scaling; E4M3 weight
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

#: granularity kinds a cast may use (see :class:`CastConfig`)
GRANULARITIES = ("tensor", "mx", "block", "nvfp4")
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
        granularity: ``"tensor"`` (one scale), ``"mx"`` (one E8M0 scale per 32 elements; the
            policy, ``mx`` or ``mx:rceil``, picks the rule), ``"block:1xC"`` / ``"block:CxC"``
            (float32 scales per block by the ``current`` policy's rule: ``pow2``, ``epsilon``,
            ``margin``), ``"nvfp4"`` (1x16) or
            ``"nvfp4:2d"`` (16x16), optionally with a variant (``"nvfp4:torchao"``; fmt must be
            ``"e2m1"``). Blocks are laid along the reduction axis of the GEMM that consumes the
            tensor: a one-row block (``1xC``, MX, ``nvfp4``) is cast again from the
            high-precision tensor for a GEMM that reduces along its other axis; a square tile
            is cast once and its transpose serves both GEMMs.
        rounding: rounding mode of the cast (``"rne"``: round to nearest, ties to even;
            ``"stochastic"``: Philox keyed by the step and the tensor's name); saturating
            (overflow clamps to +-max).
        rht: apply the Random Hadamard Transform (16x16, Transformer Engine's sign vector,
            :func:`fp8sim.hadamard.rht`) to this tensor's copy for the weight-gradient GEMM,
            along that GEMM's reduction (token) axis, before its cast (``nvfp4`` inputs and output
            gradients only).
    """

    fmt: str = "e4m3"
    policy: str = "current"
    granularity: str = "tensor"
    rounding: str = "rne"
    rht: bool = False

    def __post_init__(self) -> None:
        kind = self.granularity.partition(":")[0]
        if kind not in GRANULARITIES:
            raise ValueError(f"CastConfig.granularity must be tensor, mx, block:1xC, block:CxC, nvfp4 or nvfp4:2d, "
                             f"got {self.granularity!r}")
        if kind == "mx" and self.granularity != "mx":
            raise ValueError(f"CastConfig.granularity: MX is spelled 'mx' (its policy, mx or mx:rceil, picks the "
                             f"scale rule), got {self.granularity!r}")
        if kind in ("block", "nvfp4"):
            from fp8sim.scaling import parse_granularity

            r, c = parse_granularity(self.granularity).block
            if r not in (1, c):
                raise ValueError(f"CastConfig.granularity {self.granularity!r}: blocks must be one row (1xC, "
                                 f"along the reduction axis) or square (CxC, weights)")
            if kind == "nvfp4" and self.fmt != "e2m1":
                raise ValueError(f"CastConfig: granularity {self.granularity!r} casts to e2m1, got fmt={self.fmt!r}")
        if self.rht and kind != "nvfp4":
            raise ValueError(f"CastConfig.rht is for nvfp4 granularities, not {self.granularity!r}")


@dataclass(frozen=True)
class LinearRecipe:
    """The casts of one FP8 linear ``y = x W^T + b``.

    Forward GEMM on ``input`` x ``weight``; backward GEMMs ``dX = dY W`` and ``dW = dY^T X`` on
    ``grad_output`` with the saved FP8 weight and input. ``weight_grad`` (None: kept in float32)
    casts the weight gradient after the wgrad GEMM (FP8-LM O1). The modules kept in high
    precision (they stay ``nn.Linear``): those whose qualified name ends with one of ``skip``, and
    the linears of the last ``keep_last_blocks`` numbered blocks -- a block is the first integer
    in a module's qualified name (``blocks.3.attn.c_attn`` is in block 3, Hugging Face's
    ``transformer.h.11.mlp.c_fc`` in block 11), the last blocks are the largest numbers present.
    """

    input: CastConfig
    weight: CastConfig
    grad_output: CastConfig
    weight_grad: CastConfig | None = None
    skip: tuple[str, ...] = ("lm_head",)
    keep_last_blocks: int = 0

    def __post_init__(self) -> None:
        n = self.keep_last_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"LinearRecipe.keep_last_blocks must be an int >= 0, got {n!r}")
        if self.input.rht != self.grad_output.rht:
            raise ValueError("LinearRecipe: the RHT must apply to both weight-gradient GEMM operands "
                             "(input.rht and grad_output.rht) or to neither")
        if self.weight.rht:
            raise ValueError("LinearRecipe: weight.rht: the RHT applies to the weight-gradient GEMM's operands "
                             "(input and grad_output), not to the weight")
        gemm = (self.input, self.weight, self.grad_output)
        if len({c.granularity == "tensor" for c in gemm}) > 1:
            raise ValueError("LinearRecipe: input, weight and grad_output must all be per-tensor scaled or all "
                             "block scaled (mx, block, nvfp4)")
        nv = {c.granularity.partition(":")[0] == "nvfp4" for c in gemm}
        if len(nv) > 1:
            raise ValueError("LinearRecipe: NVFP4 GEMMs need input, weight and grad_output all in nvfp4")
        if nv == {True}:
            from fp8sim.scaling import parse_granularity

            variants = {parse_granularity(c.granularity).variant for c in gemm}
            if len(variants) > 1:
                raise ValueError(f"LinearRecipe: the NVFP4 operands of one GEMM need one variant, got "
                                 f"{', '.join(sorted(variants))}")

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


def _te_block() -> Recipe:
    # Transformer Engine 2.x Float8BlockScaling defaults: fp8_format E4M3 (forward and backward),
    # power_2_scale=True (unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1), amax_epsilon 0,
    # x/grad 1-D blocks (1x128), w 2-D blocks (128x128)
    one_d = CastConfig("e4m3", "current:pow2", granularity="block:1x128")
    return Recipe(
        "te-block",
        "Transformer Engine Float8BlockScaling: E4M3, power-of-two float32 scales per 1x128 block "
        "(inputs, output gradients) and per 128x128 tile (weights)",
        linear=LinearRecipe(input=one_d, weight=CastConfig("e4m3", "current:pow2", granularity="block:128x128"),
                            grad_output=one_d),
    )


def _nvfp4(name: str, rht: bool, sr: bool) -> Recipe:
    # arXiv 2509.25149 / Transformer Engine 2.x NVFP4BlockScaling defaults: 1x16 inputs and
    # gradients, 16x16 weights, RHT on the wgrad copies of inputs and gradients, stochastic
    # rounding of the gradients; TE's two-level scale rules (variant "te"), current amaxes
    what = {(True, True): "the paper's recipe", (False, True): "without the RHT",
            (True, False): "without stochastic rounding", (False, False): "without RHT and stochastic rounding"}
    return Recipe(
        name,
        f"NVFP4 ({what[rht, sr]}): E2M1, E4M3 scale per 16 elements + float32 tensor scale; 1x16 inputs "
        "and output gradients, 16x16 weights",
        linear=LinearRecipe(
            input=CastConfig("e2m1", "current", granularity="nvfp4", rht=rht),
            weight=CastConfig("e2m1", "current", granularity="nvfp4:2d"),
            grad_output=CastConfig("e2m1", "current", granularity="nvfp4", rounding="stochastic" if sr else "rne",
                                   rht=rht),
        ),
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
    "te-block": _te_block,
    "nvfp4": lambda: _nvfp4("nvfp4", rht=True, sr=True),
    "nvfp4-no-rht": lambda: _nvfp4("nvfp4-no-rht", rht=False, sr=True),
    "nvfp4-no-sr": lambda: _nvfp4("nvfp4-no-sr", rht=True, sr=False),
    "nvfp4-no-rht-no-sr": lambda: _nvfp4("nvfp4-no-rht-no-sr", rht=False, sr=False),
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
