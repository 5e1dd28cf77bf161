"""Convert a model's linear layers to FP8: :func:`convert_to_fp8`, and finding them again
(:func:`fp8_linears`, :func:`get_fp8_state`). The layers themselves: :mod:`fp8sim.training.fp8_linear`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from fp8sim.training.fp8_linear import Fp8Linear, in_backward, is_hf_conv1d
from fp8sim.training.fp8_state import Fp8State
from fp8sim.recipes import LinearRecipe, Recipe, get_recipe

__all__ = ["ModuleFilter", "convert_to_fp8", "fp8_linears", "get_fp8_state"]


#: a module filter: ``(module, fully qualified name) -> bool``, torchao's convention
ModuleFilter = Callable[[nn.Module, str], bool]


def convert_to_fp8(
    model: nn.Module, recipe: Recipe | LinearRecipe | str, backend: str | Any = "emulator", *,
    module_filter_fn: ModuleFilter | None = None, count_events: bool = True,
    gemm_accumulate: str | None = "float32",
) -> nn.Module:
    """Replace the linear layers of ``model`` (in place) by :class:`Fp8Linear`; returns ``model``.

    Converted: every module that is an ``nn.Linear`` (``isinstance``: subclasses too) or a Hugging
    Face ``Conv1D`` (GPT-2's projections; its transposed weight stays as stored) for which
    ``module_filter_fn(module, fqn)`` is True. Without a filter, modules whose qualified name ends
    with an entry of the recipe's ``skip`` (``lm_head`` in the built-in recipes) stay as they are;
    a filter replaces that default (torchao's ``convert_to_float8_training`` converts every
    ``nn.Linear`` the filter accepts; unlike torchao, fp8sim has no dimension-multiple-of-16 rule,
    since the emulator needs none, and it converts ``Conv1D``). Parameters are kept (the same
    ``Parameter`` objects, dtypes and layouts: optimizers and weight tying keep working).

    ``recipe``: a registered name (``"te-delayed"``), a :class:`Recipe` or a :class:`LinearRecipe`.
    A recipe with levels beyond the linear layers -- the FP8-LM recipes (``fp8lm-o1``/``-o2``/``-o3``:
    FP8 gradient communication, FP8 optimizer, FP8 weight storage) -- is refused, since applying
    only its linear level would silently train something else: use
    :func:`fp8sim.training.fp8lm.prepare`, which applies every level (or pass ``recipe.linear`` for
    that level alone, deliberately). All converted layers share
    one :class:`Fp8State` (``gemm_accumulate``: see there). ValueError when the recipe has no FP8
    GEMMs, when the model is already converted, when nothing was converted (torchao returns the
    model unchanged) and when ``model`` is itself a linear layer (torchao returns a new module;
    fp8sim converts in place only).

    Deliberate differences from torchao's float8 layers besides those: the bias is added to the
    float32 GEMM result before its one rounding to the output dtype (as a cuBLASLt epilogue;
    torchao adds it after, in the output dtype), and scaling policies may be stateful (delayed,
    MS-AMP, AutoScale), so their state is in ``state_dict()`` and only training forwards observe.

    The step (:attr:`Fp8State.step`) advances at each forward of ``model`` in training mode with
    autograd enabled (a forward pre-hook on ``model``), unless the loop sets it.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if isinstance(recipe, Recipe) and not recipe.single_process:
        levels = ", ".join(f"{k}={v}" for k, v in (("optimizer", recipe.optimizer), ("grad_comm", recipe.grad_comm),
                                                   ("weight_storage", recipe.weight_storage)))  # fmt: skip
        raise ValueError(f"convert_to_fp8: recipe {recipe.name!r} has levels beyond the linear layers ({levels}) that "
                         f"convert_to_fp8 does not apply; use fp8sim.training.fp8lm.prepare(model, {recipe.name!r}), "
                         f"or get_recipe({recipe.name!r}).linear for its linear level alone")  # fmt: skip
    linear_recipe = recipe.linear if isinstance(recipe, Recipe) else recipe
    if not isinstance(linear_recipe, LinearRecipe):
        name = getattr(recipe, "name", recipe)
        raise ValueError(f"convert_to_fp8: recipe {name!r} has no FP8 linear layers")
    if get_fp8_state(model) is not None:
        raise ValueError("convert_to_fp8: model is already converted (it holds Fp8Linear layers)")
    if module_filter_fn is None:
        kept = _last_blocks(model, linear_recipe.keep_last_blocks)

        def module_filter_fn(mod: nn.Module, fqn: str) -> bool:
            return not any(fqn.endswith(s) for s in linear_recipe.skip) and _block_number(fqn) not in kept

    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if (isinstance(mod, nn.Linear) or is_hf_conv1d(mod)) and name and module_filter_fn(mod, name)
    ]
    if isinstance(model, nn.Linear) or is_hf_conv1d(model):
        raise ValueError("convert_to_fp8: model is itself a linear layer; wrap it (nn.Sequential(layer)) so it can "
                         "be replaced in place")
    if not targets:
        found = sum(1 for _, m in model.named_modules() if isinstance(m, nn.Linear) or is_hf_conv1d(m))
        why = (f"module_filter_fn (or, without one, the recipe's skip list {linear_recipe.skip}) rejected all "
               f"{found} nn.Linear / Conv1D modules" if found else "the model has no nn.Linear or Conv1D module")
        raise ValueError(f"convert_to_fp8: nothing converted: {why}")
    state = Fp8State(linear_recipe, backend, count_events=count_events, gemm_accumulate=gemm_accumulate,
                     recipe_name=getattr(recipe, "name", None))
    state.first_layer = targets[0][0]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear(mod, name, state))
    state._root_hook = model.register_forward_pre_hook(_advance_step_hook(state))
    return model


def _block_number(fqn: str) -> int | None:
    """The block a module belongs to: the first integer component of its qualified name."""
    return next((int(p) for p in fqn.split(".") if p.isdigit()), None)


def _last_blocks(model: nn.Module, n: int) -> set[int]:
    """The ``n`` largest block numbers among the model's linear layers (:class:`LinearRecipe`'s
    ``keep_last_blocks``); empty for ``n = 0``."""
    if n == 0:
        return set()
    found = {_block_number(name) for name, m in model.named_modules() if isinstance(m, nn.Linear) or is_hf_conv1d(m)}
    return set(sorted(b for b in found if b is not None)[-n:])


def _advance_step_hook(state: Fp8State):
    # never traced by torch.compile: the step is a Python int that changes every step (a guard on
    # it would recompile every step); the hook runs eagerly before the compiled graph
    @torch.compiler.disable
    def hook(module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled() and not in_backward():
            state._advance_step()

    return hook


def fp8_linears(model: nn.Module) -> list[Fp8Linear]:
    """The FP8 linears of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def get_fp8_state(model: nn.Module) -> Fp8State | None:
    """The shared :class:`Fp8State` of a converted model, or None."""
    layers = fp8_linears(model)
    return layers[0].state if layers else None
