"""float32 <-> uint32 bit casts usable inside numba kernels (LLVM ``bitcast``, no memory trip).

numba has no scalar ``view``; these intrinsics let branch-free loops work on float32 bit
patterns in 32-bit lanes (the emulator's float32 RNE encode, the analysis cast figures).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

__all__ = ["f32_bits", "bits_f32"]


@intrinsic
def f32_bits(typingctx, x):
    """The uint32 bit pattern of a float32."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):
    """The float32 with bit pattern ``u`` (the low 32 bits of an integer)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen
