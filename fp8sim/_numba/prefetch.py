"""A software prefetch usable inside numba kernels (LLVM's ``llvm.prefetch``).

A kernel that reads a block in an order the hardware prefetcher does not follow (several
streams side by side, each shorter than the prefetcher needs to train) asks for the next
block's cache lines ahead of time instead. A prefetch is a hint: it never faults and changes no
value, so an address past the end of the array is harmless (callers clamp anyway).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["prefetch"]


@intrinsic
def prefetch(typingctx, arr, idx):
    """Prefetch the cache line holding ``arr[idx]`` (a 1-D array) into every cache level, for
    reading (``llvm.prefetch``: rw 0, locality 3, data cache)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        index = context.cast(builder, args[1], sig.args[1], types.int64)
        ptr = cgutils.get_item_pointer2(context, builder, data=ary.data,
                                        shape=cgutils.unpack_tuple(builder, ary.shape, 1),
                                        strides=cgutils.unpack_tuple(builder, ary.strides, 1),
                                        layout=aryty.layout, inds=[index], wraparound=False)  # fmt: skip
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(arr, idx), codegen
