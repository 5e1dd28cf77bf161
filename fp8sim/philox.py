"""Philox4x32-10 counter-based random numbers, bit-identical to ``triton.language.randint``.

``tl.randint(seed, offsets)`` returns the first word of Philox4x32 with 10 rounds, keyed by the
64-bit ``seed`` (low word k0, high word k1) with counter ``(offset as uint32, 0, 0, 0)``.
The emulator's stochastic rounding draws ``randint(seed, flat_index)`` per element, so a Triton
kernel using ``tl.randint(seed, offsets)`` with the same flat offsets makes the same decisions.

Reference: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11).
"""

from __future__ import annotations

import numba
import numpy as np

from fp8sim._numba.jit import jit_inline, jit_kernel

__all__ = ["randint", "randint_scalar", "seed_words"]

_M32 = np.uint64(0xFFFFFFFF)
_KEY_A = 0x9E3779B9  # golden ratio
_KEY_B = 0xBB67AE85  # sqrt(3) - 1
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57


@jit_inline
def randint_scalar(k0, k1, offset):
    """``tl.randint(seed, offset)`` for one offset; the seed given as its two 32-bit words.

    Philox4x32 with 10 rounds, counter ``(offset mod 2**32, 0, 0, 0)``, key ``(k0, k1)``; only
    the first output word is kept. Inlined (numba IR level) so that loops calling it unroll and
    vectorize. The tests hold it to Triton's own stream in the interpreter.
    """
    c0 = np.uint64(offset) & _M32
    c1 = np.uint64(0)
    c2 = np.uint64(0)
    c3 = np.uint64(0)
    a = np.uint64(k0) & _M32
    b = np.uint64(k1) & _M32
    for _ in range(10):
        p0 = np.uint64(_ROUND_A) * c0
        p2 = np.uint64(_ROUND_B) * c2
        n0 = ((p2 >> np.uint64(32)) ^ c1 ^ a) & _M32
        n2 = ((p0 >> np.uint64(32)) ^ c3 ^ b) & _M32
        c1 = p2 & _M32
        c3 = p0 & _M32
        c0 = n0
        c2 = n2
        a = (a + np.uint64(_KEY_A)) & _M32
        b = (b + np.uint64(_KEY_B)) & _M32
    return c0


@jit_kernel
def _randint_kernel(k0, k1, offsets, out):
    for i in numba.prange(offsets.size):
        out[i] = randint_scalar(k0, k1, offsets[i])


def seed_words(seed: int) -> tuple[int, int]:
    """Split a seed into Philox key words (low, high) as Triton does (seed as uint64)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s & 0xFFFFFFFF, s >> 32


def randint(seed: int, offsets) -> np.ndarray:
    """uint32 array equal to ``tl.randint(seed, offsets)`` (offsets taken modulo 2**32)."""
    k0, k1 = seed_words(seed)
    offs = np.ascontiguousarray(np.asarray(offsets).astype(np.int64).ravel() & 0xFFFFFFFF)
    out = np.empty(offs.size, dtype=np.uint32)
    _randint_kernel(np.uint64(k0), np.uint64(k1), offs, out)
    return out.reshape(np.shape(offsets))
