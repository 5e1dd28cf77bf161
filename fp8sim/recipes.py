"""Precision recipes: frozen, typed objects, one class per family, as Transformer Engine's.

Three levels (torchao's ``CastConfig`` / ``Float8LinearConfig`` split, TE's recipe classes):

* :class:`CastConfig` -- one cast: target :class:`~fp8sim.formats.FloatFormat`, scaling config
  (:mod:`fp8sim.scaling_config`: current, delayed, MS-AMP, AutoScale, static), granularity
  (:class:`~fp8sim.granularity.Granularity`), :class:`~fp8sim.formats.Rounding`, RHT. A
  :class:`fp8sim.quantizer.Quantizer` is built from it.
* :class:`LinearRecipe` -- one FP8 linear layer: the casts of its GEMM operands (``input``,
  ``weight``, ``grad_output``; optionally ``weight_grad``), which of its three GEMMs run in low
  precision (:class:`Gemms`), the :class:`GemmRule`, and the layers kept in high precision.
* :class:`Recipe` -- a whole run. One subclass per family, each holding that family's knobs as
  typed fields and deriving its ``linear`` level: :class:`HighPrecision` (``fp32``, ``bf16``),
  :class:`DelayedScalingRecipe` (``te-delayed``), :class:`CurrentScalingRecipe`
  (``te-current``), :class:`BlockScalingRecipe` (``te-block``), :class:`MXRecipe` (``mx``),
  :class:`NVFP4Recipe` (``nvfp4`` and its ablations), :class:`FP8LMRecipe` (``fp8lm-o1/o2/o3``),
  :class:`TorchaoRecipe` (``torchao-tensorwise``, ``-rowwise``, ``-rowwise-gw-hp``) and
  :class:`CustomRecipe` (any casts you write yourself).

Strings are parsed once, at the edges: :func:`get_recipe` (``get_recipe("te-delayed",
amax_history_len=32)``) and the command line. A field of an enum type also takes the member's
value (``autocast="bfloat16"``) when you build a recipe yourself; nothing below that parses.

Every built-in recipe keeps ``lm_head`` (the output layer) in high precision; the FP8-LM paper
keeps about 16% of its linear layers in BF16, mostly the last blocks, which ``keep_last_blocks``
adds (default 0).

A light module (numpy only): the command line lists recipes without loading torch or numba.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any, Callable, ClassVar

from fp8sim.formats import FloatFormat, Rounding, get_format
from fp8sim.granularity import E8M0Rule, Granularity, parse_granularity
from fp8sim.scaling_config import (AmaxAlgo, CurrentScalingConfig, DelayedScalingConfig, MSAMPScalingConfig,
                                   ScalingConfig, TorchaoScalingConfig, parse_scaling, scaling_spec)  # fmt: skip

__all__ = [
    "GemmRule",
    "Gemms",
    "Fp8Format",
    "Autocast",
    "Optimizer",
    "GradComm",
    "WeightStorage",
    "GradScaling",
    "Fp8Grads",
    "TorchaoKind",
    "CastConfig",
    "LinearRecipe",
    "Recipe",
    "HighPrecision",
    "DelayedScalingRecipe",
    "CurrentScalingRecipe",
    "BlockScalingRecipe",
    "MXRecipe",
    "NVFP4Recipe",
    "FP8LMRecipe",
    "TorchaoRecipe",
    "CustomRecipe",
    "get_recipe",
    "list_recipes",
    "register_recipe",
]


class _Choice(str, Enum):
    def __str__(self) -> str:
        return self.value


class GemmRule(_Choice):
    """How an FP8 GEMM's arithmetic is emulated (:meth:`fp8sim.backends.base.Backend.gemm`)."""

    #: decoded operands multiplied exactly, summed in float32 (``gemm_accumulate="float64"``:
    #: float64), the scales applied once after the sum as cuBLAS's epilogue does; block scales
    #: per block (the closest to the exact product)
    EXACT = "exact"
    #: torchao's emulation: each operand dequantized in float32 (``float32(code) / scale``),
    #: then a float32 matmul
    TORCHAO = "torchao"
    #: :mod:`fp8sim.gemm`'s limited-width accumulator, promoted to float32 every 128 elements
    #: (14 significant bits, truncated: Hopper's FP8 tensor cores as DeepSeek-V3 reports)
    ACCUMULATOR = "accumulator"


class Fp8Format(_Choice):
    """Transformer Engine's ``Format``: the FP8 formats of the forward and backward casts."""

    E4M3 = "e4m3"  #: E4M3 everywhere
    HYBRID = "hybrid"  #: E4M3 forward (inputs, weights), E5M2 backward (output gradients)


class Autocast(_Choice):
    """The dtype of the ops outside the FP8 GEMMs."""

    BF16 = "bfloat16"  #: torch.autocast to bfloat16


class Optimizer(_Choice):
    """The optimizer level."""

    ADAMW = "adamw"  #: torch.optim.AdamW, float32 states
    FP8_ADAMW = "fp8-adamw"  #: FP8-LM's Adam: E4M3 first moment, FP16 second moment and masters


class GradComm(_Choice):
    """How gradients travel between data-parallel ranks."""

    NONE = "none"  #: one process
    FP32 = "fp32"  #: float32 all-reduce
    BF16 = "bf16"  #: bfloat16 all-reduce
    FP8 = "fp8"  #: FP8-LM's E4M3 all-reduce with a shared scale


class WeightStorage(_Choice):
    """How weights are stored between steps."""

    FP32 = "fp32"  #: the user's parameters
    FP8 = "fp8"  #: E4M3 weights sharded across ranks with FP16 masters (FP8-LM O3)


class GradScaling(_Choice):
    """The scale of FP8-LM's gradient all-reduce."""

    AUTOSCALE = "autoscale"  #: FP8-LM's automatic scaling (factor mu steered by saturation)
    MSAMP = "msamp"  #: MS-AMP's power-of-two scale divided by sqrt(world size)


class Fp8Grads(_Choice):
    """Which gradients FP8-LM sends and stores in E4M3."""

    ALL = "all"  #: every parameter's (the paper's 6 bytes per parameter)
    LINEAR = "linear"  #: only the FP8 linears' weight gradients (MS-AMP); the rest in bfloat16


class TorchaoKind(_Choice):
    """torchao.float8's named recipes (``Float8LinearConfig.from_recipe_name``)."""

    TENSORWISE = "tensorwise"  #: one scale per tensor, E4M3 forward, E5M2 output gradients
    ROWWISE = "rowwise"  #: one power-of-two scale per row along each GEMM's reduction axis, E4M3
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"  #: rowwise, weight-gradient GEMM in high precision


def _enum(owner: Any, name: str, kind: type[Enum]) -> None:
    """Take a field's value string into its enum member (where a user built the object)."""
    v = getattr(owner, name)
    if v is None or isinstance(v, kind):
        return
    try:
        object.__setattr__(owner, name, kind(v))
    except ValueError:
        raise ValueError(f"{type(owner).__name__}.{name} must be one of "
                         f"{', '.join(m.value for m in kind)}, got {v!r}") from None


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; {new}", DeprecationWarning,
                  stacklevel=4)


# -- one cast ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CastConfig:
    """One cast: what a :class:`fp8sim.quantizer.Quantizer` is built from.

    Attributes:
        fmt: the target :class:`~fp8sim.formats.FloatFormat` (``get_format("e4m3")``).
        scaling: when the scale is taken (:mod:`fp8sim.scaling_config`): this step's amax
            (``CurrentScalingConfig(pow2=..., epsilon=..., margin=...)``), an amax history
            (``DelayedScalingConfig``), MS-AMP's window, FP8-LM's AutoScale, or a static scale.
        granularity: over what (:class:`~fp8sim.granularity.Granularity`): one scale per
            tensor, per row along the reduction axis (``Granularity.row()``, torchao's rowwise),
            or per block -- ``Granularity.blocks(1, 128)`` / ``blocks(128, 128)`` (float32
            scales by the current rule: pow2, epsilon, margin), ``Granularity.mx(rule)`` (E8M0 per
            32 elements), ``Granularity.nvfp4(layout, variant)`` (fmt must be E2M1). Block
            granularities take their scales just in time (current scaling). Blocks are laid along
            the reduction axis of the GEMM that consumes the tensor: a one-row block (``1xC``,
            MX, ``nvfp4``) is cast again from the high-precision tensor for a GEMM that reduces
            along its other axis; a square tile is cast once and its transpose serves both.
        rounding: the :class:`~fp8sim.formats.Rounding` of the cast (stochastic: Philox keyed
            by the step and the tensor's name); casts saturate (overflow clamps to +-max).
        rht: apply the Random Hadamard Transform (16x16, Transformer Engine's sign vector) to
            this tensor's copy for the weight-gradient GEMM, along that GEMM's reduction (token)
            axis, before its cast (NVFP4 inputs and output gradients only).
    """

    fmt: FloatFormat
    scaling: ScalingConfig = field(default_factory=CurrentScalingConfig)
    granularity: Granularity = field(default_factory=Granularity.tensor)
    rounding: Rounding = Rounding.RNE
    rht: bool = False

    def __post_init__(self) -> None:
        legacy = [n for n in ("fmt", "scaling", "granularity") if isinstance(getattr(self, n), str)]
        if legacy:
            _deprecated(f"CastConfig with string {', '.join(legacy)} ({self._legacy_words()})",
                        "build it from typed objects: CastConfig(get_format('e4m3'), DelayedScalingConfig(history=16), "
                        "Granularity.blocks(1, 128)), or parse a spec once with fp8sim.scaling_config.parse_scaling")
            self._take_strings()
        if not isinstance(self.fmt, FloatFormat):
            raise TypeError(f"CastConfig.fmt must be a FloatFormat (fp8sim.get_format(name)), got {self.fmt!r}")
        if not isinstance(self.scaling, ScalingConfig):
            raise TypeError(f"CastConfig.scaling must be a ScalingConfig, got {self.scaling!r}")
        if not isinstance(self.granularity, Granularity):
            raise TypeError(f"CastConfig.granularity must be a Granularity, got {self.granularity!r}")
        _enum(self, "rounding", Rounding)
        if not isinstance(self.rht, bool):
            raise TypeError(f"CastConfig.rht must be True or False, got {self.rht!r}")
        g = self.granularity
        if g.kind != "tensor" and not isinstance(self.scaling, (CurrentScalingConfig, TorchaoScalingConfig)):
            raise ValueError(f"CastConfig: granularity {g.spec} takes its block scales just in time: its scaling "
                             f"must be CurrentScalingConfig, got {self.scaling.NAME}")
        if isinstance(self.scaling, TorchaoScalingConfig) and g.kind not in ("tensor", "row"):
            raise ValueError(f"CastConfig: torchao scaling is per tensor or per row, not {g.spec}")
        if g.kind in ("mx", "nvfp4") and self.scaling != CurrentScalingConfig():
            raise ValueError(f"CastConfig: {g.spec} scales follow their own rule; margin, pow2 and epsilon do not apply")
        if g.kind == "nvfp4" and self.fmt.name != "e2m1":
            raise ValueError(f"CastConfig: granularity {g.spec} casts to e2m1, got fmt {self.fmt.name}")
        if self.rht and g.kind != "nvfp4":
            raise ValueError(f"CastConfig.rht is for nvfp4 granularities, not {g.spec}")

    def _legacy_words(self) -> str:
        return ", ".join(f"{n}={getattr(self, n)!r}" for n in ("fmt", "scaling", "granularity")
                         if isinstance(getattr(self, n), str))

    def _take_strings(self) -> None:
        """Today's spelling, ``CastConfig("e4m3", "mx:rceil", granularity="mx")``, as objects."""
        if isinstance(self.fmt, str):
            object.__setattr__(self, "fmt", get_format(self.fmt))
        spec_gran = None
        if isinstance(self.scaling, str):
            cfg, spec_gran = parse_scaling(self.scaling)
            object.__setattr__(self, "scaling", cfg)
        if isinstance(self.granularity, str):
            g = parse_granularity(self.granularity)
            if g.kind == "mx" and spec_gran is not None and spec_gran.kind == "mx":
                g = spec_gran  # the policy (mx or mx:rceil) picked the E8M0 rule
            object.__setattr__(self, "granularity", g)
        elif spec_gran is not None and spec_gran.kind != "tensor" and self.granularity.kind == "tensor":
            object.__setattr__(self, "granularity", spec_gran)

    @property
    def policy(self) -> str:
        """The scaling spec string of this cast (:func:`fp8sim.scaling_config.scaling_spec`),
        as traces and run files store it."""
        return scaling_spec(self.scaling, self.granularity)

    def to_dict(self) -> dict:
        """Plain data: ``{"format", "policy", "granularity", "rounding", "rht"}``."""
        return {"format": self.fmt.name, "policy": self.policy, "granularity": self.granularity.spec,
                "rounding": self.rounding.value, "rht": self.rht}


# -- one linear layer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gemms:
    """Which of a linear layer's three GEMMs run on FP8 operands (the others in the input's
    precision, float32 accumulation): ``fprop`` ``Y = X W^T``, ``dgrad`` ``dX = dY W``,
    ``wgrad`` ``dW = dY^T X``."""

    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True


@dataclass(frozen=True)
class LinearRecipe:
    """The casts of one FP8 linear ``y = x W^T + b``.

    Forward GEMM on ``input`` x ``weight``; backward GEMMs ``dX = dY W`` and ``dW = dY^T X`` on
    ``grad_output`` with the saved FP8 weight and input. ``weight_grad`` (None: kept in float32)
    casts the weight gradient after the wgrad GEMM (FP8-LM O1). ``gemms``: which GEMMs run in
    FP8; ``gemm_rule``: their arithmetic; ``weight_dgrad`` (None: ``weight``'s) casts the weight
    for the ``dX`` GEMM differently (torchao's ``cast_config_weight_for_grad_input``). The modules kept in high precision (they stay
    ``nn.Linear``): those whose qualified name ends with one of ``skip``, and the linears of the
    last ``keep_last_blocks`` numbered blocks -- a block is the first integer in a module's
    qualified name (``blocks.3.attn.c_attn`` is in block 3, Hugging Face's
    ``transformer.h.11.mlp.c_fc`` in block 11), the last blocks are the largest numbers present.
    """

    input: CastConfig
    weight: CastConfig
    grad_output: CastConfig
    weight_grad: CastConfig | None = None
    skip: tuple[str, ...] = ("lm_head",)
    keep_last_blocks: int = 0
    gemm_rule: GemmRule = GemmRule.EXACT
    gemms: Gemms = field(default_factory=Gemms)
    weight_dgrad: CastConfig | None = None

    def __post_init__(self) -> None:
        n = self.keep_last_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"LinearRecipe.keep_last_blocks must be an int >= 0, got {n!r}")
        _enum(self, "gemm_rule", GemmRule)
        for role in ("input", "weight", "grad_output", "weight_grad", "weight_dgrad"):
            c = getattr(self, role)
            if c is not None and not isinstance(c, CastConfig):
                raise TypeError(f"LinearRecipe.{role} must be a CastConfig, got {type(c).__name__}")
        if self.input.rht != self.grad_output.rht:
            raise ValueError("LinearRecipe: the RHT must apply to both weight-gradient GEMM operands "
                             "(input.rht and grad_output.rht) or to neither")
        if self.weight.rht:
            raise ValueError("LinearRecipe: weight.rht: the RHT applies to the weight-gradient GEMM's operands "
                             "(input and grad_output), not to the weight")
        gemm = (self.input, self.weight, self.grad_output)
        for c in (*gemm, self.weight_dgrad):
            g = None if c is None else c.granularity
            if g is not None and (g.kind == "col" or (g.block is not None and g.block[0] not in (1, g.block[1]))):
                raise ValueError(f"LinearRecipe: a GEMM operand is scaled along its reduction axis: tensor, row, "
                                 f"one-row blocks (1xC) or square tiles (CxC, weights), not {g.spec}")
        if len({c.granularity.kind == "tensor" for c in gemm}) > 1:
            raise ValueError("LinearRecipe: input, weight and grad_output must all be per-tensor scaled or all "
                             "block scaled (mx, block, nvfp4)")
        kinds = {c.granularity.kind == "nvfp4" for c in gemm}
        if len(kinds) > 1:
            raise ValueError("LinearRecipe: NVFP4 GEMMs need input, weight and grad_output all in nvfp4")
        if kinds == {True} and len({c.granularity.variant for c in gemm}) > 1:
            raise ValueError(f"LinearRecipe: the NVFP4 operands of one GEMM need one variant, got "
                             f"{', '.join(sorted({c.granularity.variant for c in gemm}))}")

    def casts(self) -> dict[str, CastConfig]:
        """Role -> cast, for the roles this recipe casts (the trace roles of docs/design.md)."""
        out = {"activation": self.input, "weight": self.weight, "grad_output": self.grad_output}
        if self.weight_grad is not None:
            out["weight_grad"] = self.weight_grad
        return out


# -- whole runs: one class per family ------------------------------------------------------------------


#: the positional order of today's ``Recipe(...)``
_LEGACY_ARGS = ("name", "description", "autocast", "linear", "optimizer", "grad_comm", "weight_storage", "extra")


class _RecipeMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Recipe:  # today's generic constructor: a CustomRecipe, with a word
            _deprecated("Recipe(name, description, linear=..., ...)",
                        "use CustomRecipe(...) with the same keyword arguments (or a family: DelayedScalingRecipe, ...)")
            if len(args) > len(_LEGACY_ARGS):
                raise TypeError(f"Recipe() takes at most {len(_LEGACY_ARGS)} positional arguments")
            return CustomRecipe(**dict(zip(_LEGACY_ARGS, args)), **kwargs)
        return super().__call__(*args, **kwargs)


@dataclass(frozen=True)
class Recipe(metaclass=_RecipeMeta):
    """A whole run's precision (base class; build a family, or :class:`CustomRecipe`).

    Attributes:
        name: the registry name (or your own).
        autocast: None (float32 outside the FP8 GEMMs) or :attr:`Autocast.BF16`.
        skip: qualified-name suffixes of linear layers kept in high precision.
        keep_last_blocks: the last numbered blocks kept in high precision (FP8-LM).
        gemm_rule: the :class:`GemmRule` of every FP8 GEMM.

    Derived (properties): ``linear`` (the :class:`LinearRecipe`, None without FP8 GEMMs),
    ``description``, ``optimizer``, ``grad_comm``, ``weight_storage``, ``grad_scaling``,
    ``fp8_grads`` (the run levels; FP8-LM's differ from the defaults), ``is_fp8``.
    """

    name: str = ""
    autocast: Autocast | None = None
    skip: tuple[str, ...] = ("lm_head",)
    keep_last_blocks: int = 0
    gemm_rule: GemmRule = GemmRule.EXACT

    FAMILY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _enum(self, "autocast", Autocast)
        _enum(self, "gemm_rule", GemmRule)
        if not isinstance(self.skip, tuple) or not all(isinstance(s, str) for s in self.skip):
            raise TypeError(f"{type(self).__name__}.skip must be a tuple of strings, got {self.skip!r}")
        if not self.name:
            object.__setattr__(self, "name", self.FAMILY)

    # -- the linear level ----------------------------------------------------------------------
    def _casts(self) -> tuple[CastConfig, CastConfig, CastConfig, CastConfig | None] | None:
        return None

    def _gemms(self) -> Gemms:
        return Gemms()

    def _weight_dgrad(self) -> CastConfig | None:
        return None

    @property
    def linear(self) -> LinearRecipe | None:
        casts = self._casts()
        if casts is None:
            return None
        return LinearRecipe(*casts, skip=self.skip, keep_last_blocks=self.keep_last_blocks,
                            gemm_rule=self.gemm_rule, gemms=self._gemms(), weight_dgrad=self._weight_dgrad())

    @property
    def is_fp8(self) -> bool:
        return self.linear is not None

    @property
    def description(self) -> str:
        return self.FAMILY

    # -- the run levels (FP8-LM's differ) ----------------------------------------------------------
    @property
    def optimizer(self) -> Optimizer:
        return Optimizer.ADAMW

    @property
    def grad_comm(self) -> GradComm:
        return GradComm.NONE

    @property
    def weight_storage(self) -> WeightStorage:
        return WeightStorage.FP32

    @property
    def grad_scaling(self) -> GradScaling:
        return GradScaling.AUTOSCALE

    @property
    def fp8_grads(self) -> Fp8Grads:
        return Fp8Grads.LINEAR

    @property
    def single_process(self) -> bool:
        """Whether only the linear level differs from plain AdamW training (convert_to_fp8 applies
        all of it); else the FP8-LM levels need :mod:`fp8sim.training.fp8lm`."""
        return (self.optimizer, self.grad_comm, self.weight_storage) == (
            Optimizer.ADAMW, GradComm.NONE, WeightStorage.FP32)

    @property
    def extra(self) -> tuple[tuple[str, str], ...]:
        """Deprecated: the run options are typed fields (``grad_scaling``, ``fp8_grads``)."""
        _deprecated("Recipe.extra", "read recipe.grad_scaling and recipe.fp8_grads")
        return (("grad_scaling", self.grad_scaling.value), ("fp8_grads", self.fp8_grads.value))

    def to_dict(self) -> dict:
        """Plain data, for run configs and traces: the family, its fields, the derived levels and
        the linear level's casts."""
        out: dict[str, Any] = {"family": self.FAMILY, "description": self.description}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = _plain(v)
        lin = self.linear
        out.update(optimizer=self.optimizer.value, grad_comm=self.grad_comm.value,
                   weight_storage=self.weight_storage.value,
                   linear=None if lin is None else {
                       **{r: c.to_dict() for r, c in lin.casts().items()},
                       "gemm_rule": lin.gemm_rule.value, "gemms": asdict(lin.gemms), "skip": list(lin.skip),
                       "keep_last_blocks": lin.keep_last_blocks})
        return out


def _plain(v: Any) -> Any:
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, (CastConfig,)):
        return v.to_dict()
    if isinstance(v, LinearRecipe):
        return {r: c.to_dict() for r, c in v.casts().items()}
    return v


def _hybrid(fmt: Fp8Format) -> tuple[FloatFormat, FloatFormat]:
    """(forward format, backward format) of TE's ``Format``."""
    e4m3 = get_format("e4m3")
    return e4m3, (get_format("e5m2") if fmt == Fp8Format.HYBRID else e4m3)


@dataclass(frozen=True)
class HighPrecision(Recipe):
    """No FP8: float32 everywhere (``fp32``, the reference) or bfloat16 autocast (``bf16``)."""

    FAMILY: ClassVar[str] = "high-precision"

    @property
    def description(self) -> str:
        if self.autocast == Autocast.BF16:
            return "bfloat16 autocast, float32 weights and optimizer states"
        return "float32 everywhere (the reference)"


@dataclass(frozen=True)
class DelayedScalingRecipe(Recipe):
    """Transformer Engine's ``DelayedScaling``: per-tensor scales from an amax history.

    ``fp8_format``: HYBRID (E4M3 forward, E5M2 output gradients) or E4M3; ``margin``,
    ``amax_history_len``, ``amax_compute_algo`` as TE's (:class:`DelayedScalingConfig`). TE's
    default history is 1024; ``te-delayed`` uses 16 so that short runs react."""

    FAMILY: ClassVar[str] = "delayed"
    fp8_format: Fp8Format = Fp8Format.HYBRID
    margin: float = 0.0
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = AmaxAlgo.MAX

    def __post_init__(self) -> None:
        super().__post_init__()
        _enum(self, "fp8_format", Fp8Format)
        _enum(self, "amax_compute_algo", AmaxAlgo)
        DelayedScalingConfig(self.amax_history_len, self.amax_compute_algo, self.margin)  # checks the values

    def _casts(self):
        fwd, bwd = _hybrid(self.fp8_format)
        s = DelayedScalingConfig(self.amax_history_len, self.amax_compute_algo, self.margin)
        return CastConfig(fwd, s), CastConfig(fwd, s), CastConfig(bwd, s), None

    @property
    def description(self) -> str:
        return (f"Transformer Engine {'hybrid ' if self.fp8_format == Fp8Format.HYBRID else ''}FP8: E4M3 "
                f"input/weight, {_hybrid(self.fp8_format)[1].name.upper()} output gradient, delayed scaling "
                f"(amax history {self.amax_history_len}, {self.amax_compute_algo.value})")


@dataclass(frozen=True)
class CurrentScalingRecipe(Recipe):
    """Transformer Engine's ``Float8CurrentScaling``: per-tensor scales from this step's amax
    (``power_2_scale``, ``amax_epsilon``; :class:`CurrentScalingConfig`)."""

    FAMILY: ClassVar[str] = "current"
    fp8_format: Fp8Format = Fp8Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    margin: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _enum(self, "fp8_format", Fp8Format)
        self._scaling()

    def _scaling(self) -> CurrentScalingConfig:
        return CurrentScalingConfig(self.power_2_scale, self.amax_epsilon, self.margin)

    def _casts(self):
        fwd, bwd = _hybrid(self.fp8_format)
        s = self._scaling()
        return CastConfig(fwd, s), CastConfig(fwd, s), CastConfig(bwd, s), None

    @property
    def description(self) -> str:
        return (f"Transformer Engine {'hybrid ' if self.fp8_format == Fp8Format.HYBRID else ''}FP8: E4M3 "
                f"input/weight, {_hybrid(self.fp8_format)[1].name.upper()} output gradient, current "
                f"(just-in-time) scaling")


@dataclass(frozen=True)
class BlockScalingRecipe(Recipe):
    """Transformer Engine 2.x ``Float8BlockScaling`` (DeepSeek-V3's scheme): float32 scales
    per ``x_block`` of inputs and ``grad_block`` of output gradients (along each GEMM's
    reduction axis) and per ``w_block`` tile of weights, by the current rule with
    ``power_2_scale`` and ``amax_epsilon``. TE's defaults: E4M3 forward and backward, 1x128,
    128x128, power-of-two scales, epsilon 0."""

    FAMILY: ClassVar[str] = "block"
    fp8_format: Fp8Format = Fp8Format.E4M3
    x_block: tuple[int, int] = (1, 128)
    w_block: tuple[int, int] = (128, 128)
    grad_block: tuple[int, int] = (1, 128)
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _enum(self, "fp8_format", Fp8Format)
        self._casts()

    def _casts(self):
        fwd, bwd = _hybrid(self.fp8_format)
        s = CurrentScalingConfig(self.power_2_scale, self.amax_epsilon)
        return (CastConfig(fwd, s, Granularity.blocks(*self.x_block)), CastConfig(fwd, s, Granularity.blocks(*self.w_block)),
                CastConfig(bwd, s, Granularity.blocks(*self.grad_block)), None)  # fmt: skip

    @property
    def description(self) -> str:
        return (f"Transformer Engine Float8BlockScaling: {_hybrid(self.fp8_format)[0].name.upper()}, "
                f"{'power-of-two ' if self.power_2_scale else ''}float32 scales per "
                f"{'x'.join(map(str, self.x_block))} block (inputs, output gradients) and per "
                f"{'x'.join(map(str, self.w_block))} tile (weights)")


@dataclass(frozen=True)
class MXRecipe(Recipe):
    """Transformer Engine's ``MXFP8BlockScaling``: ``fp8_format`` elements, one E8M0 scale per 32
    elements along each GEMM's reduction axis, rounded by ``e8m0_rule`` (``rceil`` as TE and
    cuBLAS; ``floor`` is the OCP MX spec's)."""

    FAMILY: ClassVar[str] = "mx"
    fp8_format: Fp8Format = Fp8Format.E4M3
    e8m0_rule: E8M0Rule = E8M0Rule.RCEIL

    def __post_init__(self) -> None:
        super().__post_init__()
        _enum(self, "fp8_format", Fp8Format)
        _enum(self, "e8m0_rule", E8M0Rule)

    def _casts(self):
        fwd, bwd = _hybrid(self.fp8_format)
        g = Granularity.mx(self.e8m0_rule)
        return CastConfig(fwd, granularity=g), CastConfig(fwd, granularity=g), CastConfig(bwd, granularity=g), None

    @property
    def description(self) -> str:
        return (f"MXFP8: {_hybrid(self.fp8_format)[0].name.upper()} operands, one E8M0 scale per 32 elements "
                f"along the reduction axis")


@dataclass(frozen=True)
class NVFP4Recipe(Recipe):
    """arXiv 2509.25149 / Transformer Engine 2.x ``NVFP4BlockScaling``: E2M1 with an E4M3 scale per
    16 elements and a float32 tensor scale (``variant``'s rules, TE's by default); 1x16 blocks
    of inputs and output gradients along each GEMM's reduction axis, 16x16 weight tiles
    (``weight_2d``) so forward and backward see the same quantized weight, stochastic rounding
    of the output gradient in both backward GEMMs (``stochastic_rounding``), the Random
    Hadamard Transform with TE's sign vector on both weight-gradient GEMM operands along the
    token axis (``rht``)."""

    FAMILY: ClassVar[str] = "nvfp4"
    rht: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True
    variant: str = "te"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "variant", Granularity.nvfp4("1x16", self.variant).variant)

    def _casts(self):
        e2m1 = get_format("e2m1")
        one_d = Granularity.nvfp4("1x16", self.variant)
        w = Granularity.nvfp4("16x16" if self.weight_2d else "1x16", self.variant)
        sr = Rounding.STOCHASTIC if self.stochastic_rounding else Rounding.RNE
        return (CastConfig(e2m1, granularity=one_d, rht=self.rht), CastConfig(e2m1, granularity=w),
                CastConfig(e2m1, granularity=one_d, rounding=sr, rht=self.rht), None)  # fmt: skip

    @property
    def description(self) -> str:
        what = {(True, True): "the paper's recipe", (False, True): "without the RHT",
                (True, False): "without stochastic rounding",
                (False, False): "without RHT and stochastic rounding"}[self.rht, self.stochastic_rounding]
        return (f"NVFP4 ({what}): E2M1, E4M3 scale per 16 elements + float32 tensor scale; 1x16 inputs and "
                f"output gradients, {'16x16' if self.weight_2d else '1x16'} weights")


@dataclass(frozen=True)
class FP8LMRecipe(Recipe):
    """FP8-LM (arXiv:2310.18313; MS-AMP's O1/O2/O3), trained through
    :func:`fp8sim.training.fp8lm.prepare` or the distributed trainer.

    MS-AMP's scaling: power-of-two scales, amax window 16 for activations and output gradients,
    1 for weights and weight gradients; weight gradients cast to E4M3 (O1) and averaged by the
    FP8 all-reduce (``grad_scaling``: AutoScale or MS-AMP's 1/sqrt(N)); ``fp8_grads``: which
    gradients travel and are stored in E4M3. O2 adds the FP8-LM Adam (E4M3 first moment, FP16
    second moment, FP16 scaled masters); O3 stores E4M3 weights sharded across ranks."""

    FAMILY: ClassVar[str] = "fp8lm"
    level: int = 1
    grad_scaling: GradScaling = GradScaling.AUTOSCALE
    fp8_grads: Fp8Grads = Fp8Grads.ALL

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.level not in (1, 2, 3) or isinstance(self.level, bool):
            raise ValueError(f"FP8LMRecipe.level must be 1, 2 or 3, got {self.level!r}")
        _enum(self, "grad_scaling", GradScaling)
        _enum(self, "fp8_grads", Fp8Grads)

    def _casts(self):
        e4m3, e5m2 = get_format("e4m3"), get_format("e5m2")
        act, w = MSAMPScalingConfig(window=16), MSAMPScalingConfig(window=1)
        return CastConfig(e4m3, act), CastConfig(e4m3, w), CastConfig(e5m2, act), CastConfig(e4m3, w)

    @property
    def optimizer(self) -> Optimizer:
        return Optimizer.ADAMW if self.level == 1 else Optimizer.FP8_ADAMW

    @property
    def grad_comm(self) -> GradComm:
        return GradComm.FP8

    @property
    def weight_storage(self) -> WeightStorage:
        return WeightStorage.FP8 if self.level == 3 else WeightStorage.FP32

    @property
    def description(self) -> str:
        return f"FP8-LM O{self.level}: " + {
            1: "FP8 GEMMs, E4M3 weight gradients, FP8 gradient all-reduce with AutoScale",
            2: "O1 + FP8-LM Adam: E4M3 first moment, FP16 second moment, FP16 master weights (scaled)",
            3: "O2 + FSDP2: E4M3 weight all-gather, FP8 reduce-scatter, masters and Adam states sharded"}[self.level]


@dataclass(frozen=True)
class TorchaoRecipe(Recipe):
    """torchao.float8's training recipes (``Float8LinearConfig.from_recipe_name(kind)`` with
    ``emulate=True``), bit for bit: the scale rules, formats and GEMMs of torchao 0.18 and its
    emulated GEMM (:attr:`GemmRule.TORCHAO`). docs/numerics.md lists every rule that differs
    from ``te-current``."""

    FAMILY: ClassVar[str] = "torchao"
    kind: TorchaoKind = TorchaoKind.TENSORWISE
    gemm_rule: GemmRule = GemmRule.TORCHAO

    def __post_init__(self) -> None:
        super().__post_init__()
        _enum(self, "kind", TorchaoKind)

    def _casts(self):
        # torchao 0.18 config.py: tensorwise = E4M3 forward, E5M2 output gradients, one scale per
        # tensor, no pow2; rowwise = E4M3 everywhere, one power-of-two scale per row along each
        # GEMM's reduction axis; rowwise_with_gw_hp = rowwise, but the dX GEMM's weight per
        # tensor (pow2) and the dW GEMM in high precision
        e4m3, e5m2 = get_format("e4m3"), get_format("e5m2")
        if self.kind == TorchaoKind.TENSORWISE:
            s = TorchaoScalingConfig(pow2=False)
            return CastConfig(e4m3, s), CastConfig(e4m3, s), CastConfig(e5m2, s), None
        row = CastConfig(e4m3, TorchaoScalingConfig(pow2=True), Granularity.row())
        return row, row, row, None

    def _weight_dgrad(self) -> CastConfig | None:
        if self.kind == TorchaoKind.ROWWISE_WITH_GW_HP:
            return CastConfig(get_format("e4m3"), TorchaoScalingConfig(pow2=True))
        return None

    def _gemms(self) -> Gemms:
        return Gemms(wgrad=self.kind != TorchaoKind.ROWWISE_WITH_GW_HP)

    @property
    def description(self) -> str:
        return f"torchao float8 {self.kind.value} (emulate=True): its scale rules, formats and emulated GEMM"


@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """Your own casts: a :class:`LinearRecipe` (or None) and the run levels as typed fields.

    ``CustomRecipe("my-pow2", linear=LinearRecipe(input=..., weight=..., grad_output=...))``;
    its ``skip``/``keep_last_blocks``/``gemm_rule`` are the linear recipe's. ``description`` is
    free text. (``extra`` takes today's ``(("grad_scaling", ...), ("fp8_grads", ...))`` pairs for
    one release.)"""

    FAMILY: ClassVar[str] = "custom"
    description: str = ""
    linear: LinearRecipe | None = None
    optimizer: Optimizer = Optimizer.ADAMW
    grad_comm: GradComm = GradComm.NONE
    weight_storage: WeightStorage = WeightStorage.FP32
    grad_scaling: GradScaling = GradScaling.AUTOSCALE
    fp8_grads: Fp8Grads = Fp8Grads.LINEAR
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.extra:
            _deprecated("Recipe extra=(...) pairs", "pass grad_scaling= and fp8_grads= (typed fields)")
            known = {"grad_scaling", "fp8_grads"}
            for k, v in self.extra:
                if k not in known:
                    raise ValueError(f"CustomRecipe.extra: unknown key {k!r}; valid: {', '.join(sorted(known))}")
                object.__setattr__(self, k, v)
            object.__setattr__(self, "extra", ())
        for name, kind in (("optimizer", Optimizer), ("grad_comm", GradComm), ("weight_storage", WeightStorage),
                           ("grad_scaling", GradScaling), ("fp8_grads", Fp8Grads)):
            _enum(self, name, kind)
        if self.linear is not None and not isinstance(self.linear, LinearRecipe):
            raise TypeError(f"CustomRecipe.linear must be a LinearRecipe or None, got {type(self.linear).__name__}")
        if self.linear is not None:  # the layer-level fields are the linear recipe's
            object.__setattr__(self, "skip", self.linear.skip)
            object.__setattr__(self, "keep_last_blocks", self.linear.keep_last_blocks)
            object.__setattr__(self, "gemm_rule", self.linear.gemm_rule)


# -- the registry (the edge: names and overrides as strings) --------------------------------------------

_REGISTRY: dict[str, Callable[[], Recipe]] = {
    "fp32": lambda: HighPrecision("fp32"),
    "bf16": lambda: HighPrecision("bf16", autocast=Autocast.BF16),
    "te-delayed": lambda: DelayedScalingRecipe("te-delayed", amax_history_len=16),
    "te-current": lambda: CurrentScalingRecipe("te-current"),
    "mx": lambda: MXRecipe("mx"),
    "te-block": lambda: BlockScalingRecipe("te-block"),
    "nvfp4": lambda: NVFP4Recipe("nvfp4"),
    "nvfp4-no-rht": lambda: NVFP4Recipe("nvfp4-no-rht", rht=False),
    "nvfp4-no-sr": lambda: NVFP4Recipe("nvfp4-no-sr", stochastic_rounding=False),
    "nvfp4-no-rht-no-sr": lambda: NVFP4Recipe("nvfp4-no-rht-no-sr", rht=False, stochastic_rounding=False),
    "fp8lm-o1": lambda: FP8LMRecipe("fp8lm-o1", level=1),
    "fp8lm-o2": lambda: FP8LMRecipe("fp8lm-o2", level=2),
    "fp8lm-o3": lambda: FP8LMRecipe("fp8lm-o3", level=3),
    "torchao-tensorwise": lambda: TorchaoRecipe("torchao-tensorwise", kind=TorchaoKind.TENSORWISE),
    "torchao-rowwise": lambda: TorchaoRecipe("torchao-rowwise", kind=TorchaoKind.ROWWISE),
    "torchao-rowwise-gw-hp": lambda: TorchaoRecipe("torchao-rowwise-gw-hp", kind=TorchaoKind.ROWWISE_WITH_GW_HP),
}
_BUILTIN = frozenset(_REGISTRY)


def register_recipe(name: str, factory: Callable[[], Recipe]) -> None:
    """Deprecated: add a named recipe. Pass the recipe object itself instead
    (``convert_to_fp8(model, recipe)``, ``fp8lm.prepare(model, recipe)``). Re-registering a name
    raises ValueError."""
    _deprecated("register_recipe(name, factory)",
                "pass the recipe object itself: convert_to_fp8(model, recipe), fp8lm.prepare(model, recipe)")
    if name in _REGISTRY:
        raise ValueError(f"recipe {name!r} is already registered")
    _REGISTRY[name] = factory


def list_recipes() -> list[str]:
    """Registered recipe names, in registration order."""
    return list(_REGISTRY)


def get_recipe(name: str | Recipe, **overrides: Any) -> Recipe:
    """The recipe ``name`` (a registered name; a :class:`Recipe` is returned as is), with
    ``overrides`` replacing fields of its family (``dataclasses.replace``; an enum field takes
    its value's string). ValueError naming the valid names or fields otherwise."""
    if isinstance(name, Recipe):
        recipe = name
    elif name not in _REGISTRY:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(_REGISTRY)}")
    else:
        recipe = _REGISTRY[name]()
    if not overrides:
        return recipe
    valid = [f.name for f in fields(recipe) if f.init]
    bad = sorted(set(overrides) - set(valid))
    if bad:
        raise ValueError(f"get_recipe({recipe.name!r}): {type(recipe).__name__} has no field {bad[0]!r}; "
                         f"valid: {', '.join(valid)}")
    return replace(recipe, **overrides)
