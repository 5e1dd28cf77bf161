"""Private numba plumbing shared by fp8sim's kernels: compile flags (:mod:`.jit`), float32 bit
casts and 32-bit integer lanes (:mod:`.bitcast`), the emulator's encode/decode kernels
(:mod:`.encode_core`). Modules outside this package import these helpers from here and from
nowhere else private; nothing here is public API.
"""
