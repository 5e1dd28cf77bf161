"""Mixture-of-experts layers in FP8: the experts modules of Hugging Face transformers 5.x.

transformers stores a MoE block's experts as 3-D parameters of one module -- Mixtral's
``gate_up_proj`` (experts, 2 x ffn, hidden) and ``down_proj`` (experts, hidden, ffn) -- and
dispatches its forward through an *experts interface* (``transformers.integrations.moe``:
``eager``, ``batched_mm``, ``grouped_mm`` (the default), ...). A class decorated with
``@use_experts_implementation`` declares its layout: ``has_gate`` (``gate_up_proj``, else
``up_proj``), ``has_bias`` (``*_proj_bias``), ``is_transposed`` (weights stored (experts, in,
out), as GPT-OSS's), ``is_concatenated`` (gate and up halves, else interleaved: the class's own
``_apply_gate`` splits them), ``has_post_expert_norm``; fp8sim reads the layout from these and
never from shapes.

:func:`convert_experts` turns such a module into FP8 in place, as transformers' own FP8
integration does: its class becomes ``Fp8<Class>`` (a subclass made once per class), whose
forward goes through :class:`Fp8ExpertsInterface` -- an ``ExpertsInterface`` with fp8sim's FP8
version of the ``grouped_mm`` algorithm under the names ``eager``, ``batched_mm`` and
``grouped_mm`` (they compute the same routed sum; the model's ``experts_implementation`` picks
one). The parameters, their names and everything else the module holds are kept.

The FP8 forward sorts the (token, expert) pairs by expert (stably: tokens in order within an
expert), runs each projection as one grouped FP8 linear -- per expert ``e`` with tokens, the
FP8 linear of :mod:`fp8sim.training.linear_gemms` named ``{module}.{proj}.{e}`` (its tensors:
``...{e}.input``, ``.weight``, ``.grad_output``, ``.weight_grad``), one scale set per expert
with the recipe's granularity (per tensor, 1x128 / 128x128 blocks, MX, NVFP4), the GEMMs of
all experts in one :meth:`Fp8State.grouped_gemm` -- applies the module's own gating
(``_apply_gate`` or ``act_fn``), weights each pair by its routing weight and sums over the top
k, as transformers' ``grouped_mm_experts_forward``. Bit for bit a loop of per-expert
:class:`~fp8sim.training.fp8_linear.Fp8Linear` layers on the same token order. An expert no
token was routed to casts nothing and gets a zero gradient. Expert parallelism is refused.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn as nn

from fp8sim.training import linear_gemms
from fp8sim.training.forward_calls import hold, observing_forward
from fp8sim.training.fp8_linear import in_backward, layer_extra_state, load_layer_extra_state
from fp8sim.training.fp8_state import Fp8State, decode_extra_state, encode_extra_state

__all__ = ["is_hf_experts", "experts_projections", "convert_experts", "is_fp8_experts", "SUPPORTED_IMPLEMENTATIONS"]

#: the layout attributes ``@use_experts_implementation`` sets on an experts module
LAYOUT = ("num_experts", "has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
#: the experts implementations whose math the FP8 forward replaces (None: a standalone module)
SUPPORTED_IMPLEMENTATIONS = (None, "eager", "batched_mm", "grouped_mm")


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module: it declares the experts interface's
    layout (:data:`LAYOUT`, set by ``@use_experts_implementation``) and holds the 3-D weights
    that layout names."""
    if not all(hasattr(module, a) for a in LAYOUT) or not hasattr(module, "config"):
        return False
    return all(isinstance(getattr(module, w, None), nn.Parameter) and getattr(module, w).dim() == 3
               for w, _ in experts_projections(module))  # fmt: skip


def experts_projections(module: nn.Module) -> list[tuple[str, str | None]]:
    """``(weight name, bias name or None)`` of the two projections, as the module declares them."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    return [(up, f"{up}_bias" if module.has_bias else None), ("down_proj", "down_proj_bias" if module.has_bias else None)]


def is_fp8_experts(module: nn.Module) -> bool:
    return isinstance(module, _Fp8ExpertsMixin)


class ExpertsProjection:
    """One projection of an FP8 experts module as the custom ops see it: its name
    (``{module}.{proj}``), the shared :class:`Fp8State`, the stored layout and the forward call
    being made (see :mod:`fp8sim.training.forward_calls`)."""

    def __init__(self, name: str, state: Fp8State, transposed: bool, num_experts: int, out_features: int) -> None:
        self.name, self.state, self.transposed = name, state, transposed
        self.num_experts, self.out_features = num_experts, out_features
        self.pending_call: Any = None
        self.checkpointed = False
        self.key = _register(self)

    def __setstate__(self, d: dict) -> None:  # copy.deepcopy: the copy is its own projection
        self.__dict__.update(d)
        self.key = _register(self)

    def tensor_names(self) -> set[str]:
        return {n for e in range(self.num_experts) for n in linear_gemms.tensor_names(f"{self.name}.{e}")}


_PROJECTIONS: "weakref.WeakValueDictionary[int, ExpertsProjection]" = weakref.WeakValueDictionary()


def _register(p: ExpertsProjection) -> int:
    _PROJECTIONS[id(p)] = p
    return id(p)


# -- the grouped FP8 linear as two custom ops (as fp8sim::fp8_linear, one linear per expert) ----------


def _saved_specs(p: ExpertsProjection, s: int, k: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What the grouped forward saves: every expert's saves (:func:`linear_gemms.saved_specs`)
    stacked -- the rows of X (S, K) in expert order, W (E, N, K), per-expert scales (E,)."""
    e, n = p.num_experts, p.out_features
    if linear_gemms.saves_codes(p.state):
        return [((s, k), torch.uint8), ((e,), torch.float32), ((e, n, k), torch.uint8), ((e,), torch.float32)]
    return [((s, k), torch.float32), ((0,), torch.float32), ((e, n, k), torch.float32), ((0,), torch.float32)]


def _slices(counts: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(expert, first row, row count)`` of the experts with tokens."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out.append((e, start, n))
        start += n
    return out


@torch.library.custom_op("fp8sim::fp8_grouped_linear", mutates_args=())
def _grouped_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], counts: torch.Tensor, key: int,
                out_dtype: torch.dtype, observe: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """``y_e = x_e W_e^T + b_e`` for the rows ``x_e`` of each expert (``counts`` rows each, in
    expert order) on FP8 operands, float32 GEMMs outside autocast, one rounding to
    ``out_dtype``; returns ``y`` (S, N) and the four tensors the backward needs."""
    p = _PROJECTIONS[key]
    st = p.state
    with torch.autocast(x.device.type, enabled=False):
        x32 = x.detach().to(torch.float32)  # (S, K)
        w32 = weight.detach().to(torch.float32)  # (E, N, K), or (E, K, N) stored transposed
        if p.transposed:
            w32 = w32.transpose(1, 2)
        parts = _slices(counts)
        call = st.forward_call(f"{p.name}#{tuple(counts.tolist())}", x32, observe=observe,
                               recompute=observe and in_backward(),
                               checkpointed=p.checkpointed)  # fmt: skip
        p.pending_call = call
        gemms, saved = [], []
        for e, start, n in parts:
            g, s = linear_gemms.forward(st, f"{p.name}.{e}", x32[start:start + n], w32[e].contiguous(),
                                        observe=observe, call=call, expert=e)  # fmt: skip
            gemms.append(g)
            saved.append(s)
        y = x32.new_zeros((x.shape[0], p.out_features))  # (S, N)
        for (e, start, n), ye in zip(parts, linear_gemms.run(st, gemms)):
            y[start:start + n] = ye if bias is None else ye + bias[e].detach().to(torch.float32)
        out = _stack_saved(p, x, parts, saved)
    return (y.to(out_dtype),) + out


def _stack_saved(p: ExpertsProjection, x: torch.Tensor, parts: list, saved: list) -> tuple[torch.Tensor, ...]:
    specs = _saved_specs(p, x.shape[0], x.shape[1])
    out = [torch.zeros(shape, dtype=dtype, device=x.device) for shape, dtype in specs]
    if linear_gemms.saves_codes(p.state):
        out[1].fill_(1.0)
        out[3].fill_(1.0)  # experts without tokens: never read
    for (e, start, n), (s0, s1, s2, s3) in zip(parts, saved):
        out[0][start:start + n] = s0
        out[2][e] = s2
        if out[1].numel():
            out[1][e], out[3][e] = s1, s3
    return tuple(out)


@_grouped_op.register_fake
def _(x, weight, bias, counts, key, out_dtype, observe):
    p = _PROJECTIONS[key]
    y = x.new_empty((x.shape[0], p.out_features), dtype=out_dtype)
    return (y,) + tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in _saved_specs(p, x.shape[0], x.shape[1]))


@torch.library.custom_op("fp8sim::fp8_grouped_linear_backward", mutates_args=())
def _grouped_backward_op(gy: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, s3: torch.Tensor,
                         counts: torch.Tensor, key: int, observe: bool, x_dtype: torch.dtype, w_dtype: torch.dtype,
                         b_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert ``dX_e = dY_e W_e`` and ``dW_e = dY_e^T X_e`` on FP8 operands (one grouped GEMM
    each), ``db_e`` (empty without biases); zero for the experts without tokens."""
    p = _PROJECTIONS[key]
    st = p.state
    codes = s0.dtype == torch.uint8
    with torch.autocast(gy.device.type, enabled=False):
        gy = gy.to(torch.float32).contiguous()  # (S, N)
        parts = _slices(counts)
        dgrads, wgrads = [], []
        for e, start, n in parts:
            saved = (s0[start:start + n], s1[e], s2[e], s3[e]) if codes else (s0[start:start + n], s1, s2[e], s3)
            dg, wg = linear_gemms.backward(st, f"{p.name}.{e}", gy[start:start + n], saved, observe=observe, expert=e)
            dgrads.append(dg)
            wgrads.append(wg)
        out = linear_gemms.run(st, dgrads + wgrads)
        dx = gy.new_zeros((gy.shape[0], s2.shape[2]))  # (S, K)
        dw = gy.new_zeros(tuple(s2.shape))  # (E, N, K)
        db = gy.new_zeros((p.num_experts, p.out_features)) if b_dtype is not None else gy.new_zeros(0)
        for (e, start, n), dxe, dwe in zip(parts, out[:len(parts)], out[len(parts):]):
            dx[start:start + n] = dxe
            dw[e] = linear_gemms.cast_weight_grad(st, f"{p.name}.{e}", dwe, observe=observe, expert=e)
            if b_dtype is not None:
                db[e] = gy[start:start + n].sum(0)
    if p.transposed:
        dw = dw.transpose(1, 2)  # (E, K, N), the stored layout
    return dx.to(x_dtype), dw.to(w_dtype).contiguous(), db.to(b_dtype) if b_dtype is not None else db


@_grouped_backward_op.register_fake
def _(gy, s0, s1, s2, s3, counts, key, observe, x_dtype, w_dtype, b_dtype):
    p = _PROJECTIONS[key]
    e, n, k = s2.shape
    db = gy.new_empty((e, n), dtype=b_dtype) if b_dtype is not None else gy.new_empty((0,), dtype=gy.dtype)
    w_shape = (e, k, n) if p.transposed else (e, n, k)
    return gy.new_empty((gy.shape[0], k), dtype=x_dtype), gy.new_empty(w_shape, dtype=w_dtype), db


def _grouped_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, counts, key, out_dtype, observe = inputs
    ctx.save_for_backward(*output[1:], counts)
    ctx.key, ctx.observe = key, observe
    ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.fp8_call = _PROJECTIONS[key].pending_call  # the forward call lives as long as this graph


def _grouped_autograd(ctx, gy, *unused):
    *saved, counts = ctx.saved_tensors
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    dx, dw, db = _grouped_backward_op(gy, *saved, counts, ctx.key, ctx.observe, x_dtype, w_dtype, b_dtype)
    return dx, dw, (db if b_dtype is not None else None), None, None, None, None


_grouped_op.register_autograd(_grouped_autograd, setup_context=_grouped_setup_context)


def grouped_linear(module: nn.Module, proj: str, bias_name: str | None, x: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """Projection ``proj`` of the FP8 experts ``module`` on ``x`` (S, in), rows grouped by expert
    (``counts`` (E,) rows each): (S, out) in ``x``'s dtype, or autocast's inside an autocast
    region."""
    p = module.fp8_projections[proj]
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    observe, p.checkpointed, holder = observing_forward(module)
    bias = getattr(module, bias_name) if bias_name else None
    y = _grouped_op(x.contiguous(), getattr(module, proj), bias, counts, p.key, out_dtype, observe)[0]
    hold(holder, p.pending_call)
    return y


def fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` with FP8 grouped linears: ``hidden_states``
    (T, hidden), ``top_k_index`` and ``top_k_weights`` (T, k) -> (T, hidden)."""
    if self._is_expert_parallel:
        raise NotImplementedError(f"{self.fp8_name}: fp8sim's FP8 experts do not run expert-parallel")
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden = hidden_states.shape
    expert_ids = top_k_index.reshape(-1)  # (S,), S = T * k
    expert_ids_g, perm = torch.sort(expert_ids, stable=True)  # by expert, tokens in order within one
    x = hidden_states[perm // num_top_k]  # (S, hidden)
    # (E,) rows per expert; scatter_add, not bincount, whose output shape depends on the data
    # (a graph break under torch.compile)
    counts = torch.zeros(self.num_experts, dtype=torch.int64, device=expert_ids.device).scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids, dtype=torch.int64))
    (up, up_bias), (down, down_bias) = experts_projections(self)
    h = grouped_linear(self, up, up_bias, x, counts)  # (S, 2 * ffn) or (S, ffn)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)  # (S, ffn)
    out = grouped_linear(self, down, down_bias, h, counts)  # (S, hidden)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    weighted = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[inv_perm].view(num_tokens, num_top_k, hidden).sum(dim=1).to(hidden_states.dtype)


_INTERFACE: Any = None


def experts_interface() -> Any:
    """:class:`Fp8ExpertsInterface`: an ``ExpertsInterface`` of transformers whose
    implementations are fp8sim's FP8 forward (its own mapping: transformers' is left as is)."""
    global _INTERFACE
    if _INTERFACE is None:
        from transformers.integrations.moe import ExpertsInterface

        class Fp8ExpertsInterface(ExpertsInterface):
            """transformers' experts interface with fp8sim's FP8 experts forward for every
            implementation whose math it replaces."""

            _global_mapping = {k: fp8_experts_forward for k in SUPPORTED_IMPLEMENTATIONS if k is not None}

        _INTERFACE = Fp8ExpertsInterface()
    return _INTERFACE


class _Fp8ExpertsMixin:
    """What ``Fp8<Class>`` adds to a transformers experts class (see the module docstring)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        impl = self.config._experts_implementation or "grouped_mm"
        if impl not in SUPPORTED_IMPLEMENTATIONS:
            raise ValueError(f"{self.fp8_name}: experts_implementation={impl!r}; fp8sim's FP8 experts replace "
                             f"{', '.join(i for i in SUPPORTED_IMPLEMENTATIONS if i)} (set one of those)")
        return experts_interface().get_interface(impl, None)(self, hidden_states, top_k_index, top_k_weights)

    def tensor_names(self) -> set[str]:
        return set().union(*(p.tensor_names() for p in self.fp8_projections.values()))

    @property
    def name(self) -> str:  # the layer name FP8 layers answer to (extra state, first layer)
        return self.fp8_name

    @property
    def state(self) -> Fp8State:
        return self.fp8_state

    def get_extra_state(self) -> torch.Tensor:
        return encode_extra_state(layer_extra_state(self))

    def set_extra_state(self, state: torch.Tensor | dict) -> None:
        load_layer_extra_state(self, decode_extra_state(state, self.fp8_name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        had = prefix + "_extra_state" in state_dict  # saved before conversion: the fresh FP8 state stays
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)  # fmt: skip
        if not had and prefix + "_extra_state" in missing_keys:
            missing_keys.remove(prefix + "_extra_state")

    def __reduce_ex__(self, protocol):  # pickle and deepcopy rebuild the FP8 class from the original one
        return _rebuild, (self.fp8_base_class,), self.__dict__

    def extra_repr(self) -> str:
        roles = ", ".join(f"{r}={c.fmt}" for r, c in self.fp8_state.casts.items())
        return f"num_experts={self.num_experts}, FP8 grouped GEMMs per expert: {roles}"


_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Fp8{cls.__name__}", (_Fp8ExpertsMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _rebuild(base: type) -> nn.Module:
    cls = _fp8_class(base)
    return cls.__new__(cls)


def convert_experts(module: nn.Module, name: str, state: Fp8State) -> None:
    """Make the transformers experts ``module`` (qualified name ``name``) run its expert GEMMs in
    FP8 on ``state``, in place (module docstring). ValueError for an experts implementation
    whose math the FP8 forward does not replace, or an expert-parallel module."""
    impl = module.config._experts_implementation
    if impl not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(f"convert_to_fp8: {name} runs experts_implementation={impl!r}; fp8sim's FP8 experts replace "
                         f"{', '.join(i for i in SUPPORTED_IMPLEMENTATIONS if i)} (model.set_experts_implementation("
                         f"'grouped_mm') first)")
    if module._is_expert_parallel:
        raise ValueError(f"convert_to_fp8: {name} is expert-parallel, which fp8sim's FP8 experts do not run")
    base = type(module)
    module.fp8_projections = {}
    for proj, _ in experts_projections(module):
        w = getattr(module, proj)
        out_features = w.shape[2] if module.is_transposed else w.shape[1]
        module.fp8_projections[proj] = ExpertsProjection(f"{name}.{proj}", state, module.is_transposed,
                                                         module.num_experts, out_features)  # fmt: skip
    module.fp8_name, module.fp8_state, module.fp8_base_class = name, state, base
    module.__class__ = _fp8_class(base)
