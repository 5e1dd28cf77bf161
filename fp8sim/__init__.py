"""fp8sim: bit-exact FP8 (and narrow float) emulation, scaling, analysis and FP8 training.

The emulator is the oracle::

    import fp8sim
    fmt = fp8sim.get_format("e4m3")
    codes = fp8sim.encode(x, fmt, rounding="rne", saturate=True)
    values = fp8sim.decode(codes, fmt)
"""

from fp8sim.emulator import ROUNDING_MODES, decode, encode, quantize
from fp8sim.formats import FloatFormat, get_format, list_formats

__all__ = [
    "FloatFormat",
    "get_format",
    "list_formats",
    "encode",
    "decode",
    "quantize",
    "ROUNDING_MODES",
]
__version__ = "0.1.0"
