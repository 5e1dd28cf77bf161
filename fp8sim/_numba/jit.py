"""numba compile flags, in one place.

Bit-exact code never uses ``fastmath``: it would let LLVM reassociate and flush subnormals.
``cache=True`` keeps compiled kernels on disk (``__pycache__``) so a second process starts fast.
"""

from __future__ import annotations

import numba

__all__ = ["jit_scalar", "jit_inline", "jit_kernel", "jit_serial", "serial_twin", "PARALLEL_MIN_ELEMENTS"]

_COMMON = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")

#: small scalar helpers, inlined by LLVM into the kernels that call them
jit_scalar = numba.njit(**_COMMON)
#: small scalar helpers inlined by numba itself (IR level) into their callers, for hot loops
#: where LLVM would otherwise keep a call that stops vectorization
jit_inline = numba.njit(inline="always", **_COMMON)
#: array kernels that split a flat loop over threads with ``prange`` (disjoint writes only)
jit_kernel = numba.njit(parallel=True, **_COMMON)
#: serial array kernels (reductions whose order must be fixed)
jit_serial = numba.njit(**_COMMON)


#: below this many elements the serial twin of a parallel kernel runs: waking the thread pool
#: costs more than it saves (and far more on an oversubscribed machine)
PARALLEL_MIN_ELEMENTS = 1 << 17


def serial_twin(kernel):
    """A serial (single-thread) compilation of a ``jit_kernel`` function, cached on its own.

    ``prange`` runs as ``range``. The twin gets its own qualified name so numba's on-disk cache
    (keyed by name and signature, not by the parallel flag) keeps the two apart.
    """
    import types

    fn = kernel.py_func
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial",
                              fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    twin.__doc__ = fn.__doc__
    return jit_serial(twin)
