"""Scale grids of quantized checkpoint tensors, read range by range, never loaded whole.

A quantized tensor of logical shape ``(..., M, N)`` is dequantized with one factor per group of
``R x C`` elements: the factors form a grid of ``lead x ceil(M / R)`` rows and ``ceil(N / C)``
columns (rows over the leading dimensions, e.g. stacked experts), stored as a companion tensor in
the checkpoint. A grid is decoded here from the companion's file range by range, as the values it
scales are read (:class:`~.fp8_scales.ScaledSource` asks for the grid entries of each chunk), so
resident memory follows the chunk, not the checkpoint: an NVFP4 weight of 9.2 G elements has a
grid of 575 M factors (2.3 GB as float32), of which a 1 M-element chunk needs 64 K.

Decodes (the factor multiplies the decoded element code in float32, or float64 for a float64
companion with a dimension -- see :mod:`.fp8_scales`):

* :class:`CompanionGrid` ``float``: the companion's values as they are (float16/bfloat16/float32/
  float64/FP8 companions of FP8 tensors);
* :class:`CompanionGrid` ``e8m0``: E8M0 exponent codes (safetensors ``F8_E8M0``, or uint8 as MX
  checkpoints store them), ``2 ** (code - 127)`` through fp8sim's own E8M0 decode table; the
  code 0xFF is NaN, as the OCP MX spec defines it (compressed-tensors 0.20 and ModelOpt decode it
  as ``2 ** 128`` = inf; those blocks are counted apart, :attr:`GridCensus.e8m0_nan`);
* :class:`NVFP4Grid`: NVFP4's two-level factor ``float32(b / G)`` or ``float32(b * scale_2)``
  (:func:`fp8sim.nvfp4.block_decode_scale`) from the E4M3 block scale ``b`` and the per-tensor
  scale of the entry's leading index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8sim.analysis.dumps.core import TensorSource

__all__ = ["GRID_CHUNK", "GridCensus", "ScaleGrid", "CompanionGrid", "NVFP4Grid"]

#: grid entries decoded at a time by :meth:`ScaleGrid.census` (4 MiB of float32)
GRID_CHUNK = 1 << 20
#: the E8M0 code the OCP MX spec makes NaN (2 ** 128 in compressed-tensors and ModelOpt)
E8M0_NAN_CODE = 0xFF


@dataclass(frozen=True)
class GridCensus:
    """Counts over a whole grid: ``non_finite`` (NaN or inf factors), ``non_positive`` (zero or
    negative), ``e8m0_nan`` (E8M0 codes 0xFF, among the non-finite)."""

    non_finite: int = 0
    non_positive: int = 0
    e8m0_nan: int = 0


@dataclass
class ScaleGrid:
    """A ``(rows, cols)`` grid of factors in flat C order; subclasses decode entries
    ``[lo, hi)`` in :meth:`_decode`. The last range read is kept: consecutive chunks of a tensor
    with tall blocks (128 x 128) ask for the same grid row again."""

    rows: int
    cols: int
    dtype: Any = np.float32
    _last: tuple = field(default=(0, 0, None), repr=False)

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Factors ``[lo, hi)`` of the flat grid (float32, or float64 for a float64 companion)."""
        a, b, vals = self._last
        if vals is not None and a <= lo and hi <= b:
            return vals[lo - a : hi - a]
        vals = self._decode(lo, hi)
        self._last = (lo, hi, vals)
        return vals

    def _decode(self, lo: int, hi: int) -> np.ndarray:
        raise NotImplementedError

    def _e8m0_nan(self, lo: int, hi: int) -> int:
        return 0

    def census(self) -> GridCensus:
        """Counts over the whole grid, decoded :data:`GRID_CHUNK` entries at a time (the grid's
        data read once, in order)."""
        bad = nonpos = nan = 0
        for lo in range(0, self.size, GRID_CHUNK):
            hi = min(self.size, lo + GRID_CHUNK)
            v = self._decode(lo, hi)
            with np.errstate(invalid="ignore"):
                bad += int((~np.isfinite(v)).sum())
                nonpos += int((v <= 0).sum())
            nan += self._e8m0_nan(lo, hi)
        return GridCensus(bad, nonpos, nan)


def _raw_codes(src: TensorSource, lo: int, hi: int) -> np.ndarray:
    """uint8 codes ``[lo, hi)`` of a one-byte companion (E4M3, E8M0, uint8)."""
    return np.asarray(src.read_raw(lo, hi)).view(np.uint8)


@dataclass
class CompanionGrid(ScaleGrid):
    """The factors of a companion tensor whose flat order is the grid's (``source``), decoded as
    ``decode`` says: ``float`` (its values; float64 kept for a float64 companion with a
    dimension, as torch's ``q.float() * s`` computes) or ``e8m0`` (E8M0 exponent codes)."""

    source: TensorSource = None
    decode: str = "float"

    def _decode(self, lo: int, hi: int) -> np.ndarray:
        if self.decode == "e8m0":
            from fp8sim.emulator import decode_table

            return decode_table("e8m0", np.float32)[_raw_codes(self.source, lo, hi)]
        v = self.source.read(lo, hi)
        return v if v.dtype == self.dtype else v.astype(self.dtype)

    def _e8m0_nan(self, lo: int, hi: int) -> int:
        if self.decode != "e8m0":
            return 0
        return int((_raw_codes(self.source, lo, hi) == E8M0_NAN_CODE).sum())


def companion_grid(src: TensorSource, rows: int, cols: int, decode: str = "float") -> CompanionGrid:
    """The grid of companion ``src`` as ``rows x cols`` factors: float32, or float64 for a
    float64 companion with a dimension (a 0-dim float64 scale is cast to float32, as torch
    does)."""
    wide = decode == "float" and src.dtype == "float64" and tuple(src.shape) != ()
    return CompanionGrid(rows, cols, np.float64 if wide else np.float32, source=src, decode=decode)


@dataclass
class NVFP4Grid(ScaleGrid):
    """NVFP4 factors: E4M3 block scales ``block`` (flat order = the grid's), one per-tensor scale
    per leading index (``tensor_scales``, float32; one entry for all), each covering
    ``per_lead`` grid entries; ``variant`` the :func:`fp8sim.nvfp4.block_decode_scale` rule."""

    block: TensorSource = None
    tensor_scales: np.ndarray = None
    per_lead: int = 1
    variant: str = "compressed-tensors"

    def _decode(self, lo: int, hi: int) -> np.ndarray:
        from fp8sim.emulator import decode_table
        from fp8sim.nvfp4 import block_decode_scale

        b = decode_table("e4m3", np.float32)[_raw_codes(self.block, lo, hi)]
        out = np.empty(hi - lo, np.float32)
        t = self.tensor_scales.reshape(-1)
        pos = lo
        while pos < hi:  # one piece per leading index the range touches
            k = pos // self.per_lead if t.size > 1 else 0
            end = min(hi, (pos // self.per_lead + 1) * self.per_lead)
            out[pos - lo : end - lo] = block_decode_scale(b[pos - lo : end - lo], t[k], self.variant)
            pos = end
        return out
