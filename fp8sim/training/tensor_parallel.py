"""Tensor parallelism of FP8 linears on torch's DTensor engine.

``parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})``
accepts an :class:`~fp8sim.training.fp8_linear.Fp8Linear` (an ``nn.Linear`` subclass), before or
after :func:`~fp8sim.training.convert.convert_to_fp8`. The styles shard the weight (``DTensor``
on a one-dimensional mesh) and place the input; the layer then runs its FP8 GEMMs on the local
shards, as ``F.linear`` on DTensors would run the float GEMM:

* ``ColwiseParallel``: weight ``Shard(0)`` (rows: output features), input ``Replicate``, output
  ``Shard(-1)``; the input's gradient is a partial sum over the ranks (``Partial``, reduced by
  DTensor);
* ``RowwiseParallel``: weight ``Shard(1)`` (columns: K), input ``Shard(-1)``, output ``Partial``
  (each rank's float32 GEMM of its K half, rounded to the output dtype, summed by DTensor's
  all-reduce in rank order); the bias (``Replicate``) is added after that sum, not in the GEMM's
  epilogue as in one process;
* a ``Replicate`` weight (e.g. ``SequenceParallel`` neighbours): the plain GEMM on every rank.

Scales are global, as Transformer Engine's are under tensor parallelism: the FP8 state's amax
reduction (:class:`~fp8sim.training.fp8_state.Fp8State`; by default MAX over every rank of the
default process group) makes the amax of a sharded input, weight or output gradient the full
tensor's, so every shard is cast with the one scale a single process would use and the codes of
the shards are the slices of the single-process codes. Block scales (row, ``blocks(R, C)``, MX,
NVFP4 blocks) stay local, which is exact when the shard boundaries fall on block boundaries
(checked: a K shard must be a multiple of the block's width). Hugging Face ``Conv1D`` layers
(transposed weights) are not tensor-parallel.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["is_dtensor", "tensor_parallel_forward"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    if not isinstance(t, torch.Tensor) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def tensor_parallel_forward(layer: Any, x: torch.Tensor,
                            run_local: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
    """``layer``'s forward with a DTensor weight: ``run_local(x_local, w_local, b_local)`` on the
    shards, the result wrapped as the DTensor the style expects (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    w = layer.weight
    mesh = w.device_mesh
    name = getattr(layer, "name", type(layer).__name__)
    if mesh.ndim != 1:
        raise ValueError(f"{name}: a tensor-parallel FP8 linear needs its weight on a 1-D mesh (FSDP2 gathers the "
                         f"data-parallel dimension before the forward), got a {mesh.ndim}-D mesh")
    if getattr(layer, "transposed", False):
        raise ValueError(f"{name}: Hugging Face Conv1D layers (transposed weights) are not tensor-parallel")
    (wp,) = w.placements
    if wp.is_shard(0):
        style, want_x, out_pl = "colwise", Replicate(), Shard(-1)
    elif wp.is_shard(1):
        style, want_x, out_pl = "rowwise", Shard(-1), Partial()
    elif wp.is_replicate():
        style, want_x, out_pl = "replicate", Replicate(), Replicate()
    else:
        raise ValueError(f"{name}: weight placement {wp} is not a tensor-parallel style (Shard(0), Shard(1) or "
                         "Replicate)")
    if not isinstance(x, DTensor):
        raise ValueError(f"{name}: the weight is a DTensor but the input is a plain tensor; parallelize the layer "
                         "with parallelize_module (ColwiseParallel / RowwiseParallel place its input)")
    if style != "replicate":
        _check_block_alignment(layer, style, w.to_local().shape[1 if style == "rowwise" else 0])
    if tuple(x.placements) != (want_x,):
        x = x.redistribute(mesh, [want_x])
    # colwise: each rank's dX = dY_local W_local is a partial sum over the ranks
    x_local = x.to_local(grad_placements=[Partial()] if style == "colwise" else None)
    bias = layer.bias
    local_bias = bias.to_local() if (bias is not None and style != "rowwise") else None
    y = DTensor.from_local(run_local(x_local, w.to_local(), local_bias), mesh, [out_pl], run_check=False)
    if style == "rowwise" and bias is not None:
        y = y.redistribute(mesh, [Replicate()]) + bias  # the bias once, after the partial sums
    return y


def _check_block_alignment(layer: Any, style: str, local: int) -> None:
    """A shard (K columns of a row-wise, N rows of a column-wise layer) must hold whole scaling
    blocks of every cast that runs along or across it; tensor scaling has no blocks."""
    for role, cast in layer.state.casts.items():
        g = cast.granularity
        size = 32 if g.kind == "mx" else (max(g.block) if g.block is not None else 0)
        if size > 1 and local % size:
            what = "K = {} columns".format(local) if style == "rowwise" else "N = {} rows".format(local)
            raise ValueError(f"{layer.name}: {style} tensor parallelism gives each rank {what}, not a multiple of the "
                             f"{role} cast's {g.spec} blocks ({size}): blocks would straddle ranks")
