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

Per recorded step and tensor the trace keeps amax, scale, overflow/underflow counts and the |x|
histogram. They are computed where the tensor lives (:mod:`fp8sim.trace.statistics`: numba for a
host tensor, torch ops on an accelerator, where a small int64 result per tensor stays until the
step is complete and one non-blocking copy brings the step's results over); a background thread
writes whole steps (:mod:`fp8sim.trace.background`), so the loop never waits on the disk.

Sampling and selection: ``every=N`` records steps 1, N+1, 2N+1, ... (Transformer Engine debug's
``freq``); ``save_every=K`` saves the full tensors at steps 1, K+1, ... (a step whose tensors are
saved is recorded too); ``roles`` and ``layers`` pick what is recorded (a layer not picked gets
no hook). Between recorded steps a hypothetical policy that keeps a history (``delayed``,
``msamp``, ...) still observes each tensor's amax -- one amax pass per tensor -- so its scales at
a recorded step are those of the full run; ``observe_every_step=False`` makes the steps between
free, the history then holding the recorded steps only.

Steps: a trainer calls :meth:`Recorder.begin_step` / :meth:`Recorder.end_step`. In a user's own
loop without those calls, every forward of the root module with autograd enabled in training mode
starts a new step (1, 2, ...). Forwards without autograd or in eval mode, and their backward, are
not recorded; a forward that activation checkpointing recomputes is recorded once.

Where the distributed hooks go (not done here): a sharded tensor's statistics are reduced over
its process group in :meth:`Recorder._statistics`, before they leave the device --
:func:`~fp8sim.trace.statistics.device_statistics`' histogram and counts by SUM, its amax (the
float64 bits in the last field: reduce the float) by MAX.

MoE experts (:mod:`fp8sim.training.experts`) are recorded per expert, each expert of each
projection as a linear layer of its own: ``{experts}.{projection}.{e}`` with its ``input``,
``weight``, ``grad_output`` and ``weight_grad`` (``layers`` patterns match these names). The
tokens routed to an expert at a step are the rows of its input record (``numel / in``). An
expert no token reached casts nothing: at each recorded step it gets an empty record (0
elements) per role, which the analyses and replays skip -- an idle step is no underflow, and
no policy observes it, as none did in training.
"""

from __future__ import annotations

import atexit
import os
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn

from fp8sim.errors import ArgumentError
from fp8sim.trace import TraceReader, TraceWriter
from fp8sim.trace.background import BackgroundWriter
from fp8sim.trace.statistics import device_statistics, histogram_and_counts
from fp8sim.training.convert import fp8_experts, fp8_linears, get_fp8_state
from fp8sim.training.experts import is_fp8_experts
from fp8sim.training.fp8_linear import is_hf_conv1d
from fp8sim.recipes import CastConfig, get_recipe
from fp8sim.training.record_batch import StepBatch, seen_amax
from fp8sim.training.record_options import (
    RECORDED_ROLES,
    LayerFilter,
    check_interval,
    check_roles,
    check_same_run,
    select_layers,
)

__all__ = ["Recorder", "record", "RECORDED_ROLES"]

class Recorder:
    """Writes one trace for one model; see the module docstring. Use :func:`record` to make one."""

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        *,
        recipe: str = "te-delayed",
        every: int = 1,
        save_every: int = 0,
        roles: str | Iterable[str] | None = None,
        layers: LayerFilter | None = None,
        observe_every_step: bool = True,
        block_stats: str | None = None,
        chunk_steps: int = 50,
        config: dict | None = None,
        append: bool = False,
    ) -> None:
        if not isinstance(observe_every_step, bool):
            raise ArgumentError.about("observe_every_step", f" must be True or False, got {observe_every_step!r}")
        self.observe_every_step = observe_every_step
        if block_stats not in (None, "mx"):
            raise ArgumentError.about("block_stats", f" must be None or 'mx', got {block_stats!r}")
        self.block_stats = block_stats
        self.every = check_interval("every", every, 1)
        self.save_every = check_interval("save_every", save_every, 0)
        self.roles = check_roles(roles)
        check_interval("chunk_steps", chunk_steps, 1)
        self.model = model
        self.path = Path(path)
        self.state = get_fp8_state(model)
        if self.state is not None:
            casts = dict(self.state.casts)
            recipe_name = getattr(self.state.recipe, "name", None) or "fp8-model"
            candidates = [(m.name, m) for m in fp8_linears(model)] + _expert_layers(model)
        else:
            try:
                linear = get_recipe(recipe).linear
            except ValueError as exc:
                raise ArgumentError.about("recipe", f": {exc}") from None
            if linear is None:
                raise ArgumentError.about("recipe", f" {recipe!r} casts nothing; pick an FP8 recipe for the "
                                                    "hypothetical casts")  # fmt: skip
            casts = linear.casts()
            recipe_name = recipe
            candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_hf_conv1d(m)]
        _warn_unrecorded_experts(model)
        picked = select_layers(layers, candidates)
        self._layer_names = {n for n, _ in picked}
        #: the MoE experts picked, one "layer" per expert and projection: (name, experts module,
        #: projection, expert); the other layers are linears
        self.expert_layers = [(n, m, *n.rsplit(".", 2)[1:]) for n, m in picked if not _is_linear_layer(m)]
        self.expert_layers = [(n, m, proj, int(e)) for n, m, proj, e in self.expert_layers]
        self.layers = [(n, m) for n, m in picked if _is_linear_layer(m)]
        self._active: set[str] = set()  # the expert layers that cast something this step
        self._last_scale: dict[str, float] = {}  # tensor name -> scale of its last record
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
            "sampling": {"every": self.every, "save_every": self.save_every, "roles": list(self.roles),
                         "observe_every_step": observe_every_step, "block_stats": block_stats,
                         "layers": sorted(self._layer_names) if layers is not None else None},
        }
        meta.update(config or {})
        if append:
            check_same_run(self.path, meta)
        writer = TraceWriter(self.path, meta, mode="a" if append else "w", chunk_steps=chunk_steps)
        self._rounding, self._hist_bits = writer.rounding, writer.hist_mantissa_bits
        self._bg = BackgroundWriter(writer)
        self.step = 0
        self._explicit = False
        self._due = self._save = False  # whether the current step is recorded / its tensors saved
        self._batch: StepBatch | None = None
        # amaxes a history-keeping policy has yet to observe: (quantizer, name, 0-d device tensor)
        self._deferred: list[tuple[Any, str, Any, torch.Tensor]] = []
        # whether the root's last forward was a training forward with autograd: only those (and
        # their backward) are recorded; an eval-mode or no-grad forward records nothing
        self._training_forward = False
        # tensors already in an appended trace are declared; new ones are declared on first sight
        self._declared: set[str] = {t.name for t in TraceReader(self.path).tensors} if append else set()
        self._handles: list[Any] = []
        self._install()
        ref = weakref.ref(self)  # a script that never closes its recorder still gets its trace
        self._atexit = lambda: (ref() is not None) and ref().close()
        atexit.register(self._atexit)

    # -- hooks ------------------------------------------------------------------------------
    def _install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_forward))
        if self.state is not None:
            self.state.taps.append(self._on_cast)
            self.state.expert_taps.append(self._on_expert_cast)
        else:
            for name, mod in self.layers:
                if "activation" in self.roles or "weight" in self.roles:
                    self._handles.append(mod.register_forward_pre_hook(self._make_forward_hook(name)))
                if "grad_output" in self.roles:
                    self._handles.append(mod.register_forward_hook(self._make_output_hook(name)))
        if "weight_grad" in self.roles and (self.state is None or "weight_grad" not in self.state.casts):
            seen: set[int] = set()
            for name, mod in self.layers:
                if id(mod.weight) in seen:  # a tied weight is recorded once
                    continue
                seen.add(id(mod.weight))
                self._handles.append(mod.weight.register_post_accumulate_grad_hook(
                    self._make_wgrad_hook(name, self.state is None and is_hf_conv1d(mod))))
            by_param: dict[int, tuple[torch.Tensor, list]] = {}
            for name, mod, proj, e in self.expert_layers:
                w = getattr(mod, proj)
                by_param.setdefault(id(w), (w, []))[1].append((name, e, mod.is_transposed))
            for w, picked in by_param.values():
                self._handles.append(w.register_post_accumulate_grad_hook(self._make_expert_wgrad_hook(picked)))

    @torch.compiler.disable  # a Python step counter: traced, it would be a guard (a recompile a step)
    def _root_pre_forward(self, module, args) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # activation checkpointing recomputing a forward inside backward
        self._training_forward = torch.is_grad_enabled() and module.training
        if not self._explicit and self._training_forward:
            self._start_step(self.step + 1)

    def _make_forward_hook(self, name: str):
        def hook(module: nn.Linear, args) -> None:
            if not (self._training_forward and torch.is_grad_enabled() and module.training) or self.step < 1:
                return
            if torch._C._current_graph_task_id() != -1:
                return  # a checkpointed forward recomputed in backward: recorded the first time
            if "activation" in self.roles:
                x = args[0].detach()
                self._record_hypothetical(f"{name}.input", "activation", x.reshape(-1, x.shape[-1]))
            if "weight" in self.roles:
                w = module.weight.detach()
                # HF Conv1D stores W^T (in, out): recorded as W (out, in), as nn.Linear's and as
                # the FP8 model casts it
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

    def _make_expert_wgrad_hook(self, picked: list[tuple[str, int, bool]]):
        """The weight gradient of each picked expert of one 3-D expert weight, as an (out, in)
        slice; only experts that had tokens this step (an idle expert's gradient is zero, its
        empty record comes from :meth:`_fill_idle_experts`)."""
        def hook(param: torch.Tensor) -> None:
            if param.grad is None or self.step < 1 or not self._training_forward:
                return
            g = param.grad.detach()  # (E, out, in), or (E, in, out) stored transposed
            for name, e, transposed in picked:
                if name in self._active:
                    self._record_hypothetical(f"{name}.weight_grad", "weight_grad", g[e].t() if transposed else g[e])

        return hook

    # -- recording --------------------------------------------------------------------------
    #: take the accelerator's path (statistics as device rows, amaxes deferred) for CPU tensors
    #: too: how the tests check that path on a machine without an accelerator
    _device_path_on_cpu = False

    def _on_host(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and not self._device_path_on_cpu

    def _statistics(self, x: torch.Tensor, fmt, scale: float):
        """``x``'s statistics where it lives: host statistics for a CPU tensor (numba), a small
        int64 device tensor otherwise (:func:`~fp8sim.trace.statistics.device_statistics`)."""
        if self._on_host(x):
            return histogram_and_counts(x, fmt, scale, self._rounding, self._hist_bits)
        return device_statistics(x, fmt, scale, self._rounding, self._hist_bits)

    def _add(self, name: str, role: str, fmt, x: torch.Tensor, scale: float, stats, **measured):
        if self.block_stats == "mx" and "blocks" not in measured and x.dim() == 2:
            from fp8sim.trace.block_stats import mx_what_if

            measured["blocks"] = mx_what_if(x, fmt, self._hist_bits)  # what an MX cast would do
        self._last_scale[name] = scale
        if name not in self._declared:  # declared once, with the first shape seen
            self._batch.declare.append((name, role, fmt.name, tuple(x.shape), role not in self.performed))
            self._declared.add(name)
        return self._batch.add(name, role, fmt, x, scale, stats, save=self._save, **measured)

    def _resolve_deferred(self, name: str | None = None) -> None:
        """Let the policies observe the deferred amaxes (all of them, in order, in one copy),
        if ``name`` has one pending (None: in any case)."""
        if not self._deferred or (name is not None and all(d[1] != name for d in self._deferred)):
            return
        values = torch.stack([d[2].to(torch.float32) for d in self._deferred]).cpu().tolist()
        for (q, n, _), amax in zip(self._deferred, values):
            q.observe(n, amax)
        self._deferred.clear()

    def _observe(self, q, name: str, amax: float | torch.Tensor) -> None:
        if isinstance(amax, torch.Tensor):  # on an accelerator: observed when next needed
            self._deferred.append((q, name, amax))
        else:
            q.observe(name, amax)

    def _record_hypothetical(self, name: str, role: str, x: torch.Tensor) -> None:
        """A tensor the model does not cast: the recorder's policy gives the scale it would get."""
        from fp8sim.backends.base import amax_f32

        q = self.quantizers[role]
        fmt = q.fmt
        # MX and NVFP4 scales come from this tensor's (block) amax, as just-in-time ones do
        jit = q.policy.just_in_time or q.granularity.kind in ("mx", "nvfp4")
        on_host = self._on_host(x)
        if not self._due:  # between recorded steps only a history needs the amax
            if not jit and self.observe_every_step:
                self._resolve_deferred(name)
                a = amax_f32(x)
                self._observe(q, name, float(a) if on_host else a)
            return
        self._resolve_deferred(name)
        if jit:  # the scale needs this tensor's amax first (a sync on a device)
            amax = float(amax_f32(x))
            scale = float(q.scale_for(name, amax))
        else:  # the scale is known: the amax comes out of the statistics pass
            amax, scale = None, float(q.scale_for(name, None))
        stats = self._statistics(x, fmt, scale)
        self._add(name, role, fmt, x, scale, stats)
        if amax is None:
            amax = seen_amax(stats, x.dtype) if on_host else amax_f32(x)
        self._observe(q, name, amax)

    def _on_cast(self, name: str, role: str, x: torch.Tensor, cast: CastConfig, scale, op) -> None:
        """Tap of an FP8 model (the one place that knows the tap's signature): the live cast,
        with the scale it used (the model calls it only for observed casts: training forwards
        with autograd, each once)."""
        if not self._due or role not in self.roles or name.rsplit(".", 1)[0] not in self._layer_names:
            return
        if op.granularity.kind == "tensor":
            self._add(name, role, op.fmt, x, float(scale), self._statistics(x, op.fmt, float(scale)))
        else:  # block scales: scale 1, the block statistics, the measured clipping and underflow
            from fp8sim.trace.block_stats import block_statistics

            mag = op.codes & (op.fmt.sign_mask - 1)
            under = ((mag == 0) & (x != 0)).sum()
            blocks = block_statistics(
                x, op.codes, op.scale_inv, op.fmt, op.granularity.spec, k=self._hist_bits,
                global_amax=None if op.global_amax is None else float(op.global_amax),
                policy_params=_block_params(cast) if op.granularity.kind == "block" else None)
            self._add(name, role, op.fmt, x, 1.0, self._statistics(x, op.fmt, 1.0), overflow=blocks.clipped,
                      underflow=int(under) if self._on_host(x) else under, blocks=blocks)  # fmt: skip

    def _on_expert_cast(self, name: str, role: str, x: torch.Tensor, cast: CastConfig, scale, op,
                        expert: int) -> None:
        """Tap of the FP8 MoE experts: the cast of one expert's tensor, recorded as a linear's
        (``{experts}.{projection}.{expert}.input`` etc.); the expert had tokens this step."""
        self._active.add(name.rsplit(".", 1)[0])
        self._on_cast(name, role, x, cast, scale, op)

    def _fill_idle_experts(self) -> None:
        """An empty record (0 elements: no token, nothing cast) for each recorded role of each
        picked expert that had no token this step, so that the trace says the expert was idle
        -- tokens per expert are the input records' rows -- and the analyses do not take the
        step for an underflow or a missing record. Its scale is the tensor's last recorded
        scale (1 before any)."""
        if self._batch is None or not self._batch.records:
            return
        for name, mod, proj, e in self.expert_layers:
            if name in self._active:
                continue
            w = getattr(mod, proj)
            out_f, in_f = (w.shape[2], w.shape[1]) if mod.is_transposed else (w.shape[1], w.shape[2])
            for role, suffix, width in (("activation", "input", in_f), ("weight", "weight", in_f),
                                        ("grad_output", "grad_output", out_f), ("weight_grad", "weight_grad", in_f)):
                if role not in self.roles:
                    continue
                tensor, fmt = f"{name}.{suffix}", self.casts[role].fmt
                if role in ("weight", "weight_grad") and tensor not in self._declared:  # its own shape
                    self._batch.declare.append((tensor, role, fmt.name, (out_f, in_f), role not in self.performed))
                    self._declared.add(tensor)
                empty = w.detach().new_empty((0, width), dtype=torch.float32)
                scale = self._last_scale.get(tensor, 1.0)
                self._add(tensor, role, fmt, empty, scale, self._statistics(empty, fmt, scale), blocks=None)

    # -- steps and lifetime -----------------------------------------------------------------
    def _start_step(self, step: int) -> None:
        self._finish_step()
        self.step = step
        self._save = self.save_every > 0 and (step - 1) % self.save_every == 0
        self._due = self._save or (step - 1) % self.every == 0
        if self._due:
            self._batch = StepBatch(step)

    def _finish_step(self) -> None:
        """Hand the current step's records to the background writer."""
        self._fill_idle_experts()
        self._active.clear()
        batch, self._batch = self._batch, None
        if batch is not None and (batch.records or batch.declare):
            batch.finish()
            self._bg.submit(batch.write)

    def begin_step(self, step: int) -> None:
        """Start training step ``step`` (1-based, increasing); recorded if due (``every``,
        ``save_every``)."""
        self._explicit = True
        self._start_step(int(step))

    def end_step(self, step: int) -> None:
        """The step's backward is done (weight gradients are recorded by then): its records go
        to the background writer."""
        self._finish_step()

    def state_dict(self) -> dict:
        """The recorder's own policies (hypothetical casts), for checkpoints."""
        self._resolve_deferred()
        return {"step": self.step, "policies": {r: q.state_dict() for r, q in self.quantizers.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self._deferred.clear()
        for role, sd in d["policies"].items():
            if role in self.quantizers:
                self.quantizers[role].load_state_dict(sd)

    def flush(self) -> None:
        """Write every step recorded so far (the current one as it stands) and wait for it."""
        self._finish_step()
        self._bg.flush()

    def discard_after(self, step: int) -> None:
        """Forget the unwritten records of steps after ``step`` (a step an interruption cut
        short: the trace keeps only whole steps)."""
        self._drop_batch_after(step)
        self._bg.call(lambda w: w.discard_after(step))

    def truncate_after(self, step: int) -> None:
        """Drop what the trace holds of steps after ``step`` (resuming from that checkpoint)."""
        self._drop_batch_after(step)
        self._bg.call(lambda w: w.truncate_after(step))

    def _drop_batch_after(self, step: int) -> None:
        if self._batch is not None and self._batch.step > step:
            self._declared -= {d[0] for d in self._batch.declare}  # never written: declared again
            self._batch = None

    def close(self) -> None:
        """Remove every hook and tap, write what was recorded and close the trace."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.state is not None and self._on_cast in self.state.taps:
            self.state.taps.remove(self._on_cast)
        if self.state is not None and self._on_expert_cast in self.state.expert_taps:
            self.state.expert_taps.remove(self._on_expert_cast)
        atexit.unregister(self._atexit)
        try:
            self._finish_step()
        finally:
            self._bg.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _warn_unrecorded_experts(model: nn.Module) -> None:
    """One warning naming the transformers MoE experts modules ``model`` runs in high precision:
    their GEMMs are inside the experts' forward, where no hook reaches, so they are not recorded
    (FP8 experts, :func:`~fp8sim.training.convert_to_fp8`, are)."""
    import warnings

    from fp8sim.training.experts import is_hf_experts

    found = [n for n, m in model.named_modules() if is_hf_experts(m) and not is_fp8_experts(m)]
    if found:
        warnings.warn(f"record: {len(found)} MoE experts modules run in high precision and are not recorded "
                      f"(first: {found[0]}); convert_to_fp8 the model to record its experts per expert",
                      UserWarning, stacklevel=4)


def _is_linear_layer(module: nn.Module) -> bool:
    """A recorder layer that is a linear (``nn.Linear``, ``Conv1D`` or ``Fp8Linear``), not MoE experts."""
    return not is_fp8_experts(module)


def _expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(f"{experts}.{projection}.{expert}", experts module)`` for every expert of every FP8
    experts module of ``model`` (:mod:`fp8sim.training.experts`), as the recorder's layers."""
    return [(f"{m.fp8_name}.{proj}.{e}", m) for m in fp8_experts(model) for proj in m.fp8_projections
            for e in range(m.num_experts)]


def _block_params(cast: CastConfig) -> dict:
    """The just-in-time rule of a ``block:RxC`` cast: its scaling's margin, pow2 and epsilon."""
    c = cast.scaling
    return {"margin": c.margin, "pow2": c.pow2, "epsilon": c.epsilon}


def record(model: nn.Module, path: str | os.PathLike, **kwargs) -> Recorder:
    """Record ``model``'s FP8 tensors (or, for a plain model, its ``nn.Linear`` and HF ``Conv1D``
    layers' tensors under the ``recipe`` keyword's policies, default ``te-delayed``) into the
    trace directory ``path``.

    Works with any PyTorch training loop::

        with fp8sim.training.record(model, "trace/") :
            for x, y in loader:
                loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()

    Keyword arguments:

    - ``recipe``: the policies of a plain model's hypothetical casts (default ``te-delayed``);
    - ``every``: record steps 1, N+1, 2N+1, ... (default 1: every step);
    - ``save_every``: also save the full tensors at steps 1, K+1, ... (0: never), on their own
      schedule (a step whose tensors are saved is recorded too);
    - ``observe_every_step``: a plain model's history-keeping policies (``delayed``) observe
      the amax at every step, recorded or not (default; one amax pass per tensor per step), or
      at the recorded steps only (False: steps between cost nothing);
    - ``block_stats``: ``"mx"`` also records, for every tensor cast per tensor, the block
      statistics an MX cast (OCP ``floor`` rule) would have, so that ``mx`` replays exactly from
      the trace without full tensors (:mod:`fp8sim.trace.block_stats`; two more passes per tensor);
    - ``roles``: the roles to record, names of :data:`RECORDED_ROLES` (a list, or one
      comma-separated string; default all);
    - ``layers``: the layers to record: glob patterns on their names (``"layers.*.mlp.*"``) or a
      function ``(name, module) -> bool``; a pattern that matches no layer is an error;
    - ``chunk_steps`` (recorded steps per chunk file), ``config`` (extra JSON-able run config),
      ``append`` (continue a trace).

    Raises :class:`~fp8sim.errors.ArgumentError` naming a bad argument.
    """
    return Recorder(model, path, **kwargs)
