"""Tensor dumps, opened safely and lazily (see :mod:`fp8sim.analysis.dumps.core` for the rules):
which files are read (:mod:`.inputs`), the containers (:mod:`.core`: .npy, .npz, traces and the
dispatch; :mod:`.safetensors_reader`, :mod:`.torch_reader`; strided copies in :mod:`.strided`),
FP8 tensors dequantized with their companion scales (:mod:`.fp8_scales`, whose lookups are in
:mod:`.fp8_companions`), packed NVFP4 weights with their two scales too (:mod:`.fp4_scales`), MX
weights with their E8M0 scales (:mod:`.mx_scales`), the scale grids read per chunk
(:mod:`.scale_grids`), and arrays or tensors already in memory (:mod:`.in_memory`).
"""

from fp8sim.analysis.dumps.core import (
    DUMP_SUFFIXES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    Dump,
    TensorSource,
    expand_paths,
    iter_dumps,
    open_dump,
)
from fp8sim.analysis.dumps.fp8_scales import (
    DEFAULT_BLOCK,
    SCALE_SUFFIXES,
    ScaledSource,
    link_fp8_scales,
    parse_block,
)
from fp8sim.analysis.dumps.in_memory import is_in_memory, memory_dump
from fp8sim.analysis.dumps.inputs import each_file_once, require_regular_file

__all__ = [
    "TensorSource",
    "Dump",
    "open_dump",
    "expand_paths",
    "iter_dumps",
    "DUMP_SUFFIXES",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "ScaledSource",
    "link_fp8_scales",
    "parse_block",
    "SCALE_SUFFIXES",
    "DEFAULT_BLOCK",
    "each_file_once",
    "require_regular_file",
    "memory_dump",
    "is_in_memory",
]
