"""Convert a model's linear layers and MoE experts to FP8: :func:`convert_to_fp8`, and finding them
again (:func:`fp8_linears`, :func:`fp8_experts`, :func:`get_fp8_state`). The layers themselves:
:mod:`fp8sim.training.fp8_linear`, :mod:`fp8sim.training.experts`; what stays in high precision and
why: :mod:`fp8sim.training.coverage`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from fp8sim.recipes import Autocast, LinearRecipe, Recipe, get_recipe
from fp8sim.training.coverage import (FILTER, LAST_BLOCKS, OUTPUT_LAYER, ROUTER, SKIP, is_linear, output_layers,
                                      routers, summarize, warn_not_converted)
from fp8sim.training.experts import convert_experts, is_fp8_experts, is_hf_experts
from fp8sim.training.fp8_linear import Fp8Linear, in_backward, is_hf_conv1d
from fp8sim.training.fp8_state import Fp8State

__all__ = ["ModuleFilter", "convert_to_fp8", "apply_autocast", "fp8_linears", "fp8_experts", "get_fp8_state"]


#: a module filter: ``(module, fully qualified name) -> bool``, torchao's convention
ModuleFilter = Callable[[nn.Module, str], bool]


def convert_to_fp8(
    model: nn.Module, recipe: Recipe | LinearRecipe | str, backend: str | Any = "emulator", *,
    module_filter_fn: ModuleFilter | None = None, count_events: bool = True,
    gemm_accumulate: str | None = "float32", keep_output_layer: bool = True, amax_reduction: Any = "auto",
) -> nn.Module:
    """Run the GEMMs of ``model``'s linear layers and mixture-of-experts experts in FP8 (in
    place); returns ``model``.

    Converted: every module that is an ``nn.Linear`` (``isinstance``: subclasses too) or a Hugging
    Face ``Conv1D`` (GPT-2's projections; its transposed weight stays as stored) -- replaced by an
    :class:`Fp8Linear` -- and every transformers experts module (3-D expert weights behind
    transformers' experts interface: Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DeepSeek-V3, ...; made
    FP8 in place, one grouped FP8 GEMM per projection with one scale set per expert, see
    :mod:`fp8sim.training.experts`), for which ``module_filter_fn(module, fqn)`` is True. Without
    a filter, modules whose qualified name ends with an entry of the recipe's ``skip``
    (``lm_head`` in the built-in recipes), the linears and experts of the recipe's last
    ``keep_last_blocks`` blocks and the routers of MoE blocks (:mod:`fp8sim.training.coverage`)
    stay as they are; a filter replaces that default (torchao's ``convert_to_float8_training``
    converts every ``nn.Linear`` the filter accepts; unlike torchao, fp8sim has no
    dimension-multiple-of-16 rule, since the emulator needs none, and it converts ``Conv1D``).
    ``keep_output_layer`` (default True, with or without a filter): the output layer --
    ``get_output_embeddings()`` of the Hugging Face models in ``model`` and linears tied to an
    embedding -- stays in high precision. Parameters are kept (the same ``Parameter`` objects,
    names, dtypes and layouts: optimizers and weight tying keep working).

    ``get_fp8_state(model).summary`` (:class:`~fp8sim.training.coverage.Fp8Summary`) lists which
    parameters run in FP8 and which stay in high precision, and why; modules holding parameters
    fp8sim cannot convert (a convolution, a custom MoE) are named in one warning.

    ``recipe``: a registered name (``"te-delayed"``), a :class:`Recipe` or a :class:`LinearRecipe`.
    A recipe's ``autocast`` (``get_recipe("te-delayed", autocast="bfloat16")``) is applied: every
    forward of ``model`` runs under ``torch.autocast`` to that dtype (the FP8 GEMMs' float32
    results are rounded once to it). A recipe with levels beyond the linear layers -- the FP8-LM
    recipes (``fp8lm-o1``/``-o2``/``-o3``: FP8 gradient communication, FP8 optimizer, FP8 weight
    storage) -- is refused, since applying only its linear level would silently train something
    else: use :func:`fp8sim.training.fp8lm.prepare`, which applies every level (or pass
    ``recipe.linear`` for that level alone, deliberately). All converted layers share one
    :class:`Fp8State` (``gemm_accumulate``: see there). ValueError when the recipe has no FP8
    GEMMs, when the model is already converted, when nothing was converted (torchao returns the
    model unchanged) and when ``model`` is itself a linear layer (torchao returns a new module;
    fp8sim converts in place only).

    Deliberate differences from torchao's float8 layers besides those: the bias is added to the
    float32 GEMM result before its one rounding to the output dtype (as a cuBLASLt epilogue;
    torchao adds it after, in the output dtype), and scaling policies may be stateful (delayed,
    MS-AMP, AutoScale), so their state is in ``state_dict()`` and only training forwards observe.

    The step (:attr:`Fp8State.step`) advances at each forward of ``model`` in training mode with
    autograd enabled (a forward pre-hook on ``model``), unless the loop sets it.

    ``amax_reduction`` (see :class:`Fp8State`): ``"auto"`` (default, as Transformer Engine's amax
    reduction group) reduces every cast's amax with MAX across the default process group when
    ``torch.distributed`` runs more than one rank -- data-parallel ranks (DDP, FSDP2) then cast
    activations and gradients with the same scales and keep identical scaling states, and
    tensor-parallel shards are cast with the full tensor's scale; None keeps each rank's own; a
    process group or callable reduces over it.

    Distribution (docs/training.md): convert before ``fully_shard`` (FSDP2 manages the parameters
    of the modules it has wrapped: converting after it is refused); tensor parallelism
    (``parallelize_module``) may come before or after, since the converted layer is an
    ``nn.Linear`` that keeps the replaced layer's parameters and forward hooks (the styles'
    input and output placements).
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
        raise ValueError("convert_to_fp8: model is already converted (it holds FP8 layers)")
    if _fully_sharded(model):
        raise ValueError("convert_to_fp8: model is already sharded by FSDP2 (fully_shard); convert it first, then "
                         "fully_shard, as torchao and torchtitan do")
    if isinstance(model, nn.Linear) or is_hf_conv1d(model):
        raise ValueError("convert_to_fp8: model is itself a linear layer; wrap it (nn.Sequential(layer)) so it can "
                         "be replaced in place")
    targets, kept = _choose(model, linear_recipe, module_filter_fn, keep_output_layer)
    if not targets:
        found = sum(1 for _, m in model.named_modules() if is_linear(m) or is_hf_experts(m))
        why = (f"module_filter_fn (or, without one, the recipe's skip list {linear_recipe.skip}) and keep_output_layer "
               f"rejected all {found} nn.Linear / Conv1D / experts modules" if found
               else "the model has no nn.Linear, Conv1D or transformers experts module")
        raise ValueError(f"convert_to_fp8: nothing converted: {why}")
    state = Fp8State(linear_recipe, backend, count_events=count_events, gemm_accumulate=gemm_accumulate,
                     recipe_name=getattr(recipe, "name", None), amax_reduction=amax_reduction)
    state.first_layer = targets[0][0]
    for name, mod in targets:
        if is_hf_experts(mod):
            convert_experts(mod, name, state)  # in place: its class becomes the FP8 one
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _keep_forward_hooks(mod, Fp8Linear(mod, name, state)))
    state.summary = summarize(model, kept)
    warn_not_converted(state.summary)
    state._root_hook = model.register_forward_pre_hook(_advance_step_hook(state))
    if isinstance(recipe, Recipe):
        apply_autocast(model, recipe.autocast)
    return model


def _choose(model: nn.Module, recipe: LinearRecipe, module_filter_fn: ModuleFilter | None,
            keep_output_layer: bool) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """The (name, module) pairs to convert, and the qualified names of the GEMM modules kept in
    high precision with their reason."""
    outputs = output_layers(model) if keep_output_layer else set()
    found_routers = routers(model)
    kept = {name: ROUTER for name, mod in found_routers.items() if not is_linear(mod)}
    if module_filter_fn is None:
        last = _last_blocks(model, recipe.keep_last_blocks)

        def why_kept(mod: nn.Module, fqn: str) -> str | None:
            if any(fqn.endswith(s) for s in recipe.skip):
                return SKIP
            if _block_number(fqn) in last:
                return LAST_BLOCKS
            return ROUTER if fqn in found_routers else None
    else:
        def why_kept(mod: nn.Module, fqn: str) -> str | None:
            return None if module_filter_fn(mod, fqn) else FILTER

    targets = []
    for name, mod in model.named_modules():
        if not name or not (is_linear(mod) or is_hf_experts(mod)):
            continue
        reason = OUTPUT_LAYER if id(mod) in outputs else why_kept(mod, name)
        if reason is None:
            targets.append((name, mod))
        else:
            kept[name] = reason
    return targets, kept


def apply_autocast(model: nn.Module, autocast: Autocast | None) -> None:
    """Run every forward of ``model`` under ``torch.autocast`` to the recipe's ``autocast`` dtype
    (on the device type of its first parameter, looked up at each call): a forward pre-hook
    enters it, a forward hook that also runs when the forward raises leaves it. None: nothing."""
    if autocast is None:
        return
    dtype = {Autocast.BF16: torch.bfloat16}[Autocast(autocast)]
    active: list[Any] = []

    @torch.compiler.disable
    def enter(module: nn.Module, args) -> None:
        device = next(module.parameters()).device.type
        ctx = torch.autocast(device, dtype=dtype)
        ctx.__enter__()
        active.append(ctx)

    @torch.compiler.disable
    def leave(module: nn.Module, args, output) -> None:
        active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def _fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``model`` or one of its modules."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _keep_forward_hooks(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` with ``old``'s forward hooks and pre-hooks (tensor parallelism's input and output
    placements, when ``parallelize_module`` ran before the conversion); returns ``new``."""
    for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):  # fmt: skip
        getattr(new, attr).update(getattr(old, attr))
    return new


def _block_number(fqn: str) -> int | None:
    """The block a module belongs to: the first integer component of its qualified name."""
    return next((int(p) for p in fqn.split(".") if p.isdigit()), None)


def _last_blocks(model: nn.Module, n: int) -> set[int]:
    """The ``n`` largest block numbers among the model's linear and experts layers
    (:class:`LinearRecipe`'s ``keep_last_blocks``); empty for ``n = 0``."""
    if n == 0:
        return set()
    found = {_block_number(name) for name, m in model.named_modules() if is_linear(m) or is_hf_experts(m)}
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


def fp8_experts(model: nn.Module) -> list[nn.Module]:
    """The FP8 experts modules of ``model`` in module order (:mod:`fp8sim.training.experts`)."""
    return [m for m in model.modules() if is_fp8_experts(m)]


def get_fp8_state(model: nn.Module) -> Fp8State | None:
    """The shared :class:`Fp8State` of a converted model, or None."""
    layer = next((m for m in model.modules() if isinstance(m, Fp8Linear) or is_fp8_experts(m)), None)
    return None if layer is None else layer.state
