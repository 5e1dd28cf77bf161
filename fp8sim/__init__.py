"""fp8sim: bit-exact FP8 (and narrow float) emulation, scaling, analysis and FP8 training.

The emulator is the oracle::

    import fp8sim
    fmt = fp8sim.get_format("e4m3")
    codes = fp8sim.encode(x, fmt, rounding="rne", saturate=True)
    values = fp8sim.decode(codes, fmt)

The names below are imported on first use (PEP 562), so ``import fp8sim`` -- and ``fp8sim
--help`` -- does not compile or load numba until an emulator function is called for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8sim.lazy_exports import lazy_attributes

#: public name -> the module that defines it
_EXPORTS = {
    "FloatFormat": "fp8sim.formats",
    "get_format": "fp8sim.formats",
    "list_formats": "fp8sim.formats",
    "encode": "fp8sim.emulator",
    "decode": "fp8sim.emulator",
    "quantize": "fp8sim.emulator",
    "ROUNDING_MODES": "fp8sim.formats",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports
    from fp8sim.emulator import decode, encode, quantize
    from fp8sim.formats import ROUNDING_MODES, FloatFormat, get_format, list_formats


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
