"""Block-level statistics of a block-scaled cast (MX, NVFP4, ``block:RxC``), per recorded tensor
and step: how the block scales are distributed and where the block recipe clips.

From a cast's own output (codes and scale grid, as the backend's ``block_quantize`` /
``nvfp4_quantize`` or an FP8 model's operand give them), computed with torch ops where the tensor
lives (:func:`block_statistics`):

* ``codes`` / ``counts``: histogram of the block scale codes -- E8M0 codes (MX: ``e + 127``,
  255 for a NaN scale), E4M3 codes (NVFP4's decoded block scales re-encoded, exact), or, for the
  float32 scales of ``block:RxC``, the scale's binade ``floor(log2 scale_inv) + 127`` (clamped to
  0..255);
* ``scale_min`` / ``scale_max`` / ``scale_std``: of the finite ``scale_inv`` values (float64; std
  over blocks, population);
* ``clipped``: values whose scaled magnitude rounds above the element format's max (round to
  nearest even) and so saturate inside their block -- the MX ``floor`` rule's clamping, NVFP4's
  subnormal block scales; ``block:RxC`` and ``mx:rceil`` scales never clip by construction; the
  values of a block whose scale is 0 are lost (``scale_underflow``), not clipped;
* ``scale_underflow``: blocks holding a nonzero value whose scale code is the smallest (E8M0
  ``2**-127``: the rule wanted a smaller one; E4M3 0: NVFP4 ``te`` loses the whole block);
  ``scale_saturated``: blocks at the largest code (E8M0 ``2**127``, E4M3 448); both 0 for
  float32 scales;
* ``nan_blocks``: blocks whose scale is NaN (the block holds a NaN or inf: its values are lost).

For MX casts, also the **block-relative histogram** ``rel``: |x| divided by ``2**floor(log2
amax_b)`` of its 32-element block (exact, in float64), over the blocks with a finite amax. Under
the OCP ``floor`` rule the block scale is ``2**(floor(log2 amax_b) - emax)``, so the overflow and
underflow counts of an ``mx`` cast in *any* element format are those of ``rel`` under the
power-of-two scale ``2**emax`` -- exact (:func:`mx_floor_counts`), except for blocks whose amax
is below ``2**-112`` (their scale would be clamped at ``2**-127``; counted in ``rel_unsafe``).
``mx:rceil``, NVFP4 and ``block:RxC`` scales depend on more than the block's binade: they are
replayed from saved full tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8sim.formats import FloatFormat, get_format
from fp8sim.trace.histogram import AbsHistogram, cast_thresholds
from fp8sim.trace.statistics import HistogramCounts, histogram_and_counts

__all__ = ["BlockStats", "block_statistics", "mx_what_if", "mx_floor_counts", "KINDS", "MX_REL_SAFE_EXPONENT"]

#: what a record's scale codes are: 1 E8M0 (MX), 2 E4M3 (NVFP4), 3 float32 binade (block:RxC)
KINDS = {"e8m0": 1, "e4m3": 2, "f32": 3}
#: blocks whose amax has a smaller binade are outside the exact MX replay (see the module docstring)
MX_REL_SAFE_EXPONENT = -112


@dataclass
class BlockStats:
    """The block statistics of one cast (see the module docstring). ``rel`` (MX only) is the
    block-relative histogram's statistics, ``rel_unsafe`` the blocks it cannot judge."""

    kind: str
    blocks: int
    codes: np.ndarray  # uint8, sorted
    counts: np.ndarray  # int64
    scale_min: float
    scale_max: float
    scale_std: float
    clipped: int
    scale_underflow: int
    scale_saturated: int
    nan_blocks: int
    rel: HistogramCounts | None = None
    rel_unsafe: int = 0

    def rel_histogram(self, mantissa_bits: int) -> AbsHistogram | None:
        if self.rel is None:
            return None
        r = self.rel
        return AbsHistogram(r.bins, r.counts, mantissa_bits, zero=r.zero, nan=r.nan, inf=r.inf)


def _expand(grid, tile: tuple[int, int], rows: int, cols: int):
    """A per-block grid spread over the (rows, cols) elements its blocks cover (edges cut)."""
    r, c = tile
    return grid.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def _block_nonzero(x, tile: tuple[int, int]):
    """Per block: whether it holds a nonzero value (NaN counts as nonzero)."""
    import torch

    rows, cols = x.shape
    r, c = tile
    pad = torch.nn.functional.pad((x != 0).to(torch.int32), (0, -cols % c, 0, -rows % r))
    return pad.reshape(pad.shape[0] // r, r, pad.shape[1] // c, c).amax(dim=(1, 3)) > 0


def _codes(kind: str, scale_inv):
    """The scale codes (int64) of a float32 scale grid, NaN scales as 255 / 0x7F."""
    import torch

    nan = torch.isnan(scale_inv)
    s = torch.where(nan, torch.ones_like(scale_inv), scale_inv)
    if kind == "e4m3":
        code = s.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)  # exact: E4M3 values
        return torch.where(nan, 0x7F, code)
    _, ex = torch.frexp(s)
    code = (ex.to(torch.int64) - 1 + 127).clamp(0, 255)
    return torch.where(nan, 255, code)


def _clipped(x, mult, div, fmt: FloatFormat, alive) -> Any:
    """Values of ``alive`` blocks whose ``float32(x * mult)`` (or ``float32(x / div)``) rounds
    above max (RNE)."""
    import torch

    thr = cast_thresholds(fmt, "rne")
    y = (x.to(torch.float32) * mult if div is None else x.to(torch.float32) / div).abs()
    over = y > thr.overflow_at
    if thr.overflow_tie:
        over |= y == thr.overflow_at
    return (over & torch.isfinite(x) & alive).sum()


def block_statistics(x, codes, scale_inv, fmt: str | FloatFormat, granularity: str, *,
                     global_amax: float | None = None, policy_params: dict | None = None,
                     k: int = 5) -> BlockStats:  # fmt: skip
    """The block statistics of the cast of 2-D torch tensor ``x`` whose output is ``codes`` and
    the float32 scale grid ``scale_inv`` (:mod:`fp8sim.scaling`'s grid shapes; NVFP4: the decoded
    E4M3 block scales) in element format ``fmt`` under ``granularity`` (``mx``, ``mx:rceil``,
    ``block:RxC``, ``nvfp4[:LAYOUT][:VARIANT]``). ``global_amax``: NVFP4's tensor amax;
    ``policy_params``: ``block:RxC``'s ``margin``, ``pow2``, ``epsilon``; ``k``: the
    histogram's mantissa bits."""
    import torch

    from fp8sim.scaling import parse_granularity

    fmt = get_format(fmt)
    g = parse_granularity(granularity)
    tile = g.block
    rows, cols = x.shape
    s = scale_inv.to(torch.float32)
    kind = "e8m0" if g.kind == "mx" else "e4m3" if g.kind == "nvfp4" else "f32"
    code = _codes(kind, s)
    hist = torch.bincount(code.reshape(-1), minlength=256).cpu().numpy()
    finite = torch.isfinite(s)
    fs = s[finite].to(torch.float64)
    live = _block_nonzero(x, tile)
    smallest, largest = (0, 254) if kind == "e8m0" else (0, 0x7E) if kind == "e4m3" else (None, None)
    under = int((live & (code == smallest) & finite).sum()) if smallest is not None else 0
    sat = int(((code == largest) & finite).sum()) if largest is not None else 0
    mult, div = None, None
    if g.kind == "mx":
        mult = _expand(torch.reciprocal(s), tile, rows, cols)  # 1 / 2**e: exact
    elif g.kind == "nvfp4":
        from fp8sim.nvfp4 import cast_multiplier, tensor_scale_for

        b = s.cpu().numpy()
        if g.variant == "compressed-tensors":  # the cast divides by b / G (fp8sim.nvfp4)
            d = (b / np.float32(tensor_scale_for(global_amax, g.variant))).astype(np.float32)
            div = _expand(torch.from_numpy(d).to(x.device), tile, rows, cols)
        else:
            r = cast_multiplier(b, global_amax, g.variant)
            mult = _expand(torch.from_numpy(r).to(x.device), tile, rows, cols)
    else:
        from fp8sim.scaling import scale_from_amax

        p = policy_params or {}
        pad = torch.nn.functional.pad(x.abs().to(torch.float32), (0, -cols % tile[1], 0, -rows % tile[0]))
        amax = pad.reshape(pad.shape[0] // tile[0], tile[0], pad.shape[1] // tile[1], tile[1]).amax(dim=(1, 3))
        sc = scale_from_amax(amax.cpu().numpy(), fmt, margin=p.get("margin", 0), epsilon=p.get("epsilon", 0.0),
                             pow2=p.get("pow2", False))  # fmt: skip
        mult = _expand(torch.from_numpy(sc).to(x.device), tile, rows, cols)
    alive = _expand(finite & (s > 0), tile, rows, cols)  # a zero scale loses its block: not clipping
    clipped = int(_clipped(x, mult, div, fmt, alive))
    rel, unsafe = _mx_relative(x, s, tile, fmt, k) if g.kind == "mx" else (None, 0)
    nz = np.flatnonzero(hist)
    return BlockStats(kind, int(s.numel()), nz.astype(np.uint8), hist[nz].astype(np.int64),
                      float(fs.min()) if fs.numel() else 0.0, float(fs.max()) if fs.numel() else 0.0,
                      float(fs.std(unbiased=False)) if fs.numel() else 0.0, clipped, under, sat,
                      int((~finite).sum()), rel, unsafe)  # fmt: skip


def _mx_relative(x, s, tile, fmt, k) -> tuple[HistogramCounts, int]:
    """The block-relative histogram of an MX cast (module docstring) and its unsafe blocks."""
    import torch

    rows, cols = x.shape
    c = tile[1]
    xp = torch.nn.functional.pad(x.to(torch.float64), (0, -cols % c))
    blocks = xp.reshape(rows, -1, c)  # (rows, nb, 32)
    amax = blocks.abs().amax(dim=-1)  # NaN for a block holding a NaN
    ok = torch.isfinite(amax)
    _, ex = torch.frexp(torch.where(ok & (amax > 0), amax, torch.ones_like(amax)))
    e_b = ex.to(torch.int64) - 1  # floor(log2 amax_b)
    unsafe = int((ok & (amax > 0) & (e_b < MX_REL_SAFE_EXPONENT)).sum())
    rel = blocks * torch.exp2(-e_b.to(torch.float64)).unsqueeze(-1)  # exact powers of two
    # the padding is not data: keep the real columns of the finite blocks
    real = torch.arange(blocks.shape[1] * c, device=x.device).reshape(1, -1, c) < cols
    keep = (ok.unsqueeze(-1) & real).expand_as(rel)
    return histogram_and_counts(rel[keep], get_format("e4m3"), 1.0, "rne", k), unsafe


def mx_what_if(x, fmt: str | FloatFormat, k: int = 5) -> BlockStats:
    """The block statistics an MX cast of 2-D ``x`` in ``fmt`` with the OCP ``floor`` rule would
    have (its scales from :func:`fp8sim.scaling.mx_shared_scale` of each 32-element block's amax):
    for a tensor cast per tensor, so that ``mx`` replays from the record alone."""
    import torch

    from fp8sim.scaling import MX_BLOCK, mx_shared_scale

    rows, cols = x.shape
    pad = torch.nn.functional.pad(x.detach().abs().to(torch.float32), (0, -cols % MX_BLOCK))
    amax = pad.reshape(rows, -1, MX_BLOCK).amax(dim=-1)  # NaN for a block holding a NaN
    scale_inv = torch.from_numpy(mx_shared_scale(amax.cpu().numpy(), fmt, "floor")).to(x.device)
    return block_statistics(x, None, scale_inv, fmt, "mx", k=k)


def mx_floor_counts(stats: BlockStats, fmt: str | FloatFormat, mantissa_bits: int) -> tuple[int, int, bool]:
    """``(overflow, underflow, exact)`` of an MX cast with the OCP ``floor`` rule in element format
    ``fmt`` (round to nearest even), from the block-relative histogram: exact unless some block's
    amax is below ``2**-112`` (``exact`` False then; the counts treat those blocks as unclamped).
    Values of NaN/inf blocks are lost, not counted. ValueError without a relative histogram."""
    fmt = get_format(fmt)
    h = stats.rel_histogram(mantissa_bits)
    if h is None:
        raise ValueError("mx_floor_counts: this record holds no block-relative histogram (an MX cast's only)")
    return h.overflow(fmt, fmt.emax), h.underflow(fmt, fmt.emax), stats.rel_unsafe == 0 and fmt.emax <= 15
