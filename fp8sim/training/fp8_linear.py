"""FP8 linear layers: :class:`Fp8Linear` and its custom ops. The state the layers of a model
share (casts, policies, the FP8 GEMM) is :mod:`fp8sim.training.fp8_state`; the conversion of a
model, ``convert_to_fp8``, :mod:`fp8sim.training.convert`.

``y = x W^T + b`` with all three GEMMs on FP8 operands, through a backend
(:func:`fp8sim.backends.get`):

* forward   ``Y  = X W^T``:   X (M, K) and W (N, K) cast with the recipe's ``input``/``weight``
  casts (E4M3 in the hybrid recipes);
* backward  ``dX = dY W``:    dY (M, N) cast with ``grad_output`` (E5M2 in hybrid), W reused;
* backward  ``dW = dY^T X``:  the same FP8 dY and the FP8 X saved by the forward (uint8 codes,
  not the float32 activation).

A cast is ``amax -> scale (the role's policy) -> codes = encode(float32(x) * scale)``, saturating,
rounding per the recipe (round to nearest even by default); a GEMM multiplies decoded codes and
applies ``scale_inv`` of both operands. Tensor scaling uses the backend's ``quantize``/``scaled_mm``
with ``accumulate=`` :attr:`Fp8State.gemm_accumulate`: ``"float32"`` by default -- on the CPU the
emulator and torch backends then run one and the same float32 GEMM
(:func:`fp8sim.backends.base.mm_float32`: exact products, float32 sum in the order of torch's CPU
matmul, ``float32(acc * float32(sA * sB))``), so their runs on one machine (same torch thread
count) agree bit for bit where their casts do -- or ``"float64"``: exact products summed in float64, scaled in float64, rounded once (about
2.5x slower; the order-independent reference). A backend without ``gemm_accumulations`` (Triton)
runs its own float32 GEMM. MX block scaling (one E8M0 scale per 32 elements along the reduction
axis) goes through :func:`fp8sim.scaling.quantize_scaled` and a float32 GEMM on the dequantized
operands, re-casting each operand along the reduction axis of every GEMM that consumes it, as
Transformer Engine's MXFP8 does (row-wise and column-wise copies).

Scaling policies observe each tensor's amax once per training step: only forwards in training
mode with autograd enabled observe, and a forward that activation checkpointing recomputes inside
backward reuses the first forward's scales and observes nothing. Each layer's GEMMs run as torch
custom ops (``fp8sim::fp8_linear`` and its backward), so ``torch.compile`` traces a converted
model in one graph: the casts (Python, numpy, ``.item()``) run eagerly inside the op.
Overflow (``|float32(x) * scale| > max``, clamped) and underflow (a nonzero value whose code is
zero) are counted per cast into :attr:`Fp8State.events`.

Nothing global is touched: :func:`fp8sim.training.convert.convert_to_fp8` replaces the model's own ``nn.Linear`` (and Hugging
Face ``Conv1D``) children and keeps their ``Parameter`` objects (optimizers and weight tying keep
working); the custom ops find a layer through a weak registry of the converted layers.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn

from fp8sim.training import linear_gemms
from fp8sim.training.forward_calls import hold, observing_forward
from fp8sim.training.fp8_state import Fp8State, decode_extra_state, encode_extra_state

__all__ = ["Fp8Linear", "is_hf_conv1d", "in_backward"]

# -- the FP8 linear as two custom ops ---------------------------------------------------------------
# The forward and backward are torch custom ops (torch.library): opaque to torch.compile, which
# traces each layer's call without a graph break and without guards on the layer's name or
# policy state (the casts run eagerly inside the op, .item() and numpy included). An op takes
# tensors and plain values only, so a layer is passed as its key in _LAYERS (a weak registry:
# a layer that is gone is gone from it).

_LAYERS: "weakref.WeakValueDictionary[int, Fp8Linear]" = weakref.WeakValueDictionary()


def _saved_specs(layer: "Fp8Linear", m: int, k: int, n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what the forward saves (:func:`fp8sim.training.linear_gemms.saved_specs`);
    K and N are the local ones of a tensor-parallel shard (:mod:`fp8sim.training.tensor_parallel`)."""
    return linear_gemms.saved_specs(layer.state, m, k, n)


@torch.library.custom_op("fp8sim::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], key: int,
                   out_dtype: torch.dtype, observe: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor]:
    """``y = x W^T + b`` on FP8 operands: float32 GEMM outside autocast, one rounding to
    ``out_dtype``; returns ``y`` (M, N) and the four tensors the backward needs.

    ``observe``: a training forward (else eval / no grad: the policies' current scales, nothing
    observed). Run inside a backward pass it is activation checkpointing's recomputed forward:
    the casts repeat those of the forward call it recomputes and observe nothing
    (:mod:`fp8sim.training.forward_calls`)."""
    layer = _LAYERS[key]
    st = layer.state
    with torch.autocast(x.device.type, enabled=False):  # the emulated GEMM is never autocast
        x32 = x.detach().to(torch.float32)  # (M, K); exact from bf16 / fp16
        w32 = weight.detach().to(torch.float32)  # (N, K), or (K, N) for a transposed layer
        if layer.transposed:  # HF Conv1D stores W^T; the cast sees W (N, K), as nn.Linear's
            w32 = w32.t().contiguous()
        call = st.forward_call(layer.name, x32, observe=observe, recompute=observe and in_backward(),
                               checkpointed=layer.checkpointed)
        layer.pending_call = call  # kept alive by the autograd context (setup_context) or a checkpoint
        gemm, saved = linear_gemms.forward(st, layer.name, x32, w32, observe=observe, call=call)
        y = linear_gemms.run(st, [gemm])[0]  # (M, N) float32
        if bias is not None:  # the GEMM epilogue's float32 add, before the one rounding
            y = y + bias.detach().to(torch.float32)
    # outputs of a custom op may not alias its inputs or each other
    specs = _saved_specs(layer, x.shape[0], x.shape[1], w32.shape[0])
    saved = tuple(t.reshape(shape).to(dtype).clone() for t, (shape, dtype) in zip(saved, specs))
    return (y.to(out_dtype),) + saved


def _local_n(layer: "Fp8Linear", weight: torch.Tensor) -> int:
    """N of the weight as the op sees it (the local shard's under tensor parallelism)."""
    return weight.shape[1] if layer.transposed else weight.shape[0]


@_fp8_linear_op.register_fake
def _(x, weight, bias, key, out_dtype, observe):
    layer = _LAYERS[key]
    m, k, n = x.shape[0], x.shape[1], _local_n(layer, weight)
    y = x.new_empty((m, n), dtype=out_dtype)
    return (y,) + tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in _saved_specs(layer, m, k, n))


@torch.library.custom_op("fp8sim::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward_op(gy: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor,
                            s3: torch.Tensor, key: int, observe: bool, x_dtype: torch.dtype, w_dtype: torch.dtype,
                            b_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dX = dY W`` and ``dW = dY^T X`` on FP8 operands (and ``db``, empty without a bias), in
    the dtypes of x, the stored weight (its layout too) and the bias."""
    layer = _LAYERS[key]
    st = layer.state
    with torch.autocast(gy.device.type, enabled=False):
        gy = gy.to(torch.float32).contiguous()  # (M, N); exact from bf16 / fp16
        dgrad, wgrad = linear_gemms.backward(st, layer.name, gy, (s0, s1, s2, s3), observe=observe)
        dx, dw = linear_gemms.run(st, [dgrad, wgrad])  # (M, K), (N, K)
        dw = linear_gemms.cast_weight_grad(st, layer.name, dw, observe=observe)
        db = gy.sum(0).to(b_dtype) if b_dtype is not None else gy.new_zeros(0)
    if layer.transposed:
        dw = dw.t()  # (K, N), the stored layout
    return dx.to(x_dtype), dw.to(w_dtype).contiguous(), db


@_fp8_linear_backward_op.register_fake
def _(gy, s0, s1, s2, s3, key, observe, x_dtype, w_dtype, b_dtype):
    layer = _LAYERS[key]
    m, k, n = gy.shape[0], s0.shape[1], gy.shape[1]  # s0: X's codes or values, (M, K)
    w_shape = (k, n) if layer.transposed else (n, k)
    db = gy.new_empty((n,), dtype=b_dtype) if b_dtype is not None else gy.new_empty((0,), dtype=gy.dtype)
    return gy.new_empty((m, k), dtype=x_dtype), gy.new_empty(w_shape, dtype=w_dtype), db


def _fp8_linear_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, key, out_dtype, observe = inputs
    ctx.save_for_backward(*output[1:])
    ctx.key, ctx.observe = key, observe
    ctx.fp8_call = _LAYERS[key].pending_call  # the forward call lives as long as this graph
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)


def _fp8_linear_autograd(ctx, gy, *unused):
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    dx, dw, db = _fp8_linear_backward_op(gy, *ctx.saved_tensors, ctx.key, ctx.observe, x_dtype, w_dtype, b_dtype)
    return dx, dw, (db if b_dtype is not None else None), None, None, None


_fp8_linear_op.register_autograd(_fp8_linear_autograd, setup_context=_fp8_linear_setup_context)


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a checkpointed forward is recomputed
    inside one, both by ``torch.utils.checkpoint`` and by Hugging Face's checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class Fp8Linear(nn.Linear):
    """Drop-in for ``nn.Linear`` (or a subclass, or Hugging Face's ``Conv1D``) whose GEMMs run
    in FP8 (see the module docstring).

    An ``nn.Linear`` subclass, so what accepts linear layers accepts it -- tensor parallelism's
    ``ColwiseParallel`` / ``RowwiseParallel`` included: with a ``DTensor`` weight the GEMMs run on
    the local shards (:mod:`fp8sim.training.tensor_parallel`). Its ``__init__`` allocates nothing
    (it takes over the replaced module's parameters), and ``reset_parameters`` is ``nn.Linear``'s.

    Shares ``weight``/``bias`` Parameters with the module it replaces, in their stored layout and
    dtype: ``transposed`` is True for ``Conv1D``, whose weight is (in, out) and ``y = x W + b``;
    the casts and traces see ``W`` as (out, in) either way, and the gradient comes back in the
    stored layout. ``name`` is its qualified module name (the prefix of its tensors' names in
    policies and traces).

    The output has the input's dtype, or autocast's (``torch.get_autocast_dtype``) inside an
    autocast region: the float32 GEMM result plus bias is rounded once to it. The policies
    observe only forwards in training mode with autograd enabled (``model.eval()`` or
    ``torch.no_grad()`` cast with the current scales and record nothing). The layer's share of
    the FP8 state (its tensors' policy states, the step) is its ``_extra_state`` in
    ``state_dict()``.
    """

    def __init__(self, module: nn.Module, name: str, state: Fp8State) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate new parameters
        self.transposed = is_hf_conv1d(module)
        if self.transposed:
            self.in_features, self.out_features = module.weight.shape
        else:
            self.in_features, self.out_features = module.in_features, module.out_features
        self.weight = module.weight
        self.bias = module.bias
        self.name = name
        self.state = state  # plain attribute: shared, not a submodule
        self._key = id(self)  # this layer in the custom ops' registry
        _LAYERS[self._key] = self
        #: the forward call of the last forward (:mod:`fp8sim.training.forward_calls`), until its
        #: autograd context (or a reentrant checkpoint's) takes it
        self.pending_call = None
        self.checkpointed = False  # whether the current forward may be recomputed by checkpointing

    def __setstate__(self, state: dict) -> None:  # copy.deepcopy, pickle: the copy is its own layer
        super().__setstate__(state)
        self._key = id(self)
        _LAYERS[self._key] = self

    def tensor_names(self) -> set[str]:
        """The names of this layer's tensors in the policies and traces."""
        return linear_gemms.tensor_names(self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fp8sim.training.tensor_parallel import is_dtensor, tensor_parallel_forward

        if is_dtensor(self.weight):  # tensor parallelism: the same GEMMs on the local shards
            return tensor_parallel_forward(self, x, self._forward_local)
        return self._forward_local(x, self.weight, self.bias)

    def _forward_local(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` on plain tensors (a tensor-parallel shard's: its local K or N)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # (M, K), M = prod(lead)
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        observe, self.checkpointed, holder = observing_forward(self)  # eval / no grad: nothing observed
        y = _fp8_linear_op(x2, weight, bias, self._key, out_dtype, observe)[0]  # (M, N)
        hold(holder, self.pending_call)  # a reentrant checkpoint's first forward: its context keeps the call
        return y if x.dim() == 2 else y.view(*lead, y.shape[-1])  # no view where nn.Linear gives none

    # -- the FP8 state in state_dict() ----------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """This layer's share of the FP8 state (:meth:`Fp8State.layer_state`; the first layer also
        carries the state's extras), as a uint8 tensor of JSON (:func:`encode_extra_state`)."""
        return encode_extra_state(layer_extra_state(self))

    def set_extra_state(self, state: torch.Tensor | dict) -> None:
        load_layer_extra_state(self, decode_extra_state(state, self.name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a state dict saved before conversion has no FP8 state: the layer keeps its fresh one
        had = prefix + "_extra_state" in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not had and prefix + "_extra_state" in missing_keys:
            missing_keys.remove(prefix + "_extra_state")

    def extra_repr(self) -> str:
        roles = ", ".join(f"{r}={c.fmt}" for r, c in self.state.casts.items())
        layout = ", transposed (HF Conv1D)" if self.transposed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {roles}{layout}"


def layer_extra_state(layer: nn.Module) -> dict:
    """The plain-data FP8 state of an FP8 ``layer`` (an :class:`Fp8Linear` or FP8 experts: its
    ``state``, ``name`` and ``tensor_names()``): its tensors' policy states and the step; the
    first converted layer also carries the state's extras (FP8-LM's gradient reducer)."""
    out = layer.state.layer_state(layer.tensor_names())
    if layer.state.extra_states and layer.state.first_layer == layer.name:
        out["extra"] = {k: v.state_dict() for k, v in layer.state.extra_states.items()}
    return out


def load_layer_extra_state(layer: nn.Module, state: dict) -> None:
    """Restore :func:`layer_extra_state` into ``layer`` (the other tensors keep theirs)."""
    layer.state.load_layer_state(layer.tensor_names(), state)
    for key, sd in state.get("extra", {}).items():
        if key not in layer.state.extra_states:
            raise ValueError(f"{layer.name}: the saved FP8 state holds {key!r}, which this model was not "
                             f"prepared with (prepare it as the saved one was)")
        layer.state.extra_states[key].load_state_dict(sd)


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (checked by class, without importing
    transformers): weight (in, out), ``y = x W + b``."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers.") for c in type(module).__mro__)
