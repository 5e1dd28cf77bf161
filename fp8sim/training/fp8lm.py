"""FP8-LM (MS-AMP's O1/O2/O3) for your own model: one call applies every level of the recipe.

::

    from fp8sim.training import fp8lm

    run = fp8lm.prepare(model, "fp8lm-o2", lr=3e-4, weight_decay=0.1)   # one process
    for x, y in loader:
        run.optimizer.zero_grad()
        loss_fn(run.model(x), y).backward()
        run.optimizer.step(max_norm=1.0)        # FP8 gradients -> FP8-LM Adam (clipping inside)

With ``process_group=`` (``torch.distributed`` initialised, one rank per process, e.g. under
``torchrun``): for O1/O2 wrap the model in DDP and register the hook, ``ddp =
DistributedDataParallel(run.model); ddp.register_comm_hook(None, run.comm_hook)``; for O3
``prepare`` has already sharded the model with FSDP2 (``run.comm_hook`` is None) -- train
``run.model`` as it is.

The levels, built from the same blocks as :func:`fp8sim.training.distributed.train_distributed`:

* linear layers: :func:`~fp8sim.training.convert.convert_to_fp8` with the recipe's linear
  level (power-of-two MS-AMP scaling; E4M3 weight gradients);
* gradient communication (``grad_comm="fp8"``): :class:`~fp8sim.training.fp8_allreduce.Fp8GradReducer`
  -- E4M3 with AutoScale for the gradients the recipe's ``fp8_grads`` names (``all``: every
  parameter's), bfloat16 for the rest; with one process the same quantization runs inline in
  :meth:`Fp8LMOptimizer.step` (no collectives), as ``train_distributed`` does for one rank;
* optimizer (``optimizer="fp8-adamw"``): :class:`~fp8sim.training.optim.Fp8AdamW` (E4M3 first
  moment, FP16 second moment and FP16 scaled master weights) reading the reduced FP8 gradients;
  ``"adamw"`` (O1): ``torch.optim.AdamW`` on the reduced gradients;
* weight storage (``weight_storage="fp8"``, O3): FSDP2 (:func:`~fp8sim.training.fsdp_fp8.fully_shard_fp8lm`)
  shards the parameters, the FP16 masters and the Adam states; the FP8 linears' weights are
  all-gathered as E4M3 codes with one power-of-two scale per tensor and the gradients
  reduce-scattered in E4M3 (FP8-LM's shared scale and AutoScale). With one process there is
  nothing to gather: after each step (and right after ``prepare``) those weights are set to
  their E4M3 cast with the same scale rule, the values every rank's forward sees under FSDP2.

Gradient clipping: ``step(max_norm=c)`` scales the gradients through the optimizer's
``grad_scale`` (the FP8 gradients are never rewritten), as ``train_distributed`` does.
The FP8 state -- the layers' scaling policies, the step and the gradient reducer's AutoScale --
travels in ``run.model.state_dict()``; the optimizer's in ``run.optimizer.state_dict()`` (under
FSDP2 save both with ``torch.distributed.checkpoint``, see docs/training.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from fp8sim.training.fp8_allreduce import CommCounter, Fp8GradReducer
from fp8sim.training.convert import ModuleFilter, apply_autocast, convert_to_fp8, fp8_linears, get_fp8_state
from fp8sim.recipes import Recipe, get_recipe

__all__ = ["Fp8LMTraining", "Fp8LMOptimizer", "prepare"]

#: the key of the gradient reducer's state in the FP8 layers' extra state
REDUCER_STATE_KEY = "fp8lm_grad_reducer"


class Fp8LMOptimizer:
    """The optimizer and gradient levels of an FP8-LM recipe behind ``zero_grad`` / ``step``.

    Attributes:
        optimizer: the inner optimizer (``Fp8AdamW`` -- over FSDP2's shards under O3 -- or
            ``torch.optim.AdamW``); ``param_groups`` is its (set ``lr`` there).
        reducer: the :class:`Fp8GradReducer` (FP8 gradients, AutoScale, byte counts).
        counter: bytes sent per category (``counter.pop()``).
        fp8_weights: O3 in one process: the ``(name, parameter)`` pairs stored as their E4M3
            cast after each step (empty otherwise).
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], reducer: Fp8GradReducer, optimizer: Any, *,
                 world: int, fp8_comm: bool, counter: CommCounter,
                 fp8_weights: list[tuple[str, nn.Parameter]] | None = None) -> None:
        self.named = named
        self.params = [p for _, p in named]
        self.reducer, self.optimizer = reducer, optimizer
        self.world, self.counter = world, counter
        self._reduce_inline = world == 1 and fp8_comm
        self.fp8_weights = list(fp8_weights or [])
        if self.fp8_weights:
            self.store_fp8_weights()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (``p.grad`` and the reducer's stored FP8 gradients)."""
        for p in self.params:
            p.grad = None
        self.reducer.stash.clear()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, max_norm: float | None = None) -> float:
        """Reduce the gradients (one process: inline), clip to ``max_norm`` (None: no clipping)
        and update; returns the gradient norm before clipping (of the reduced gradients)."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        max_norm = math.inf if max_norm is None else float(max_norm)
        if self._reduce_inline:  # one rank: the FP8 quantization of the all-reduce, no collectives
            items = [(p, p.grad) for p in self.params if p.grad is not None]
            for (p, _), g in zip(items, self.reducer.reduce(items)):
                p.grad = g
        if isinstance(self.optimizer, torch.optim.AdamW):  # O1: float32 AdamW on the FP8 gradients
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            self.optimizer.step()
            return norm
        # FP8-LM Adam: clipping goes into the gradients' scale_inv; the gradients live in the stash
        norm = grad_norm([p.grad for p in self.params if p.grad is not None])
        coef = min(1.0, max_norm / (norm + 1e-6))
        for p in self.params:
            p.grad = None
        self.optimizer.step(grad_scale=coef)
        if self.fp8_weights:
            self.store_fp8_weights()
        return norm

    @torch.no_grad()
    def store_fp8_weights(self) -> None:
        """O3 in one process: each FP8 weight becomes its E4M3 cast (MS-AMP's power-of-two scale
        of its amax), what FSDP2's E4M3 all-gather hands every rank's forward."""
        from fp8sim.training.fsdp_fp8 import weight_quantizer

        q = weight_quantizer(self.reducer.backend)
        for name, p in self.fp8_weights:
            w = p.detach().reshape(p.shape[0], -1)
            c = q.quantize(name, w, observe=False)
            p.copy_(self.reducer.backend.dequantize(c.codes, c.fmt, c.scale_inv).view(p.shape))

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` (the model's own weights are restored by the model's)."""
        self.optimizer.load_state_dict(state_dict)


def grad_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm of all ``grads`` together; sharded (DTensor) gradients count once over their
    ranks (torch's ``get_total_norm``, reduced to the full norm)."""
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


@dataclass
class Fp8LMTraining:
    """What :func:`prepare` returns: the converted ``model`` (sharded by FSDP2 under O3 with a
    process group), the ``optimizer``, the DDP ``comm_hook`` (None for one process and for O3)
    and the ``recipe``."""

    model: nn.Module
    optimizer: Fp8LMOptimizer
    comm_hook: Callable | None
    recipe: Recipe


def prepare(
    model: nn.Module,
    recipe: str | Recipe = "fp8lm-o2",
    *,
    process_group: Any = None,
    backend: str | Any = "emulator",
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    module_filter_fn: ModuleFilter | None = None,
    gemm_accumulate: str | None = "float32",
    grad_scaling: str | None = None,
    fp8_grads: str | None = None,
    params: Iterable[tuple[str, nn.Parameter]] | None = None,
    amax_reduction: Any = "auto",
    fsdp_units: Iterable[nn.Module] | None = None,
) -> Fp8LMTraining:
    """Apply every level of ``recipe`` to ``model`` (in place) and build its optimizer.

    ``process_group``: None trains in one process (no collectives; the FP8 gradient
    quantization still runs); a ``torch.distributed`` group (``dist.group.WORLD`` for the default
    one) trains data-parallel over it -- DDP with :attr:`Fp8LMTraining.comm_hook` for O1/O2, FSDP2
    (sharded here, ``fsdp_units`` as :func:`~fp8sim.training.fsdp_fp8.fully_shard_fp8lm`'s
    ``units``) for O3. ``lr``, ``betas``, ``eps``, ``weight_decay``: the Adam
    hyper-parameters (torch's defaults). ``module_filter_fn``: as :func:`convert_to_fp8`;
    ``amax_reduction``: as there, except that ``"auto"`` (default) means MAX over
    ``process_group`` (none for one process, even inside a larger process group). ``grad_scaling`` (``autoscale`` | ``msamp``) and ``fp8_grads``
    (``all`` | ``linear``) override the recipe's. ``params``: the ``(name, parameter)`` pairs to
    train (default: all of ``model.named_parameters()``, float32; under O3 with a process group
    every parameter). Any FP8 recipe is accepted (``te-delayed`` gives float32 AdamW and no FP8
    communication); the model must not be converted yet.
    """
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if not isinstance(r, Recipe) or not r.is_fp8:
        raise ValueError(f"fp8lm.prepare: recipe {getattr(r, 'name', r)!r} has no FP8 linear layers")
    world = 1
    if process_group is not None:
        import torch.distributed as dist

        world = dist.get_world_size(process_group)
    if isinstance(amax_reduction, str) and amax_reduction == "auto":  # over the training's ranks
        amax_reduction = process_group if world > 1 else None
    convert_to_fp8(model, r.linear, backend, module_filter_fn=module_filter_fn, gemm_accumulate=gemm_accumulate,
                   amax_reduction=amax_reduction)
    apply_autocast(model, r.autocast)
    state = get_fp8_state(model)
    named = list(params) if params is not None else list(model.named_parameters())
    opt, hook = build_levels(model, r, named, world=world, group=process_group, backend=backend,
                             hp={"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
                             grad_scaling=grad_scaling, fp8_grads=fp8_grads, fsdp_units=fsdp_units)
    state.extra_states[REDUCER_STATE_KEY] = opt.reducer  # AutoScale travels in model.state_dict()
    return Fp8LMTraining(model, opt, hook, r)


def build_levels(model: nn.Module, r: Recipe, named: list[tuple[str, nn.Parameter]], *, world: int, group: Any,
                 backend: str | Any, hp: dict, grad_scaling: str | None = None, fp8_grads: str | None = None,
                 fsdp_units: Iterable[nn.Module] | None = None) -> tuple[Fp8LMOptimizer, Callable | None]:
    """The levels of ``r`` beyond the linear layers on a converted ``model``: the gradient
    reducer, the optimizer and -- O3 with ``world > 1`` -- FSDP2 sharding with FP8 all-gather
    and reduce-scatter. Returns the optimizer and the DDP comm hook (None for one process and
    for O3). What :func:`prepare` and the distributed trainer share."""
    from fp8sim.training.optim import Fp8AdamW

    bad = [n for n, p in named if p.dtype != torch.float32]
    if bad and r.optimizer == "fp8-adamw":
        raise ValueError(f"fp8lm.prepare: FP8-LM's Adam keeps its own FP16 masters and needs float32 parameters; "
                         f"{bad[0]} is {dict(named)[bad[0]].dtype} (prepare before model.to(dtype))")
    fp8_comm = r.grad_comm == "fp8"
    scope = fp8_grads or r.fp8_grads.value
    scaling = grad_scaling or r.grad_scaling.value
    fp8_names = {f"{m.name}.weight" for m in fp8_linears(model)} if fp8_comm else set()
    grad_fp8_names = {n for n, _ in named} if fp8_comm and scope == "all" else fp8_names
    other = torch.bfloat16 if (fp8_comm or r.grad_comm == "bf16" or r.autocast == "bfloat16") else torch.float32
    counter = CommCounter(world)
    reducer = Fp8GradReducer(named, grad_fp8_names, world=world, group=group, scaling=scaling,
                             other_dtype=other, backend=backend, counter=counter)
    sharded = r.weight_storage == "fp8" and world > 1
    if sharded:
        from fp8sim.training.fsdp_fp8 import fully_shard_fp8lm

        fully_shard_fp8lm(model, reducer, mesh=_mesh_of(group, model), units=fsdp_units,
                          fp8_weight_names=fp8_names, backend=reducer.backend)
        named = list(model.named_parameters())  # FSDP2's sharded parameters
        reducer.names = {id(p): n for n, p in named}
    ps = [p for _, p in named]
    if r.optimizer == "adamw":
        inner: Any = torch.optim.AdamW(ps, **hp, foreach=False)
    else:
        inner = Fp8AdamW(ps, **hp, backend=backend, grad_source=reducer.grad_for)
    stored = [(n, p) for n, p in named if n in fp8_names] if r.weight_storage == "fp8" and not sharded else None
    opt = Fp8LMOptimizer(named, reducer, inner, world=world, fp8_comm=fp8_comm, counter=counter, fp8_weights=stored)
    counter.pop()  # set-up, not a training step
    return opt, (reducer.hook if world > 1 and not sharded else None)


def _mesh_of(group: Any, model: nn.Module) -> Any:
    """A 1-D device mesh over ``group`` on the model's device type."""
    from torch.distributed.device_mesh import DeviceMesh

    device = next(model.parameters()).device.type
    return DeviceMesh.from_group(group, device)
