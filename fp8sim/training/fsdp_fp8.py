"""FP8-LM O3 on FSDP2: E4M3 weight all-gather and FP8 gradient reduce-scatter.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter, the master weights and the
optimizer states across the data-parallel ranks; this module supplies the FP8 communication of
FP8-LM's O3 level through FSDP2's own extension points:

* **weights** -- the FP8 linears' weights become :class:`Fp8AllGatherWeight` parameters (a
  tensor subclass holding FSDP's float32 shard, as torchao's float8 weights are). Before each
  all-gather, ``fsdp_pre_all_gather`` casts the shard to E4M3 with one scale for the whole
  tensor -- MS-AMP's weight rule ``2**floor(log2(448 / amax))`` from the tensor's amax (MAX over
  the FSDP ranks), so the weight never saturates -- and only the uint8 codes travel;
  ``fsdp_post_all_gather`` decodes the gathered codes to the float32 weight the forward casts
  (the cast of an E4M3 tensor with a power-of-two scale is lossless). ``state_dict()`` yields
  plain tensors (DTensors of the float32 shards).
* **gradients** -- :class:`Fp8ReduceScatter` (``FSDPModule.set_custom_reduce_scatter``): the one
  flat float32 buffer of an FSDP unit is cut back into its tensors, each cast to E4M3 with
  FP8-LM's shared per-tensor scale (AutoScale or MS-AMP's 1/sqrt(N), from the amax MAX-reduced
  over the ranks: :class:`~fp8sim.training.fp8_allreduce.Fp8GradReducer`), the codes exchanged
  with ``all_to_all`` (gloo cannot sum FP8: a float8 all-reduce is refused and a uint8 SUM wraps),
  and each rank sums the N copies of its shard in float32 and re-encodes once -- the rounding
  model of the O1/O2 DDP hook, so the owned shard equals the hook's result bit for bit. Tensors
  outside ``fp8_grads`` travel in bfloat16 the same way.

The optimizer (:class:`~fp8sim.training.optim.Fp8AdamW`) updates the sharded parameters with
global amaxes, so its scales are the single-process ones and its states are DTensors that
``torch.distributed.checkpoint`` reshards.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

__all__ = ["CountedAllGather", "Fp8AllGatherWeight", "Fp8ReduceScatter", "fully_shard_fp8lm", "local_data",
           "weight_quantizer"]


def weight_quantizer(backend: Any, group: Any = None) -> Any:
    """The quantizer of O3's stored weights: E4M3, current scaling with a power-of-two scale
    (MS-AMP's weight rule), the amax MAX-reduced over ``group`` (None: no reduction)."""
    from fp8sim.formats import get_format
    from fp8sim.quantizer import Quantizer, max_across
    from fp8sim.recipes import CastConfig
    from fp8sim.scaling_config import CurrentScalingConfig

    return Quantizer(CastConfig(get_format("e4m3"), CurrentScalingConfig(pow2=True)), backend,
                     amax_reduction=None if group is None else max_across(group))


def local_data(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor of a parameter, state or gradient: a DTensor's shard, the float32
    data of an :class:`Fp8AllGatherWeight`; a plain tensor itself."""
    from fp8sim.training.tensor_parallel import is_dtensor

    if is_dtensor(t):
        t = t._local_tensor
    return t._data if isinstance(t, Fp8AllGatherWeight) else t


#: ops FSDP2 applies to a parameter while sharding, padding and copying it: their results keep
#: the subclass (the rest compute on the float32 data and return plain tensors)
_KEEP_SUBCLASS = {
    torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default,
    torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default,
    torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default,
}  # fmt: skip


class Fp8AllGatherWeight(torch.Tensor):
    """A float32 weight whose FSDP2 all-gather sends E4M3 codes with one scale (FP8-LM O3).

    Behaves as its float32 ``_data`` in every op (the results are plain tensors; the ops FSDP2
    uses to shard it keep the subclass). ``name`` keys it in traces and errors; ``backend`` does
    its casts. Not public API beyond its type (see :func:`fully_shard_fp8lm`).
    """

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, name: str, backend: Any):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, name: str, backend: Any) -> None:
        self._data = data
        self._name = name
        self._backend = backend

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._name}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Fp8AllGatherWeight))
        args, kwargs = pytree.tree_map_only(Fp8AllGatherWeight, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: Fp8AllGatherWeight(t, first._name, first._backend), out)

    def __tensor_flatten__(self):
        return ["_data"], (self._name, self._backend)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_data"], *meta)

    # -- FSDP2's all-gather extension --------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The shard's E4M3 codes (padded to FSDP's padded shard rows) and, as metadata, the
        tensor's ``scale_inv`` (the same on every rank: the amax is MAX-reduced over ``mesh``)."""
        world = mesh.size()
        rows = -(-outer_size[0] // world)  # FSDP pads dim 0 to a multiple of the world size
        data = self._data.reshape(self._data.shape[0], -1)
        q = weight_quantizer(self._backend, mesh.get_group()).quantize(self._name, data, observe=False)
        codes = q.codes
        if codes.shape[0] != rows:
            codes = torch.cat([codes, codes.new_zeros((rows - codes.shape[0], codes.shape[1]))])
        return (codes.reshape(rows, *outer_size[1:]),), (q.scale_inv,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered codes decoded to the float32 weight the forward casts."""
        (codes,), (scale_inv,) = outputs, metadata
        decoded = self._backend.dequantize(codes, "e4m3", scale_inv, out_dtype=param_dtype)
        values = torch.empty_like(decoded, memory_format=torch.contiguous_format)  # storage FSDP2 may free
        values.copy_(decoded)
        if out is not None:  # later all-gathers: refill the unsharded parameter in place
            with torch.no_grad():
                out.copy_(values.view(-1)[: out.numel()].view(out.shape))
            return None
        return values, (values,)


class Fp8ReduceScatter:
    """FSDP2's reduce-scatter of one FSDP unit in FP8 (see the module docstring).

    Args:
        reducer: the :class:`~fp8sim.training.fp8_allreduce.Fp8GradReducer` (scales, AutoScale,
            the stash of reduced gradients for the FP8 optimizer, byte counts); its group is the
            FSDP group.
        params: ``(name, sharded parameter, padded shard size, full size)`` of the unit, in the
            order FSDP2 lays out its flat buffer.
    """

    def __init__(self, reducer: Any, params: Sequence[tuple[str, torch.Tensor, torch.Size, torch.Size]]) -> None:
        self.reducer = reducer
        self.params = list(params)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        import torch.distributed as dist

        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM) or (op == dist.ReduceOp.SUM and group.size() > 1):
            raise ValueError(f"FP8 reduce-scatter averages the gradients; FSDP2 asked for {op} (leave the gradient "
                             "divide factor at its default)")
        n = group.size()
        numels = [math.prod(padded) for _, _, padded, _ in self.params]
        if input_tensor.numel() != n * sum(numels):
            raise ValueError(f"FP8 reduce-scatter: the unit's buffer holds {input_tensor.numel()} values, not the "
                             f"{n * sum(numels)} of its {len(self.params)} parameters (a parameter without a gradient?)")
        segments = input_tensor.view(n, -1)  # row r: every tensor's rows for rank r, padded
        pieces, off = [], 0
        for (name, param, padded, full), k in zip(self.params, numels):
            pieces.append((name, param, segments[:, off : off + k], padded, full))
            off += k
        self.reducer.reduce_scatter(pieces, output_tensor)
        return None


class CountedAllGather:
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``) that counts the bytes it moves:
    ``counter.add(category, "all_gather", bytes of the gathered buffer)`` -- what each rank sends
    on a ring, (N-1)/N of it, from the collective's actual tensor (E4M3 codes under O3)."""

    def __init__(self, counter: Any, category: str = "weights") -> None:
        self.counter, self.category = counter, category

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        import torch.distributed as dist

        self.counter.add(self.category, "all_gather", output_tensor.numel() * output_tensor.element_size())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13: the new name
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


def fully_shard_fp8lm(model: nn.Module, reducer: Any, *, mesh: Any = None, units: Iterable[nn.Module] | None = None,
                      fp8_weight_names: set[str] = frozenset(), backend: Any = None) -> nn.Module:
    """Shard ``model`` with FSDP2 for FP8-LM O3 (in place; returns it).

    ``units``: the modules sharded as FSDP units before the root (default: every module held in
    an ``nn.ModuleList``, i.e. the transformer blocks, as torchtitan shards them);
    ``fp8_weight_names``: the parameters whose all-gather travels in E4M3 (the FP8 linears'
    weights) -- they become :class:`Fp8AllGatherWeight`; ``reducer``: every unit's gradients are
    reduce-scattered through it (:class:`Fp8ReduceScatter`) and every all-gather counted in its
    counter (:class:`CountedAllGather`, category ``weights``); ``mesh``: a 1-D device mesh (None:
    every rank of the default group, on the parameters' device type).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from fp8sim import backends

    be = backends.get("emulator") if backend is None else (backends.get(backend) if isinstance(backend, str) else backend)
    if mesh is None:
        import torch.distributed as dist

        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    params = dict(model.named_parameters())
    missing = sorted(set(fp8_weight_names) - set(params))
    if missing:
        raise ValueError(f"fully_shard_fp8lm: {missing[0]} is not a parameter of the model")
    for name in sorted(fp8_weight_names):
        parent, _, attr = name.rpartition(".")
        mod = model.get_submodule(parent) if parent else model
        p = params[name]
        mod.register_parameter(attr, nn.Parameter(Fp8AllGatherWeight(p.detach(), name, be), requires_grad=p.requires_grad))
    if units is None:
        units = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = {id(p): n for n, p in model.named_parameters()}
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        groups = mod._get_fsdp_state()._fsdp_param_groups  # torch 2.13: one per mesh; none for a bare root
        if not groups:
            continue
        (group,) = groups
        layout = [(names[id(fp.sharded_param)], fp.sharded_param, fp.padded_sharded_param_size, fp._orig_size)
                  for fp in group.fsdp_params]  # the order of the unit's flat reduce-scatter buffer
        mod.set_reduce_scatter_unused_params(True, recurse=False)  # the flat buffer always holds every tensor
        mod.set_custom_reduce_scatter(Fp8ReduceScatter(reducer, layout))
        mod.set_custom_all_gather(CountedAllGather(reducer.counter))
    for mod in model.modules():
        if any(isinstance(local_or_none(p), Fp8AllGatherWeight) for p in mod.parameters(recurse=False)):
            mod._register_state_dict_hook(_plain_state_dict)
    return model


def local_or_none(p: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's local tensor (its subclass kept), else the tensor itself."""
    from fp8sim.training.tensor_parallel import is_dtensor

    return p._local_tensor if is_dtensor(p) else p


def _plain_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: O3 weights as plain tensors (DTensors of their float32 shards)."""
    from torch.distributed.tensor import DTensor

    for key, t in list(state_dict.items()):
        if not key.startswith(prefix) or not isinstance(t, torch.Tensor):
            continue
        local = local_or_none(t)
        if not isinstance(local, Fp8AllGatherWeight):
            continue
        if isinstance(t, DTensor):
            state_dict[key] = DTensor.from_local(local._data, t.device_mesh, t.placements, run_check=False,
                                                 shape=t.shape, stride=t.stride())
        else:
            state_dict[key] = local._data
