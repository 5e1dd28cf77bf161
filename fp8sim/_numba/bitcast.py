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


# ------------------------------------------------------------------------------------------
# 32-bit integer lanes: numba widens uint32 arithmetic to 64 bits (its integer typing rule),
# which halves the vector lanes of a loop; these stay in i32 (wrapping, like C's uint32_t)
# ------------------------------------------------------------------------------------------
def _u32_binop(op_name: str, doc: str):
    def _as_i32(builder, ty, v):
        i32 = ir.IntType(32)
        if isinstance(ty, types.Boolean):
            return builder.zext(v, i32) if v.type.width < 32 else builder.trunc(v, i32)
        if ty.bitwidth > 32:
            return builder.trunc(v, i32)
        if ty.bitwidth < 32:
            return builder.zext(v, i32)
        return v

    @intrinsic
    def op(typingctx, a, b):
        if not all(isinstance(t, (types.Integer, types.Boolean)) for t in (a, b)):
            return None

        def codegen(context, builder, sig, args):
            x, y = (_as_i32(builder, t, v) for t, v in zip((a, b), args))
            return getattr(builder, op_name)(x, y)

        return types.uint32(a, b), codegen

    op.__doc__ = doc
    return op


add32 = _u32_binop("add", "``(a + b) mod 2**32`` (uint32; a bool counts as 0/1).")
sub32 = _u32_binop("sub", "``(a - b) mod 2**32`` (uint32).")
and32 = _u32_binop("and_", "``a & b`` in 32 bits (uint32).")
or32 = _u32_binop("or_", "``a | b`` in 32 bits (uint32).")
shr32 = _u32_binop("lshr", "``a >> b``, logical, in 32 bits (uint32; b < 32).")
shl32 = _u32_binop("shl", "``(a << b) mod 2**32`` (uint32; b < 32).")
__all__ += ["add32", "sub32", "and32", "or32", "shr32", "shl32"]
