"""Run and model configuration: plain dataclasses, no torch (``fp8sim train --help`` reads the
defaults from here without importing torch).

Invalid values raise :class:`ConfigError`, a ``ValueError`` that names the field, so the command
line can say which flag (``--steps``) rather than which attribute (``TrainConfig.steps``).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["BACKENDS", "ConfigError", "GPTConfig", "TrainConfig", "defaults"]

#: FP8 GEMM backends a run can use (see :mod:`fp8sim.backends`)
BACKENDS = ("emulator", "torch", "triton")


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
            _check_int(self, name, 1, path=f"model.{name}")
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
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at the last step
    warmup: int = 20
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
            _check_int(self, name, 1)
        for name in ("warmup", "eval_every", "checkpoint_every", "seed"):  # 0: none / only at the end
            _check_int(self, name, 0)
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

    def lr_at(self, step: int) -> float:
        """Learning rate of 1-based ``step``: linear warmup, then cosine to ``lr * min_lr_ratio``."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        ratio = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * ratio


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(obj: object, name: str, lowest: int, *, path: str | None = None) -> None:
    """ConfigError unless ``obj.name`` is an int (not a bool) >= ``lowest``."""
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ConfigError(path or name, f"must be an integer >= {lowest}, got {value!r}")


def defaults(cls: type) -> dict:
    """A config dataclass's default values by field name, without constructing (or validating)
    one: what ``--help`` shows."""
    out = {}
    for f in fields(cls):
        out[f.name] = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
    return out
