"""Run and model configuration: plain dataclasses, no torch (``fp8sim train --help`` reads the
defaults from here without importing torch).

Invalid values raise :class:`ConfigError`, a ``ValueError`` that names the field, so the command
line can say which flag (``--steps``) rather than which attribute (``TrainConfig.steps``).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["BACKENDS", "ConfigError", "GPTConfig", "LIMITS", "TrainConfig", "defaults"]

#: FP8 GEMM backends a run can use (see :mod:`fp8sim.backends`)
BACKENDS = ("emulator", "torch", "triton")
#: the largest seed: torch's generators take 64-bit seeds
SEED_MAX = 2**64 - 1
#: the largest value of each size and count: far beyond what this trainer can run, and small
#: enough that a hand-edited config.json (n_layer 2**64) is refused instead of building for ever
LIMITS = {"block_size": 2**20, "vocab_size": 2**24, "n_layer": 2**12, "n_head": 2**12, "n_embd": 2**16,
          "steps": 2**40, "batch_size": 2**20, "eval_batches": 2**20, "max_bytes": 2**40, "warmup": 2**40,
          "eval_every": 2**40, "checkpoint_every": 2**40, "decay_steps": 2**40, "seed": SEED_MAX}  # fmt: skip


class ConfigError(ValueError):
    """An invalid configuration value. ``field`` is the attribute's path (``"steps"``,
    ``"model.n_embd"``) and ``rule`` what is wrong with it (``"must be >= 1, got 0"``); the
    message is ``"TrainConfig.steps must be >= 1, got 0"`` (``GPTConfig.n_embd ...`` for the model)."""

    def __init__(self, field: str, rule: str) -> None:
        owner = "GPTConfig." + field[6:] if field.startswith("model.") else "TrainConfig." + field
        super().__init__(f"{owner} {rule}")
        self.field, self.rule = field, rule


@dataclass(frozen=True)
class GPTConfig:
    """Model size. Defaults: the demo's model (124,672 parameters, 99 k of them in the blocks)."""

    block_size: int = 128  # context length T
    vocab_size: int = 256  # bytes
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64  # C; the FP8 GEMMs need multiples of 16 (32 for MX blocks)
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            _check_int(self, name, 1, path=f"model.{name}", highest=LIMITS[name])
        if not isinstance(self.bias, bool):
            raise ConfigError("model.bias", f"must be True or False, got {self.bias!r}")
        if self.n_embd % self.n_head:
            raise ConfigError("model.n_embd", f"must be a multiple of the number of heads ({self.n_head}), "
                                              f"got {self.n_embd}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run's numbers."""

    recipe: Any = "bf16"  # a registered name (fp8sim.recipes.list_recipes) or a Recipe object
    backend: str = "emulator"  # FP8 backend; ignored by recipes without FP8 GEMMs
    # FP8 GEMM accumulation: "float32" (torch.mm of the exactly decoded operands, shared by the
    # emulator and torch backends) or "float64" (exact products, one rounding); see fp8_linear
    gemm_accumulate: str = "float32"
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at the last step of the decay
    warmup: int = 20
    # steps of the schedule (warm-up included) after which the learning rate stays at
    # lr * min_lr_ratio; None: ``steps``. An extended run (``--resume --steps M``) keeps the one
    # it was trained with: see :meth:`continues`
    decay_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm (0: off)
    seed: int = 0
    eval_every: int = 50  # and at the last step; 0: only at the last step
    eval_batches: int = 4
    checkpoint_every: int = 50  # and at the last step; 0: only at the last step
    data: str | None = None  # None: the Python standard library's .py sources
    max_bytes: int = 16 * 2**20
    model: GPTConfig = field(default_factory=GPTConfig)

    def __post_init__(self) -> None:
        from fp8sim.recipes import Recipe, list_recipes

        if isinstance(self.recipe, dict):
            raise ConfigError("recipe", f"is the custom recipe {self.recipe.get('name')!r} (a Python object): resume "
                                        f"it from Python with TrainConfig(recipe=<the same recipe>)")
        if not isinstance(self.recipe, Recipe) and self.recipe not in list_recipes():
            raise ConfigError("recipe", f"must be one of {', '.join(list_recipes())} or a Recipe object, "
                                        f"got {self.recipe!r}")
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        from fp8sim.backends.base import GEMM_ACCUMULATIONS

        if self.gemm_accumulate not in GEMM_ACCUMULATIONS:
            raise ConfigError("gemm_accumulate", f"must be one of {', '.join(GEMM_ACCUMULATIONS)}, "
                                                 f"got {self.gemm_accumulate!r}")
        for name in ("steps", "batch_size", "eval_batches", "max_bytes"):
            _check_int(self, name, 1, highest=LIMITS[name])
        for name in ("warmup", "eval_every", "checkpoint_every", "seed"):  # 0: none / only at the end
            _check_int(self, name, 0, highest=LIMITS[name])
        if self.decay_steps is not None:
            _check_int(self, "decay_steps", 1, highest=LIMITS["decay_steps"])
        if not (_is_number(self.lr) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("lr", f"must be finite and > 0, got {self.lr!r}")
        for name in ("min_lr_ratio", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise ConfigError(name, f"must be finite and >= 0, got {value!r}")
        if self.data is not None and not (isinstance(self.data, str) and self.data.strip()):
            raise ConfigError("data", "is an empty path (give a file or directory, or leave it out)")
        if isinstance(self.model, dict):
            try:
                object.__setattr__(self, "model", GPTConfig(**self.model))
            except TypeError as exc:  # unknown or missing keys in a stored config
                raise ConfigError("model", f"is not a model config ({exc})") from None
        elif not isinstance(self.model, GPTConfig):
            raise ConfigError("model", f"must be a GPTConfig, got {type(self.model).__name__}")
        if self.model.vocab_size < 256:  # the corpus is bytes: every value 0..255 is a token
            raise ConfigError("model.vocab_size", f"must be >= 256 for the byte-level corpus, got {self.model.vocab_size}")

    def to_dict(self) -> dict:
        """Plain data (a custom recipe object as its :meth:`~fp8sim.recipes.Recipe.to_dict`)."""
        if isinstance(self.recipe, str):
            return asdict(self)
        out = asdict(replace(self, recipe="bf16"))
        out["recipe"] = self.recipe.to_dict()
        return out

    @property
    def recipe_name(self) -> str:
        """The recipe's name (a registered one, or a custom recipe object's)."""
        return self.recipe if isinstance(self.recipe, str) else self.recipe.name

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"is not a TrainConfig field (unknown keys: {', '.join(sorted(unknown))})")
        return cls(**d)

    def continues(self, old: "TrainConfig") -> bool:
        """Whether this run continues one configured as ``old``: the same config, or ``old``
        extended -- more ``steps`` and the learning-rate schedule ``old`` trained with
        (``decay_steps`` = old's, or old's ``steps`` where old had none). Every step of the
        extension after the decay trains at ``lr * min_lr_ratio``."""
        if self == old:
            return True
        schedule = old.decay_steps if old.decay_steps is not None else old.steps
        return self.steps > old.steps and self.decay_steps == schedule and replace(
            old, steps=self.steps, decay_steps=schedule) == self  # fmt: skip

    def extended(self, steps: int) -> "TrainConfig":
        """This run extended to ``steps`` (more than ``self.steps``), its schedule kept (see
        :meth:`continues`)."""
        if not steps > self.steps:
            raise ConfigError("steps", f"must be more than {self.steps} to extend the run, got {steps}")
        schedule = self.decay_steps if self.decay_steps is not None else self.steps
        return replace(self, steps=steps, decay_steps=schedule)

    def lr_at(self, step: int) -> float:
        """Learning rate of 1-based ``step``: linear warmup over ``warmup`` steps, then cosine
        from ``lr`` to ``lr * min_lr_ratio`` at step ``decay_steps`` (default ``steps``), then
        constant. Without ``decay_steps`` it depends on ``steps`` (after the warm-up)."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        decay = self.steps if self.decay_steps is None else self.decay_steps
        progress = (step - self.warmup) / max(1, decay - self.warmup)
        ratio = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * ratio


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(obj: object, name: str, lowest: int, *, path: str | None = None, highest: int | None = None) -> None:
    """ConfigError unless ``obj.name`` is an int (not a bool) >= ``lowest`` (and <= ``highest``)."""
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ConfigError(path or name, f"must be an integer >= {lowest}, got {value!r}")
    if highest is not None and value > highest:
        raise ConfigError(path or name, f"must be an integer from {lowest} to {_power(highest)}, got {value!r}")


def _power(n: int) -> str:
    """``n`` as written in the messages: ``2**40``, ``2**64 - 1``, or plain digits below 2**16."""
    if n >= 2**16 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    if n >= 2**16 and n & (n + 1) == 0:
        return f"2**{n.bit_length()} - 1"
    return str(n)


def defaults(cls: type) -> dict:
    """A config dataclass's default values by field name, without constructing (or validating)
    one: what ``--help`` shows."""
    out = {}
    for f in fields(cls):
        out[f.name] = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
    return out
