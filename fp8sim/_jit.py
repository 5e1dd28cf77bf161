"""numba compile flags, in one place.

Bit-exact code never uses ``fastmath``: it would let LLVM reassociate and flush subnormals.
``cache=True`` keeps compiled kernels on disk (``__pycache__``) so a second process starts fast.
"""

from __future__ import annotations

import numba

__all__ = ["jit_scalar", "jit_kernel", "jit_serial"]

_COMMON = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")

#: small scalar helpers, inlined by LLVM into the kernels that call them
jit_scalar = numba.njit(**_COMMON)
#: array kernels that split a flat loop over threads with ``prange`` (disjoint writes only)
jit_kernel = numba.njit(parallel=True, **_COMMON)
#: serial array kernels (reductions whose order must be fixed)
jit_serial = numba.njit(**_COMMON)
