"""The casts and GEMMs of one FP8 linear ``y = x W^T + b`` on an :class:`Fp8State`, shared by
:class:`~fp8sim.training.fp8_linear.Fp8Linear`'s custom ops and the MoE experts' grouped ops
(:mod:`fp8sim.training.experts`: one linear per expert, their GEMMs in one grouped GEMM).

* :func:`forward` casts X (M, K) and W (N, K) for ``Y = X W^T`` and says what the backward needs
  (:func:`saves_codes`): the FP8 X and W with their scales, or the float32 X and W (re-cast along
  the other axis, or kept high precision for a GEMM the recipe runs so);
* :func:`backward` casts dY (M, N) and gives ``dX = dY W`` and ``dW = dY^T X``;
* :func:`run` runs a list of :class:`Gemm` (FP8 ones through :meth:`Fp8State.grouped_gemm`);
* :func:`cast_weight_grad` casts the weight gradient itself (FP8-LM O1).

Tensor names: ``{name}.input``, ``{name}.weight``, ``{name}.grad_output``, ``{name}.weight_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp8sim.quantizer import QuantizedTensor
from fp8sim.training.forward_calls import ForwardCall
from fp8sim.training.fp8_state import Fp8State

__all__ = ["Gemm", "saves_codes", "saved_specs", "forward", "backward", "run", "cast_weight_grad", "tensor_names"]

ROLES = ("input", "weight", "grad_output", "weight_grad")


def tensor_names(name: str) -> set[str]:
    """The names of linear ``name``'s tensors in the policies and traces."""
    return {f"{name}.{r}" for r in ROLES}


@dataclass
class Gemm:
    """One GEMM ``A B^T``: FP8 operands (:class:`~fp8sim.quantizer.QuantizedTensor` ``a`` (M, K),
    ``b`` (N, K)) or, for a GEMM the recipe keeps in high precision (``fp8=False``), float32
    tensors ``a`` (M, K) and ``b`` (N, K) (views: ``a @ b.t()`` is the plain float32 matmul)."""

    a: Any
    b: Any
    fp8: bool = True


def saves_codes(state: Fp8State) -> bool:
    """Whether the forward saves the FP8 X and W for the backward (tensor scaling with both
    backward GEMMs in FP8), else the float32 X and W."""
    gemms = state.recipe.gemms
    return (state.casts["activation"].granularity.kind == "tensor" and gemms.dgrad and gemms.wgrad
            and state.recipe.weight_dgrad is None)


def saved_specs(state: Fp8State, m: int, k: int, n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of what :func:`forward` saves for an (M, K) x (N, K) linear: codes +
    scale of X and of W, or the float32 X and W (and two empty placeholders)."""
    if saves_codes(state):
        return [((m, k), torch.uint8), ((), torch.float32), ((n, k), torch.uint8), ((), torch.float32)]
    return [((m, k), torch.float32), ((0,), torch.float32), ((n, k), torch.float32), ((0,), torch.float32)]


def forward(state: Fp8State, name: str, x: torch.Tensor, w: torch.Tensor, *, observe: bool,
            call: ForwardCall | None, expert: int | None = None) -> tuple[Gemm, tuple[torch.Tensor, ...]]:
    """The forward GEMM of linear ``name`` on float32 ``x`` (M, K) and ``w`` (N, K), and the four
    tensors its backward needs (:func:`saved_specs`). ``observe``/``call``: see
    :meth:`Fp8State.cast`."""
    xq = state.cast(f"{name}.input", "activation", x, observe=observe, call=call, expert=expert)
    wq = state.cast(f"{name}.weight", "weight", w, observe=observe, call=call, expert=expert)
    gemm = Gemm(xq, wq) if state.recipe.gemms.fprop else Gemm(x, w, fp8=False)
    if saves_codes(state):  # the codes and the scales they were cast with (scale_inv = 1 / scale, as the cast's)
        return gemm, (xq.codes, xq.scale, wq.codes, wq.scale)
    empty = torch.zeros(0, dtype=torch.float32, device=x.device)
    return gemm, (x, empty, w, empty.clone())  # blocks are re-cast along the other axis in backward


def backward(state: Fp8State, name: str, gy: torch.Tensor, saved: tuple[torch.Tensor, ...], *, observe: bool,
             expert: int | None = None) -> tuple[Gemm, Gemm]:
    """The backward GEMMs ``dX = dY W`` and ``dW = dY^T X`` of linear ``name`` on the float32
    output gradient ``gy`` (M, N) and what :func:`forward` saved."""
    s0, s1, s2, s3 = saved
    casts, gemms = state.casts, state.recipe.gemms
    gq = state.cast(f"{name}.grad_output", "grad_output", gy, observe=observe, expert=expert)
    if s0.dtype == torch.uint8:  # tensor scaling: the FP8 X and W of the forward
        xq = QuantizedTensor(s0, torch.reciprocal(s1), casts["activation"].fmt, casts["activation"].granularity,
                             scale=s1)  # fmt: skip
        wq = QuantizedTensor(s2, torch.reciprocal(s3), casts["weight"].fmt, casts["weight"].granularity, scale=s3)
        return Gemm(gq, wq.t()), Gemm(gq.t(), xq.t())  # (M, N) x (N, K); (N, M) x (M, K)
    x, w = s0, s2  # each GEMM's operands along its reduction axis, cast from the high-precision tensors
    w_role = "weight_dgrad" if "weight_dgrad" in state.quantizers else "weight"
    w_gran = state.quantizers[w_role].granularity
    if not gemms.dgrad:
        dx = Gemm(gy, w.t(), fp8=False)
    elif w_gran.kind == "tensor" or (w_gran.block is not None and w_gran.block[0] == w_gran.block[1]):
        # one scale or square tiles: the cast of W (the forward's, for the same role), transposed
        dx = Gemm(gq, state.cast(f"{name}.weight", w_role, w, observe=False).t())
    else:
        dx = Gemm(gq, state.cast(f"{name}.weight", w_role, w.t().contiguous(), observe=False))
    if not gemms.wgrad:
        return dx, Gemm(gy.t(), x.t(), fp8=False)
    # the weight-gradient operands, reduced along the tokens: (N, M) and (K, M)
    gt = state.cast(f"{name}.grad_output", "grad_output", gy.t().contiguous(), observe=False, wgrad=True)
    xt = state.cast(f"{name}.input", "activation", x.t().contiguous(), observe=False, wgrad=True)
    return dx, Gemm(gt, xt)


def run(state: Fp8State, gemms: list[Gemm]) -> list[torch.Tensor]:
    """The float32 products ``A B^T`` of ``gemms``, in order: the FP8 ones in one
    :meth:`Fp8State.grouped_gemm` (one GEMM per entry on its own scales), the others as float32
    matmuls."""
    fp8 = [g for g in gemms if g.fp8]
    out = iter(state.grouped_gemm([g.a for g in fp8], [g.b for g in fp8]) if fp8 else ())
    return [next(out) if g.fp8 else g.a @ g.b.t() for g in gemms]


def cast_weight_grad(state: Fp8State, name: str, dw: torch.Tensor, *, observe: bool,
                     expert: int | None = None) -> torch.Tensor:
    """``dw`` as the recipe leaves it: cast to FP8 and back where it casts weight gradients
    (FP8-LM O1: the weight gradient travels in FP8), else unchanged."""
    if "weight_grad" not in state.casts:
        return dw
    return state.backend.to_float(state.cast(f"{name}.weight_grad", "weight_grad", dw, observe=observe, expert=expert))
