"""FP8-LM (MS-AMP's O1/O2/O3) for your own model: one call applies every level of the recipe.

::

    from fp8sim.training import fp8lm

    run = fp8lm.prepare(model, "fp8lm-o2", lr=3e-4, weight_decay=0.1)   # one process
    for x, y in loader:
        run.optimizer.zero_grad()
        loss_fn(run.model(x), y).backward()
        run.optimizer.step(max_norm=1.0)        # FP8 gradients -> FP8-LM Adam (clipping inside)

With ``process_group=`` (``torch.distributed`` initialised, one rank per process) wrap the model
in DDP and register the hook: ``ddp = DistributedDataParallel(run.model);
ddp.register_comm_hook(None, run.comm_hook)``.

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
* weight storage (``weight_storage="fp8"``, O3): :class:`~fp8sim.training.zero.ZeroFp8Weights`
  -- E4M3 weights sharded ZeRO-style; after each step every rank's weights are the gathered E4M3
  values (the initial weights too, right after ``prepare``).

Gradient clipping: ``step(max_norm=c)`` scales the gradients through the optimizer's
``grad_scale`` (the FP8 gradients are never rewritten), as ``train_distributed`` does.
The FP8 state -- the layers' scaling policies, the step and the gradient reducer's AutoScale --
travels in ``run.model.state_dict()``; the optimizer's in ``run.optimizer.state_dict()``.
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
        optimizer: the inner optimizer (``Fp8AdamW``, ``torch.optim.AdamW``, or the ZeRO
            shard's ``Fp8AdamW``); ``param_groups`` is its (set ``lr`` there).
        reducer: the :class:`Fp8GradReducer` (FP8 gradients, AutoScale, byte counts).
        zero: the :class:`ZeroFp8Weights` of O3, else None.
        counter: bytes sent per category (``counter.pop()``).
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], reducer: Fp8GradReducer, optimizer: Any,
                 zero: Any, *, world: int, group: Any, fp8_comm: bool, counter: CommCounter) -> None:
        self.named = named
        self.params = [p for _, p in named]
        self.reducer, self.optimizer, self.zero = reducer, optimizer, zero
        self.world, self.group, self.counter = world, group, counter
        self._reduce_inline = world == 1 and fp8_comm

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
        if self.reducer.owners is None:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]))
        else:  # ZeRO: each rank adds the squares of the gradients it owns (FP8 ones exist only there)
            import torch.distributed as dist

            rank = dist.get_rank(self.group)
            mine = [p.grad for n, p in self.named if p.grad is not None and self.reducer.owners[n] == rank]
            norm = float(torch.nn.utils.get_total_norm(mine)) if mine else 0.0
            sq = torch.tensor([norm * norm], dtype=torch.float64)
            dist.all_reduce(sq, group=self.group)
            self.counter.add("scales", "all_reduce", 8)
            norm = float(sq.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        for p in self.params:
            p.grad = None
        (self.zero or self.optimizer).step(grad_scale=coef)
        return norm

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`; under O3 the weights are gathered again from the restored
        masters (as after the step that saved it)."""
        self.optimizer.load_state_dict(state_dict)
        if self.zero is not None:
            self.zero.gather()
            self.counter.pop()


@dataclass
class Fp8LMTraining:
    """What :func:`prepare` returns: the converted ``model``, the ``optimizer``, the DDP
    ``comm_hook`` (None for one process) and the ``recipe``."""

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
) -> Fp8LMTraining:
    """Apply every level of ``recipe`` to ``model`` (in place) and build its optimizer.

    ``process_group``: None trains in one process (no collectives; the FP8 gradient
    quantization still runs); a ``torch.distributed`` group (``dist.group.WORLD`` for the default
    one) trains data-parallel over it. ``lr``, ``betas``, ``eps``, ``weight_decay``: the Adam
    hyper-parameters (torch's defaults). ``module_filter_fn``: as :func:`convert_to_fp8`.
    ``grad_scaling`` (``autoscale`` | ``msamp``) and ``fp8_grads`` (``all`` | ``linear``) override the
    recipe's ``extra``. ``params``: the ``(name, parameter)`` pairs to train (default: all of
    ``model.named_parameters()``, float32). Any FP8 recipe is accepted (``te-delayed`` gives
    float32 AdamW and no FP8 communication); the model must not be converted yet.
    """
    from fp8sim.training.optim import Fp8AdamW
    from fp8sim.training.zero import ZeroFp8Weights

    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if not isinstance(r, Recipe) or not r.is_fp8:
        raise ValueError(f"fp8lm.prepare: recipe {getattr(r, 'name', r)!r} has no FP8 linear layers")
    if process_group is None:
        rank, world = 0, 1
    else:
        import torch.distributed as dist

        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    convert_to_fp8(model, r.linear, backend, module_filter_fn=module_filter_fn, gemm_accumulate=gemm_accumulate)
    apply_autocast(model, r.autocast)
    state = get_fp8_state(model)
    named = list(params) if params is not None else list(model.named_parameters())
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
    reducer = Fp8GradReducer(named, grad_fp8_names, world=world, group=process_group, scaling=scaling,
                             other_dtype=other, backend=backend, counter=counter)
    state.extra_states[REDUCER_STATE_KEY] = reducer  # AutoScale travels in model.state_dict()
    hp = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    ps = [p for _, p in named]
    zero = None
    if r.optimizer == "adamw":
        inner: Any = torch.optim.AdamW(ps, **hp, foreach=False)
    elif r.weight_storage == "fp8":
        zero = ZeroFp8Weights(named, fp8_names, rank=rank, world=world, group=process_group,
                              count_bytes=counter.add,
                              optimizer_kwargs={**hp, "backend": backend, "grad_source": reducer.grad_for})
        inner = zero.optimizer
        if world > 1:  # each FP8 gradient is reduced onto its owner only
            reducer.owners = {n: o for (n, _), o in zip(zero.params, zero.owner)}
    else:
        inner = Fp8AdamW(ps, **hp, backend=backend, grad_source=reducer.grad_for)
    counter.pop()  # the initial weight gather is set-up, not a training step
    opt = Fp8LMOptimizer(named, reducer, inner, zero, world=world, group=process_group, fp8_comm=fp8_comm,
                         counter=counter)
    return Fp8LMTraining(model, opt, reducer.hook if world > 1 else None, r)
