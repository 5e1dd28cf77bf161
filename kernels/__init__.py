"""Triton kernels, bit-exact to the emulator: on a GPU, or on the CPU with ``TRITON_INTERPRET=1``.

One op per module, each a private ``_x_kernel`` and a plain launcher that allocates and picks the
grid; the software cast they share lives in :mod:`fp8sim.kernels.cast`.
"""
