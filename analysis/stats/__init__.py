"""Single-pass FP8 statistics of a tensor under several formats x scalings (see
:mod:`fp8sim.analysis.stats.figures` for the figures and how they are computed).

Modules: :mod:`.figures` (variants, results, :func:`tensor_stats`), :mod:`.passes` (the numba
passes over a chunk), :mod:`.blocks` (the per-block kernels: the one cast implementation).
"""

from fp8sim.analysis.stats.figures import (
    DEFAULT_CHUNK,
    IN_MEMORY_CHUNK,
    LOG2_EXPONENTS,
    TensorStats,
    Variant,
    VariantStats,
    parse_variants,
    sqnr_case,
    tensor_stats,
)

__all__ = [
    "Variant",
    "VariantStats",
    "TensorStats",
    "parse_variants",
    "tensor_stats",
    "sqnr_case",
    "LOG2_EXPONENTS",
    "DEFAULT_CHUNK",
    "IN_MEMORY_CHUNK",
]
