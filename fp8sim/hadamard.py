"""The Random Hadamard Transform (RHT) of NVFP4 training, with a fixed float32 operation order.

``rht(x, axis, signs)`` splits ``axis`` into groups of 16 consecutive elements and maps each
group ``x`` (16 values) to ``y = (H / 4) @ (s * x)``, where ``H`` is the 16x16 Sylvester
Hadamard matrix (``H[i, j] = (-1) ** popcount(i & j)``, symmetric, ``H @ H = 16 I``) and ``s``
a vector of 16 signs (+-1). ``H / 4`` is orthonormal, so the transform keeps the Euclidean norm
and a GEMM whose two operands are transformed along the reduction axis with the same signs gives
the product of the untransformed operands (``(A D H/4) (H/4 D B) = A B``).

Transformer Engine applies it, as NVIDIA's NVFP4 recipe (arXiv 2509.25149, sec. 4.2) prescribes,
to both operands of the weight-gradient GEMM along the token (reduction) axis, with a fixed sign
vector (:data:`TE_RHT_SIGNS`, ``get_wgrad_sign_vector`` in Transformer Engine's
``pytorch/custom_recipes/quantization_nvfp4.py``); :func:`rht_signs` draws a seeded one instead.

Exact float32 order (the contract a GPU kernel follows to match bit for bit), per group:

1. ``v[i] = float32(x[i] * float32(s[i] * 0.25))`` -- a product by +-0.25, exact unless it
   falls below float32's normal range (then rounded to nearest even, as any IEEE multiply);
2. four butterfly stages ``h = 1, 2, 4, 8``: for every ``j`` with ``j & h == 0``,
   ``(v[j], v[j + h]) = (float32(v[j] + v[j + h]), float32(v[j] - v[j + h]))``, each add rounded
   to nearest even (an overflow gives +-inf, a NaN spreads to the whole group);
3. ``y = v``.

The inverse (``inverse=True``) runs steps 1-2 with ``s = +1`` and then multiplies by the signs:
``x = s * ((H / 4) @ y)``. Transformer Engine's reference computes ``x @ (diag(s) H / 4)`` with a
float32 matmul, the same value in exact arithmetic; its summation order is the GEMM's, so it may
differ from the order above in the last bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fp8sim.emulator import as_float_array
from fp8sim.philox import randint

__all__ = ["RHT_SIZE", "TE_RHT_SIGNS", "hadamard_matrix", "rht_signs", "check_signs", "rht"]

RHT_SIZE = 16
#: Transformer Engine 2.x's fixed weight-gradient sign vector (``get_wgrad_sign_vector``)
TE_RHT_SIGNS = np.array(
    [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float32
)
TE_RHT_SIGNS.setflags(write=False)


def hadamard_matrix(n: int = RHT_SIZE) -> np.ndarray:
    """The ``n x n`` Sylvester Hadamard matrix (entries +-1, float32), ``n`` a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0).astype(np.float32)


def rht_signs(seed: int) -> np.ndarray:
    """16 signs drawn from the Philox stream of :func:`fp8sim.philox.randint`: ``s[i] = -1``
    where the top bit of ``randint(seed, i)`` is set, else ``+1`` (float32). A Triton kernel
    gets the same vector from ``tl.randint(seed, tl.arange(0, 16))``."""
    r = randint(seed, np.arange(RHT_SIZE))
    return np.where(r >= np.uint32(1 << 31), -1.0, 1.0).astype(np.float32)


def check_signs(signs: Any) -> np.ndarray:
    """``signs`` as a float32 vector of 16 values +-1: an int is a seed (:func:`rht_signs`),
    ``"te"`` is :data:`TE_RHT_SIGNS`, anything else must be 16 values each +1 or -1."""
    if isinstance(signs, str):
        if signs.lower() != "te":
            raise ValueError(f"rht: signs must be 'te', a seed or 16 values +-1, got {signs!r}")
        return TE_RHT_SIGNS
    if isinstance(signs, (int, np.integer)) and not isinstance(signs, (bool, np.bool_)):
        return rht_signs(int(signs))
    s = np.asarray(signs, dtype=np.float32).reshape(-1)
    if s.size != RHT_SIZE or not np.all(np.abs(s) == 1):
        raise ValueError(f"rht: signs must be {RHT_SIZE} values, each +1 or -1")
    return s


def _butterflies(v: np.ndarray) -> np.ndarray:
    """The four stages h = 1, 2, 4, 8 over the last axis (16), each add rounded in float32."""
    lead = v.shape[:-1]
    for h in (1, 2, 4, 8):
        w = v.reshape(*lead, RHT_SIZE // (2 * h), 2, h)
        a, b = w[..., 0, :], w[..., 1, :]
        v = np.stack([a + b, a - b], axis=-2).reshape(*lead, RHT_SIZE)
    return v


def rht(x: Any, axis: int = -1, signs: Any = "te", *, inverse: bool = False) -> np.ndarray:
    """The Random Hadamard Transform of ``x`` along ``axis`` in groups of 16 (module docstring).

    ``x``: any float array (or CPU torch tensor), taken to float32 first; ``axis`` must have a
    length divisible by 16 (ValueError otherwise: a ragged group has no orthogonal transform).
    ``signs``: ``"te"`` (Transformer Engine's fixed vector), an int seed, or 16 values +-1.
    Returns a new float32 numpy array of ``x``'s shape.
    """
    arr, _ = as_float_array(x)
    with np.errstate(over="ignore"):
        x32 = np.asarray(arr, dtype=np.float32)
    if x32.ndim == 0:
        raise ValueError("rht: x must have at least one axis")
    ax = axis % x32.ndim if -x32.ndim <= axis < x32.ndim else None
    if ax is None:
        raise ValueError(f"rht: axis {axis} is out of range for a {x32.ndim}-D array")
    n = x32.shape[ax]
    if n % RHT_SIZE:
        raise ValueError(f"rht: the length of axis {axis} ({n}) must be a multiple of {RHT_SIZE}")
    s = check_signs(signs)
    moved = np.moveaxis(x32, ax, -1)
    groups = moved.reshape(*moved.shape[:-1], n // RHT_SIZE, RHT_SIZE)
    quarter = np.float32(0.25)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if inverse:
            v = _butterflies((groups * quarter).astype(np.float32))
            v = (v * s).astype(np.float32)
        else:
            v = _butterflies((groups * (s * quarter)).astype(np.float32))
    out = v.reshape(moved.shape)
    return np.ascontiguousarray(np.moveaxis(out, -1, ax))
