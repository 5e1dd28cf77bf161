"""Each training forward's casts, kept for the recompute of activation checkpointing.

Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's gradient checkpointing)
runs a block's forward again inside backward and uses the recomputed tensors for the gradients.
For the gradients to be those of the run without checkpointing, every cast of the recompute
must be the cast of the forward it repeats: the same scale (a delayed or MS-AMP policy has
moved on since), the same stochastic-rounding key (the step may have advanced: two forwards of
the model before one backward) and the same NVFP4 tensor amax (reduced across ranks). A layer
may run several times before one backward -- a block shared by two calls, a contrastive loss
over two forwards, nested checkpoints -- so these are kept per forward call, not per layer.

* A :class:`ForwardCall` is one observed forward of one layer (or one grouped experts GEMM):
  the step and, per tensor name, the :class:`CastRecord` its casts made.
* :class:`ForwardCalls` finds the call a recompute repeats by what the recompute sees: the
  layer's name and a 64-bit fingerprint of its input's bits (:func:`fingerprint`) -- the
  recomputed input is bit for bit the original one (checkpointing restores the RNG state and
  the block's inputs). Should one layer receive a bit-identical input twice before one
  backward, the most recent live call is taken (backward runs the later call first).
* A call lives as long as the autograd graph of its forward: the layer's autograd context
  holds it (a reentrant checkpoint's first forward runs without autograd: the checkpoint's
  own context holds it, :func:`reentrant_checkpoint_context`); the index keeps weak references.
  Only forwards that checkpointing may recompute are registered (:func:`observing_forward`).
* A recompute that finds no call (``torch.compile``d forwards register none) falls back to each
  tensor's last observed cast of the step: exact when each layer runs once per backward.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CastRecord", "ForwardCall", "ForwardCalls", "fingerprint", "observing_forward", "hold",
           "reentrant_checkpoint_context"]


@dataclass(frozen=True)
class CastRecord:
    """What a recompute needs to repeat one cast exactly: the training step it belongs to (the
    stochastic-rounding key), the multiplier of a per-tensor cast (0-d float32 tensor, else
    None: block scales come from the tensor itself) and an NVFP4 cast's tensor amax (0-d
    float32 tensor, else None)."""

    step: int
    scale: Any = None
    global_amax: Any = None


@dataclass(eq=False)
class ForwardCall:
    """One forward call of one layer: ``replay`` is True for the recompute of an earlier call
    (its casts observe nothing and repeat ``casts``), False for an observed forward (its casts
    fill ``casts``). ``unmatched``: a recompute that found no live call (a forward under
    ``torch.compile``, or the first forward of a checkpoint fp8sim does not know ran without
    autograd): each cast repeats its tensor's last observed cast if that was this step, else
    observes (:meth:`~fp8sim.training.fp8_state.Fp8State.cast`)."""

    key: tuple[str, int]
    replay: bool = False
    casts: dict[str, CastRecord] = field(default_factory=dict)
    unmatched: bool = False

    def as_replay(self) -> "ForwardCall":
        """The view of this call that a recompute casts through (same records)."""
        return ForwardCall(self.key, True, self.casts)


class ForwardCalls:
    """The live observed forward calls of one :class:`~fp8sim.training.fp8_state.Fp8State`,
    found by ``(layer name, input fingerprint)``."""

    def __init__(self) -> None:
        self._index: dict[tuple[str, int], list[weakref.ref]] = {}

    def __len__(self) -> int:
        return sum(1 for refs in self._index.values() for r in refs if r() is not None)

    def begin(self, layer: str, x: torch.Tensor, *, recompute: bool, checkpointed: bool) -> ForwardCall:
        """The call a forward of ``layer`` on input ``x`` casts through: for a recompute, a
        replay of the live call with that input (the most recent one if several); else -- and
        when none is alive -- a new observed call, registered if the forward runs in a region
        checkpointing may recompute (``checkpointed``; the others are never looked up, so their
        input is not fingerprinted). The caller keeps the call alive (:func:`hold`)."""
        if not (recompute or checkpointed):
            return ForwardCall((layer, 0))
        key = (layer, fingerprint(x))
        if recompute:
            live = [c for c in (r() for r in self._index.get(key, ())) if c is not None]
            if live:
                return live[-1].as_replay()
        call = ForwardCall(key, unmatched=recompute)
        self._index.setdefault(key, []).append(weakref.ref(call, self._forget(key)))
        return call

    def _forget(self, key: tuple[str, int]):
        def drop(ref: weakref.ref) -> None:
            refs = self._index.get(key)
            if refs is not None:
                refs[:] = [r for r in refs if r is not ref]
                if not refs:
                    del self._index[key]

        return drop


def fingerprint(x: torch.Tensor) -> int:
    """A 64-bit hash of ``x``'s shape, dtype and element bits, on its device: ``sum(bits_i *
    w_i) mod 2**64`` with fixed pseudo-random odd weights ``w_i`` (splitmix64 of the index), so
    two different tensors collide with probability about ``2**-33`` or less; one pass over
    ``x`` and one ``.item()``."""
    flat = x.detach().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.contiguous().view(width).to(torch.int64)
    h = int(torch.sum(bits * _weights(bits.numel(), bits.device)))
    return hash((tuple(x.shape), str(x.dtype), h))


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` fingerprint weights on ``device`` (grown on demand, kept per device)."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        i = torch.arange(max(n, 1 << 12), dtype=torch.int64, device=device)
        z = i * -7046029254386353131 + 1  # splitmix64 (golden-ratio increment), int64 wraps
        z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * -4658895280553007687
        z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * -7723592293110705685
        w = _WEIGHTS[device] = (z ^ ((z >> 31) & ((1 << 33) - 1))) | 1
    return w[:n]


def observing_forward(module: torch.nn.Module) -> tuple[bool, bool, Any]:
    """``(observe, checkpointed, holder)`` of a forward of the FP8 ``module``: whether it observes
    (training mode with autograd enabled, or a reentrant checkpoint's first forward,
    :func:`reentrant_checkpoint_context`), whether checkpointing may recompute it (that, or
    saved-tensor hooks are active, as in ``torch.utils.checkpoint``'s non-reentrant regions --
    Hugging Face's default), and the checkpoint context that must hold its calls (or None)."""
    if not module.training:
        return False, False, None
    if torch.compiler.is_compiling():  # no call is looked up: a recompute is "unmatched"
        return torch.is_grad_enabled(), False, None
    if torch.is_grad_enabled():
        return True, torch._C._autograd._top_saved_tensors_default_hooks(False) is not None, None
    ctx = reentrant_checkpoint_context()
    return ctx is not None, ctx is not None, ctx


def hold(holder: Any, call: ForwardCall | None) -> None:
    """Keep ``call`` alive as long as ``holder`` (an autograd context) lives."""
    if holder is not None and call is not None:
        holder.__dict__.setdefault("_fp8sim_calls", []).append(call)


def reentrant_checkpoint_context() -> Any | None:
    """The autograd context of the outermost reentrant ``torch.utils.checkpoint`` region whose
    first forward is running now, or None. That forward runs without autograd (inside
    ``CheckpointFunction.forward``), yet it is the step's training forward: its casts observe,
    and the checkpoint's context keeps their records for the recompute in backward. Found by
    the code object of ``CheckpointFunction.forward`` on the call stack (only looked for in a
    training forward without autograd)."""
    from torch.utils.checkpoint import CheckpointFunction

    code = CheckpointFunction.forward.__code__
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            found = frame.f_locals.get("ctx")
        frame = frame.f_back
    return found
