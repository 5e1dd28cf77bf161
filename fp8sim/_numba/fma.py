"""``square_add(d, s) = d * d + s`` for a float32-valued ``d``, in one fused multiply-add where
the CPU has one (LLVM's ``llvm.fma.f64``), else a multiply and an add: the same value either
way, because the square of a float32 is exact in float64 (24-bit significand squared: at most 48
bits; exponents within float64's range), so rounding the fused sum once equals rounding the
exact square's sum. Kernels that sum squared float32 errors use it to save an operation per
pair of terms without changing a bit of the result.
"""

from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, config, types
from numba.extending import intrinsic

__all__ = ["square_add", "HAS_FMA"]


def _target_has_fma() -> bool:
    """Whether the CPU numba compiles for has FMA: the features numba itself uses
    (``NUMBA_CPU_FEATURES`` when set, else the host's); unknown counts as no."""
    try:
        features = config.CPU_FEATURES
        if features is None:
            features = llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # features unknown: the unfused form is always right
        return False
    return "+fma" in features.split(",")


#: whether ``square_add`` compiles to a fused multiply-add (else it would be a libm call)
HAS_FMA = _target_has_fma()


@intrinsic
def square_add(typingctx, d, s):
    """``d * d + s`` in float64 (``d`` a float32 value, widened exactly): see the module
    docstring for why the fused and unfused forms agree."""
    if not (d == types.float32 and isinstance(s, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        f64 = ir.DoubleType()
        dd, ss = (context.cast(builder, v, t, types.float64) for v, t in zip(args, sig.args))
        if HAS_FMA:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f64, [f64] * 3),
                                                "llvm.fma.f64")  # fmt: skip
            return builder.call(fn, [dd, dd, ss])
        return builder.fadd(builder.fmul(dd, dd), ss)

    return types.float64(d, s), codegen
