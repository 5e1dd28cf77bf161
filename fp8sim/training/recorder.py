"""Record a training run's FP8 tensors as a trace (:mod:`fp8sim.trace`).

Two sources, one trace format:

* an FP8 model (after :func:`fp8sim.training.convert_to_fp8`): every cast the FP8 linears make --
  input activations, weights, output gradients (and weight gradients where the recipe casts
  them) -- with the scale the policy actually used; plus every FP8 linear's weight gradient after
  accumulation, recorded against the output-gradient format and the recorder's own policy: a
  *what-if* cast where the recipe keeps weight gradients in high precision (flagged ``what_if``
  in the trace's catalogue, as every cast the recipe does not perform);
* any other PyTorch model: forward/backward hooks on its ``nn.Linear`` modules (subclasses too)
  and Hugging Face ``Conv1D`` modules (GPT-2's projections; their weight, stored transposed, is
  recorded as ``(out, in)`` like a linear's) capture the same roles, and the recorder runs a
  recipe's policies (default ``te-delayed``) to give the scale each tensor *would* have been
  cast with.

Per step and tensor the trace keeps amax, scale, overflow/underflow counts and the |x| histogram
(computed by :meth:`fp8sim.trace.TraceWriter.record`); with ``save_every=K`` also the full tensors
at steps 1, K+1, 2K+1, ...

Steps: a trainer calls :meth:`Recorder.begin_step` / :meth:`Recorder.end_step`. In a user's own
loop without those calls, every forward of the root module with autograd enabled in training mode
starts a new step (1, 2, ...). Forwards without autograd or in eval mode, and their backward, are
not recorded; a forward that activation checkpointing recomputes is recorded once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fp8sim.trace import TraceReader, TraceWriter
from fp8sim.training.convert import fp8_linears, get_fp8_state
from fp8sim.training.fp8_linear import is_hf_conv1d
from fp8sim.training.fp8_state import Fp8Operand
from fp8sim.recipes import CastConfig, get_recipe

__all__ = ["Recorder", "record"]


class Recorder:
    """Writes one trace for one model; see the module docstring. Use :func:`record` to make one."""

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        *,
        recipe: str = "te-delayed",
        save_every: int = 0,
        chunk_steps: int = 50,
        config: dict | None = None,
        append: bool = False,
    ) -> None:
        if save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {save_every}")
        self.model = model
        self.path = Path(path)
        self.save_every = save_every
        self.state = get_fp8_state(model)
        if self.state is not None:
            casts = dict(self.state.casts)
            recipe_name = getattr(self.state.recipe, "name", None) or "fp8-model"
        else:
            linear = get_recipe(recipe).linear
            if linear is None:
                raise ValueError(f"record: recipe {recipe!r} casts nothing; pick an FP8 recipe for the hypothetical casts")
            casts = linear.casts()
            recipe_name = recipe
        # the casts the recipe performs (live, or under its policies on a plain model); the
        # others are what-if casts, flagged so in the trace's catalogue
        self.performed = frozenset(casts)
        # the weight gradient is not cast by TE recipes: record it against the gradient format
        if "weight_grad" not in casts:
            casts["weight_grad"] = CastConfig(casts["grad_output"].fmt, casts["grad_output"].scaling)
        self.casts = casts
        from fp8sim.quantizer import Quantizer

        # quantizers for the tensors the model does not cast itself (their scales are what-ifs)
        own_roles = [r for r in casts if self.state is None or r not in self.state.casts]
        self.quantizers = {r: Quantizer(casts[r]) for r in own_roles}
        meta = {
            "source": "fp8sim.training.recorder",
            "live_casts": self.state is not None,
            "casts": {r: {"format": c.fmt.name, "policy": c.policy, "granularity": c.granularity.spec,
                          "rounding": c.rounding.value} for r, c in casts.items()},
            "hypothetical_recipe": None if self.state is not None else recipe_name,
        }
        meta.update(config or {})
        if append:
            _check_same_run(self.path, meta)
        self.writer = TraceWriter(self.path, meta, mode="a" if append else "w", chunk_steps=chunk_steps)
        self.step = 0
        self._explicit = False
        # whether the root's last forward was a training forward with autograd: only those (and
        # their backward) are recorded; an eval-mode or no-grad forward records nothing
        self._training_forward = False
        # tensors already in an appended trace are declared; new ones are declared on first sight
        self._declared: set[str] = {t.name for t in TraceReader(self.path).tensors} if append else set()
        self._handles: list[Any] = []
        self._install()

    # -- hooks ------------------------------------------------------------------------------
    def _install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_forward))
        if self.state is not None:
            self.state.taps.append(self._on_cast)
            layers = [(m.name, m) for m in fp8_linears(self.model)]
        else:
            layers = [(n, m) for n, m in self.model.named_modules()
                      if isinstance(m, nn.Linear) or is_hf_conv1d(m)]  # fmt: skip
            for name, mod in layers:
                self._handles.append(mod.register_forward_pre_hook(self._make_forward_hook(name)))
                self._handles.append(mod.register_forward_hook(self._make_output_hook(name)))
        if self.state is None or "weight_grad" not in self.state.casts:
            seen: set[int] = set()
            for name, mod in layers:
                if id(mod.weight) in seen:  # a tied weight is recorded once
                    continue
                seen.add(id(mod.weight))
                self._handles.append(mod.weight.register_post_accumulate_grad_hook(
                    self._make_wgrad_hook(name, self.state is None and is_hf_conv1d(mod))))

    @torch.compiler.disable  # a Python step counter: traced, it would be a guard (a recompile a step)
    def _root_pre_forward(self, module, args) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # activation checkpointing recomputing a forward inside backward
        self._training_forward = torch.is_grad_enabled() and module.training
        if not self._explicit and self._training_forward:
            self.step += 1

    def _make_forward_hook(self, name: str):
        def hook(module: nn.Linear, args) -> None:
            if not (self._training_forward and torch.is_grad_enabled() and module.training) or self.step < 1:
                return
            if torch._C._current_graph_task_id() != -1:
                return  # a checkpointed forward recomputed in backward: recorded the first time
            x = args[0].detach()
            self._record_hypothetical(f"{name}.input", "activation", x.reshape(-1, x.shape[-1]))
            w = module.weight.detach()
            # HF Conv1D stores W^T (in, out): recorded as W (out, in), as nn.Linear's and as the
            # FP8 model casts it
            self._record_hypothetical(f"{name}.weight", "weight", w.t() if is_hf_conv1d(module) else w)

        return hook

    def _make_output_hook(self, name: str):
        # the output gradient, through a hook on the output tensor (a module backward hook
        # would warn when the layer's input needs no gradient)
        def on_grad(g: torch.Tensor) -> None:
            if self._handles and self.step >= 1:  # not after close()
                self._record_hypothetical(f"{name}.grad_output", "grad_output", g.detach().reshape(-1, g.shape[-1]))

        def hook(module: nn.Linear, args, output) -> None:
            # a checkpointed forward is recomputed in backward: that output's gradient is the one
            # computed (the first forward's output is not part of the graph backward runs)
            if (self._training_forward and torch.is_grad_enabled() and module.training and self.step >= 1
                    and output.requires_grad):
                output.register_hook(on_grad)

        return hook

    def _make_wgrad_hook(self, name: str, transposed: bool = False):
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None and self.step >= 1 and self._training_forward:
                g = param.grad.detach()  # a Conv1D's (in, out) gradient is recorded as (out, in)
                self._record_hypothetical(f"{name}.weight_grad", "weight_grad", g.t() if transposed else g)

        return hook

    # -- recording --------------------------------------------------------------------------
    def _declare(self, name: str, role: str, fmt: str, shape) -> None:
        # declared once, with the first shape seen (a user's last batch may be smaller)
        if name not in self._declared:
            self.writer.add_tensor(name, role, fmt, tuple(shape), what_if=role not in self.performed)
            self._declared.add(name)

    def _save_due(self) -> bool:
        return self.save_every > 0 and (self.step - 1) % self.save_every == 0

    def _record_hypothetical(self, name: str, role: str, x: torch.Tensor) -> None:
        """A tensor the model does not cast: the recorder's policy gives the scale it would get."""
        q = self.quantizers[role]
        amax = float(x.float().abs().amax()) if x.numel() else 0.0
        scale = q.scale_for(name, amax)
        q.observe(name, amax)
        self._write(name, role, x, q.fmt, scale, amax)

    def _on_cast(self, name: str, role: str, x: torch.Tensor, cast: CastConfig, scale, op: Fp8Operand) -> None:
        """Tap of an FP8 model: the live cast, with the scale it used (the model calls it only
        for observed casts: training forwards with autograd, each once)."""
        if self.step < 1:
            return
        amax = float(x.float().abs().amax()) if x.numel() else 0.0
        if op.granularity.kind == "tensor":
            self._write(name, role, x, op.fmt, float(scale), amax)
        else:  # MX: block scales; the record keeps scale 1 and the measured counts
            mag = op.codes & (op.fmt.sign_mask - 1)
            under = int(((mag == 0) & (x != 0)).sum())
            self._write(name, role, x, op.fmt, 1.0, amax, overflow=0, underflow=under)

    def _write(self, name, role, x, fmt, scale, amax, **counts) -> None:
        self._declare(name, role, fmt.name, x.shape)
        self.writer.record(self.step, name, x, scale=scale, amax=amax, fmt=fmt, **counts)
        if self._save_due():
            self.writer.save_tensor(self.step, name, x)

    # -- steps and lifetime -----------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start recording training step ``step`` (1-based, increasing)."""
        self._explicit = True
        self.step = int(step)

    def end_step(self, step: int) -> None:
        """The step's backward is done (weight gradients are recorded by then)."""

    def state_dict(self) -> dict:
        """The recorder's own policies (hypothetical casts), for checkpoints."""
        return {"step": self.step, "policies": {r: q.state_dict() for r, q in self.quantizers.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        for role, sd in d["policies"].items():
            if role in self.quantizers:
                self.quantizers[role].load_state_dict(sd)

    def flush(self) -> None:
        self.writer.flush()

    def discard_after(self, step: int) -> None:
        """Forget the unwritten records of steps after ``step`` (a step an interruption cut
        short: the trace keeps only whole steps)."""
        self.writer.discard_after(step)

    def truncate_after(self, step: int) -> None:
        """Drop what the trace holds of steps after ``step`` (resuming from that checkpoint)."""
        self.writer.truncate_after(step)

    def close(self) -> None:
        """Remove every hook and tap, flush and close the trace."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.state is not None and self._on_cast in self.state.taps:
            self.state.taps.remove(self._on_cast)
        self.writer.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_same_run(path: Path, meta: dict) -> None:
    """Refuse to append to (and so cut back) a trace that another run recorded: the run config,
    run directory (as a real path), rank and world stored in its trace.json must be this run's
    where both say."""
    import json

    from fp8sim.input_files import read_json
    from fp8sim.trace import layout

    try:
        old = read_json(path / "trace.json", layout.MAX_TRACE_JSON_BYTES, what="trace.json").get("config", {})
    except (OSError, ValueError, AttributeError):
        return  # no trace yet (or not ours to judge: the writer refuses a damaged one)
    same = {
        "run": lambda a, b: a == json.loads(json.dumps(b)),
        "run_dir": lambda a, b: os.path.realpath(str(a)) == os.path.realpath(str(b)),
        "rank": lambda a, b: a == b,
        "world": lambda a, b: a == b,
    }
    for key, eq in same.items():
        if isinstance(old, dict) and key in old and key in meta and not eq(old[key], meta[key]):
            raise ValueError(f"--record {path}: holds the trace of another run (its {key} differs: "
                             f"{str(old[key])[:80]}); a resumed run appends only to its own trace")  # fmt: skip


def record(model: nn.Module, path: str | os.PathLike, **kwargs) -> Recorder:
    """Record ``model``'s FP8 tensors (or, for a plain model, its ``nn.Linear`` and HF ``Conv1D``
    layers' tensors under the ``recipe`` keyword's policies, default ``te-delayed``) into the
    trace directory ``path``.

    Works with any PyTorch training loop::

        with fp8sim.training.record(model, "trace/") :
            for x, y in loader:
                loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()

    Keyword arguments: ``recipe``, ``save_every`` (full tensors every K steps, 0: never),
    ``chunk_steps``, ``config`` (extra JSON-able run config), ``append`` (continue a trace).
    """
    return Recorder(model, path, **kwargs)
