"""Single-pass FP8 statistics of a tensor under several formats x scalings.

For each requested (format, scaling) -- a *variant* -- the figures are those of the cast
``fp8sim.scaling.quantize_scaled(x, fmt, granularity, rounding="rne", saturate=True)`` followed by
``dequantize``, computed without materializing either:

* ``overflow``: finite values whose scaled magnitude ``float32(float32(x) * scale)`` rounds (RNE,
  unbounded exponent) above ``fmt.max``; the saturating cast then clamps them to max.
* ``underflow``: nonzero finite values that become 0.
* ``subnormal``: values whose cast result is nonzero and below ``fmt.min_normal``.
* ``sqnr_db = 10 log10(sum x^2 / sum (deq - x)^2)`` and ``rel_mse = sum (deq - x)^2 / sum x^2``
  over the finite values, ``deq = float32(decode(code) * scale_inv)`` as ``dequantize`` gives it.
* ``lost``: elements of MX blocks whose shared scale is NaN (the block holds a NaN or inf; the MX
  spec makes the whole block NaN). They are left out of the figures above, both sums included
  (with none of its finite values kept, a variant's SQNR is undefined, NaN).

Scalings: ``none`` (scale 1: a plain cast) or any :func:`fp8sim.scaling.parse_granularity` spec
(``tensor``, ``row``, ``col``, ``block:RxC``, ``mx``, ``mx:rceil``), just in time from each group's
amax with ``scale_from_amax`` / ``mx_shared_scale`` -- the scaling module's own functions.
NVFP4 scalings (``nvfp4``, ``nvfp4:16x1``, ``nvfp4:2d``, with the ``te``, ``torchao`` or
``torchao-block`` rules of :mod:`fp8sim.nvfp4`) always use the e2m1 format, whatever the formats
asked: each block's cast is ``x * cast_multiplier`` and its dequantization ``e2m1 *
block_decode_scale``, from the block amaxes and the tensor amax (NaN skipped, inf kept) -- the
NVFP4 module's own functions. A block whose E4M3 scale rounds to 0 counts its nonzero values as
underflow (Transformer Engine writes saturated codes there, which its scale 0 turns into 0), a
block holding a NaN as lost. compressed-tensors' rule divides and is not offered here.

Passes, per chunk of the flat tensor (bounded memory, files read lazily): pass A (only when a
variant scales just in time) is one numba pass computing the tensor's amax and every requested
granularity's per-group amax -- a just-in-time scale needs them before the first cast -- and the
format-independent figures (NaN/inf/zero counts, amax, sum x^2, the log2|x| histogram), which keep
the cores busy while that pass streams the data from memory; pass B is one numba pass computing
every variant's figures (and the format-independent ones when pass A did not run), block by block,
so the data is read from memory once and each variant's cast reads the block from L1. Inside a
pass, a chunk is split into parts (by size) that the numba threads take in turn (``prange``),
each part into L1-sized blocks whose loops are branch-free so LLVM vectorizes them;
the cast works on float32 bit patterns in 32-bit lanes (RNE as an integer or FPU add at the
quantum; see :mod:`analysis.stats.blocks`).

Counts are exact (tests compare them with ``quantize_scaled`` + ``dequantize``); the two sums are
float64 accumulations in a fixed order (within blocks of 1024 elements: pairwise, the first
levels in registers where the scan reads a full float32 block as four quarters; then block by
block and part by part), equal to the exactly rounded sum to ~1e-12 relative, and independent of
the thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from fp8sim.formats import FloatFormat, get_format
from fp8sim.quantizer import Quantizer
from fp8sim.recipes import CastConfig
from fp8sim.scaling import Granularity, parse_granularity, view2d
from fp8sim.scaling_config import CurrentScalingConfig
from fp8sim.analysis.stats.blocks import HIGH_EXP, N_LOG2
from fp8sim.analysis.stats.passes import part_count, pass_a, pass_b
from fp8sim.trace import EXPONENT_MAX, EXPONENT_MIN

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

#: binades of the log2|x| histogram: floor(log2 float32(|x|)); the ends are sentinels for float64
#: values outside float32's range (as in fp8sim.trace)
LOG2_EXPONENTS = np.arange(EXPONENT_MIN, EXPONENT_MAX + 1)
#: elements per chunk of a tensor read from a file (4 MiB of float32: bounds the memory a lazily
#: read dump adds)
DEFAULT_CHUNK = 1 << 20
#: elements per chunk of an array already in memory (a chunk is a view: no memory added but the
#: chunk's scale grids, 1/16 of the chunk's float32 bytes for MX; fewer chunks mean fewer thread
#: launches and less per-chunk Python: at 2**24 float32 elements, two formats x tensor scaling,
#: one chunk took 13.1 ms where 2**20-element chunks took 15.0 ms)
IN_MEMORY_CHUNK = 1 << 24
_N_LOG2 = N_LOG2


# ------------------------------------------------------------------------------------------
# variants
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One format x scaling to evaluate. ``scaling``: ``"none"`` or a granularity spec."""

    fmt: FloatFormat
    scaling: str
    margin: float = 0.0
    pow2: bool = False

    @property
    def granularity(self) -> Granularity:
        return parse_granularity("tensor" if self.scaling == "none" else self.scaling)

    def quantizer(self) -> Quantizer:
        """The quantizer whose rule gives this variant's group scales (current scaling with its
        margin and pow2; MX's and NVFP4's own rules)."""
        g = self.granularity
        cfg = CurrentScalingConfig() if g.kind in ("mx", "nvfp4") else CurrentScalingConfig(self.pow2, 0.0, self.margin)
        fmt = get_format("e2m1") if g.kind == "nvfp4" else self.fmt
        return Quantizer(CastConfig(fmt, cfg, g))


def _check_format(fmt: FloatFormat) -> None:
    f32_max = float(np.finfo(np.float32).max)
    if not (fmt.signed and fmt.has_subnormals) or fmt.mantissa_bits > 22:
        raise ValueError(
            f"format {fmt.name}: analysis needs a signed element format with subnormals and at "
            "most 22 mantissa bits (e8m0 is a scale format)"
        )
    if fmt.max >= f32_max or fmt.min_subnormal < 2.0**-149:
        raise ValueError(f"format {fmt.name}: its range exceeds float32's")


def parse_variants(
    formats: Sequence[str], scalings: Sequence[str], *, margin: float = 0.0, pow2: bool = False
) -> list[Variant]:
    """Every format x scaling, validated (ValueError naming the bad name and the valid ones);
    the same format (an alias too) x the same scaling only once."""
    out = []
    if not formats or not scalings:
        raise ValueError("need at least one format and one scaling")
    for f in formats:
        fmt = get_format(f.strip())
        _check_format(fmt)
        for s in scalings:
            s = s.strip().lower()
            vfmt = fmt
            if s != "none":
                g = parse_granularity(s)
                s = g.spec
                if g.kind == "mx" and (margin or pow2):
                    raise ValueError("margin/pow2 do not apply to mx scaling (E8M0 rule)")
                if g.kind == "nvfp4":
                    if margin or pow2:
                        raise ValueError("margin/pow2 do not apply to nvfp4 scaling (E4M3 block "
                                         "scales)")  # fmt: skip
                    if g.variant == "compressed-tensors":
                        raise ValueError("nvfp4 compressed-tensors scaling is not offered in "
                                         "analysis (its cast divides); use te, torchao or "
                                         "torchao-block")  # fmt: skip
                    vfmt = get_format("e2m1")  # NVFP4 is E2M1 whatever the formats asked
            fmt_k, v = vfmt, Variant(vfmt, s, float(margin), bool(pow2))
            if all((o.fmt.name, o.scaling) != (fmt_k.name, s) for o in out):  # e4m3 = e4m3fn
                out.append(v)
    return out


# ------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------
@dataclass
class VariantStats:
    """Figures of one format x scaling (see the module docstring). ``scale``: the smallest group
    scale (the tensor's scale for ``tensor``/``none``), ``scale_max`` the largest."""

    format: str
    scaling: str
    scale: float
    scale_max: float
    overflow: int
    underflow: int
    subnormal: int
    lost: int
    err2: float
    sqnr_db: float  # inf when there is no error at all; nan when no value is finite
    rel_mse: float


@dataclass
class TensorStats:
    """One tensor's format-independent figures and its variants.

    ``amax``: max finite ``|float32(x)|``; ``sig2``: sum of x^2 over finite values (float64);
    ``log2_counts[i]``: values with ``floor(log2 float32(|x|)) == LOG2_EXPONENTS[i]``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nan: int = 0
    inf: int = 0
    zero: int = 0
    amax: float = 0.0
    sig2: float = 0.0
    log2_counts: np.ndarray = field(default_factory=lambda: np.zeros(_N_LOG2, np.int64))
    variants: list[VariantStats] = field(default_factory=list)
    file: str = ""

    @property
    def finite(self) -> int:
        return self.numel - self.nan - self.inf

    @property
    def nonzero(self) -> int:
        """Finite nonzero values."""
        return self.finite - self.zero

    def records(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per variant: name, shape, dtype, numel, format, scaling, amax,
        scale, overflow, underflow, subnormal, nan, inf, sqnr_db, rel_mse, plus file, zero,
        scale_max, lost and the shares (percent: overflow of finite, underflow and subnormal
        of nonzero). Non-finite floats become None; ``sqnr_case`` says what a None SQNR means
        (:func:`sqnr_case`); a None amax is inf (float64 values beyond float32's range)."""
        out = []
        for v in self.variants:
            out.append(
                {
                    "name": self.name,
                    "file": self.file,
                    "shape": list(self.shape),
                    "dtype": self.dtype,
                    "numel": self.numel,
                    "format": v.format,
                    "scaling": v.scaling,
                    "amax": _finite_or_none(self.amax),
                    "scale": _finite_or_none(v.scale),
                    "scale_max": _finite_or_none(v.scale_max),
                    "overflow": v.overflow,
                    "underflow": v.underflow,
                    "subnormal": v.subnormal,
                    "nan": self.nan,
                    "inf": self.inf,
                    "zero": self.zero,
                    "lost": v.lost,
                    "sqnr_db": _finite_or_none(v.sqnr_db),
                    "rel_mse": _finite_or_none(v.rel_mse),
                    "sqnr_case": sqnr_case(v.sqnr_db),
                    "overflow_pct": 100.0 * v.overflow / self.finite if self.finite else 0.0,
                    "underflow_pct": 100.0 * v.underflow / self.nonzero if self.nonzero else 0.0,
                    "subnormal_pct": 100.0 * v.subnormal / self.nonzero if self.nonzero else 0.0,
                }
            )
        return out


def _mant_exp(pair: np.ndarray) -> tuple[float, int]:
    """A (low, high) sum pair as ``m * 2**e``: the high sum counts 2**HIGH_EXP times its value."""
    lo, hi = float(pair[0]), float(pair[1])
    if hi > 0:
        return hi + math.ldexp(lo, -HIGH_EXP), HIGH_EXP
    return lo, 0


def _combine(pair: np.ndarray) -> float:
    """The value of a (low, high) sum pair (inf when beyond float64)."""
    m, e = _mant_exp(pair)
    try:
        return math.ldexp(m, e)
    except OverflowError:
        return math.inf


def sqnr_case(sqnr_db: float) -> str:
    """What an SQNR is, for JSON (where it is a number or null): ``finite``; ``exact`` (+inf: no
    error at all, rel_mse 0); ``unbounded`` (-inf: the error is not finite -- a dequantized value
    overflowed or is NaN, e.g. a scale that underflowed to 0 -- or the signal is 0; rel_mse inf);
    ``undefined`` (NaN: no finite value to compare)."""
    if math.isnan(sqnr_db):
        return "undefined"
    if math.isinf(sqnr_db):
        return "exact" if sqnr_db > 0 else "unbounded"
    return "finite"


def _finite_or_none(v: float) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------
def _as_reader(x: Any) -> tuple[Callable[[int, int], np.ndarray], tuple[int, ...], str, bool]:
    """(read(start, stop) -> float32/float64, shape, dtype name, whether the data is in memory)
    of an array, tensor or source."""
    if hasattr(x, "read") and hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "numel"):
        return x.read, tuple(x.shape), str(x.dtype), False
    from fp8sim.emulator import as_float_array

    if type(x).__module__.startswith("torch"):
        dtype = str(x.dtype).replace("torch.", "")
    else:
        dtype = np.asarray(x).dtype.name
    arr, _ = as_float_array(x)
    flat = np.ascontiguousarray(arr).reshape(-1)
    return (lambda a, b: flat[a:b]), tuple(arr.shape), dtype, True


def _group_range(start: int, size: int, n: int, r: int, c: int, gc: int) -> tuple[int, int]:
    """(first, last) flat index, in the row-major (grid rows x gc) group grid of r x c tiles over
    an (M, n) view, of the groups that elements [start, start + size) can touch: every group
    they touch lies between the two (a chunk inside one row of a long row touches only its own
    column groups, so the per-chunk grid stays bounded by the chunk, not by the row)."""
    r0, c0 = divmod(start, n)
    r1, c1 = divmod(start + size - 1, n)
    if r0 == r1 or r == 1:  # element order is group order along (grid) rows
        return (r0 // r) * gc + c0 // c, (r1 // r) * gc + c1 // c
    return (r0 // r) * gc, (r1 // r) * gc + gc - 1  # whole grid rows


def _variant_table(variants: Sequence[Variant], grans: list[Granularity], g_tiles: list,
                   m: int, n: int) -> tuple[np.ndarray, np.ndarray, list]:
    """(vint, vflt) of :func:`analysis.stats.passes._pass_b` for the variants (scale offsets
    and first groups left 0), and each variant's (R, C, Gc, index into grans; -1 for none)."""
    vint = np.zeros((len(variants), 11), np.int64)
    vflt = np.zeros((len(variants), 3), np.float64)
    shapes = []
    for k, v in enumerate(variants):
        fmt = v.fmt
        if v.scaling == "none":
            r, c, gc, gi = m, n, 1, -1
        else:
            gi = grans.index(v.granularity)
            r, c, gc, _ = g_tiles[gi]
        shapes.append((r, c, gc, gi))
        vint[k, 8] = int(r >= m and c >= n)  # one scale for the whole tensor
        vint[k, 9] = int(fmt.emax + 23 - fmt.mantissa_bits <= 127)  # see _cast_block_f32
        mb = fmt.mantissa_bits
        vint[k, :7] = (
            r, c, gc, 0, 23 - mb,
            int(np.float32(fmt.max).view(np.uint32)),
            int(np.float32(fmt.min_normal).view(np.uint32)),
        )  # fmt: skip
        vflt[k] = (2.0 ** (fmt.emin - mb + 23), fmt.max, fmt.min_normal)
    return vint, vflt, shapes


def tensor_stats(
    x: Any,
    variants: Sequence[Variant],
    *,
    name: str = "",
    chunk: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> TensorStats:
    """Statistics of ``x`` (numpy array, CPU torch tensor or a ``dumps.TensorSource``) under every
    variant, reading it chunk by chunk (``chunk`` elements; by default :data:`DEFAULT_CHUNK` for
    a source read from a file, :data:`IN_MEMORY_CHUNK` for an array or tensor in memory): twice
    (pass A, then pass B) when a variant scales just in time, once (pass B) when every variant
    is ``none``. The figures depend on the chunk size only in the last bits of the two sums.

    ``progress(n)`` is called with the number of elements each pass finished (2 x numel in all;
    pass B counts twice when pass A was not needed).
    Raises TypeError for non-float input.
    """
    read, shape, dtype, in_memory = _as_reader(x)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    res = TensorStats(name=name, shape=shape, dtype=dtype, numel=numel)
    if numel == 0:
        return res
    m, n = view2d(shape)
    if chunk is None:
        chunk = IN_MEMORY_CHUNK if in_memory else DEFAULT_CHUNK
    chunk = max(1, int(chunk))

    # distinct granularities (none needs no amax)
    grans: list[Granularity] = []
    for v in variants:
        if v.scaling != "none" and v.granularity not in grans:
            grans.append(v.granularity)
    g_tiles = []
    for g in grans:
        r, c = g.tile(m, n)
        g_tiles.append((r, c, -(-n // c), -(-m // r)))
    g_amax = [np.zeros(gr * gc, np.uint32) for (_, _, gc, gr) in g_tiles]  # float32 bits
    g_nan = [np.zeros(gr * gc, bool) for (_, _, gc, gr) in g_tiles]  # group holds a NaN

    # the format-independent figures: from pass A when it runs (it reads memory with the cores
    # idle), else from pass B
    counts = np.zeros(3, np.int64)
    amax_bits = 0
    sig2 = np.zeros(2, np.float64)  # (low sum, high sum): see _combine
    log2 = np.zeros(_N_LOG2, np.int64)

    def _add_scan(scanned) -> None:
        nonlocal amax_bits
        base, sq, lg = scanned
        counts[:] += base[:3]
        amax_bits = max(amax_bits, int(base[3]))
        sig2[:] += sq
        log2[:] += lg

    vint, vflt, shapes = _variant_table(variants, grans, g_tiles, m, n)
    vcounts = np.zeros((len(variants), 5), np.int64)
    verr = np.zeros((len(variants), 3), np.float64)  # sum (deq - x)^2 (low, high), kept x^2
    smin = np.full(len(variants), np.inf)
    smax = np.full(len(variants), -np.inf)

    need_a = bool(grans)

    # ---- pass A (only when a variant needs a just-in-time scale): amaxes + the scan ----
    for start in range(0, numel if need_a else 0, chunk):
        xc = read(start, min(numel, start + chunk))
        # granularities the kernel tiles (tensor's amax comes from the scan's amax)
        tiled = [k for k, g in enumerate(grans) if g.kind != "tensor"]
        gran = np.zeros((len(tiled), 4), np.int64)
        local_off = np.zeros(len(tiled) + 1, np.int64)
        for j, k in enumerate(tiled):
            r, c, gc, _ = g_tiles[k]
            lo, hi = _group_range(start, xc.size, n, r, c, gc)
            gran[j] = (r, c, gc, lo)
            local_off[j + 1] = local_off[j] + (hi - lo + 1)
        gam, gnn, scanned = pass_a(xc, start, n, gran, local_off, int(local_off[-1]),
                                    part_count(xc.size))  # fmt: skip
        _add_scan(scanned)
        for j, k in enumerate(tiled):
            a, b = int(local_off[j]), int(local_off[j + 1])
            lo = int(gran[j, 3])
            tgt = slice(lo, lo + (b - a))
            g_amax[k][tgt] = np.maximum(g_amax[k][tgt], gam[:, a:b].max(axis=0))
            g_nan[k][tgt] |= gnn[:, a:b].sum(axis=0) > 0
        if progress is not None:
            progress(xc.size)
    for k, g in enumerate(grans):
        if g.kind == "tensor":  # the finite amax, NaN skipped; an inf counts (as quantize_scaled)
            g_amax[k][0] = np.uint32(0x7F800000) if counts[1] else np.uint32(amax_bits)
    # NVFP4's tensor amax, as quantize_scaled takes it (NaN skipped, an inf counts)
    tensor_amax = np.float32(np.inf) if counts[1] else np.uint32(amax_bits).view(np.float32)

    # ---- pass B, with each chunk's scales from the scaling module's own rules ----
    # (scales are made per chunk, for the grid rows the chunk touches: an MX scale grid of a
    # 4 GB tensor is never held whole)
    quantizers = [v.quantizer() for v in variants]

    def chunk_scales(k: int, gi: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(multipliers, scale_inv) of grid entries [lo, hi) of variant k (float32)."""
        if gi < 0:
            return np.ones(1, np.float32), np.ones(1, np.float32)
        return quantizers[k].group_scales(g_amax[gi][lo:hi].view(np.float32), g_nan[gi][lo:hi],
                                          tensor_amax=tensor_amax)

    for k, v in enumerate(variants):  # MX groups whose scale is NaN (a NaN or inf): lost values
        gi, step = shapes[k][3], 1 << 22  # the scale rule itself, a slice of the grid at a time
        if gi >= 0 and v.granularity.kind in ("mx", "nvfp4"):
            vint[k, 10] = any(np.isnan(chunk_scales(k, gi, i, i + step)[1]).any()
                              for i in range(0, g_amax[gi].size, step))  # fmt: skip
    whole_scales = {}  # variants with one scale for the whole tensor: computed once
    for k, v in enumerate(variants):
        r, _, gc, gi = shapes[k]
        if vint[k, 8]:
            whole_scales[k] = chunk_scales(k, gi, 0, gc)
    for start in range(0, numel, chunk):
        xc = read(start, min(numel, start + chunk))
        sc_parts, si_parts = [], []
        off = 0
        for k, v in enumerate(variants):
            r, c, gc, gi = shapes[k]
            lo, hi = _group_range(start, xc.size, n, r, c, gc)
            if k in whole_scales:
                mult, sinv = whole_scales[k]
            else:
                mult, sinv = chunk_scales(k, gi, lo, hi + 1)
            sc_parts.append(mult)
            si_parts.append(np.asarray(sinv, np.float32).reshape(-1))
            vint[k, 3] = off
            vint[k, 7] = lo
            off += mult.size
            fin = mult[np.isfinite(mult)]
            if fin.size:
                smin[k] = min(smin[k], float(fin.min()))
                smax[k] = max(smax[k], float(fin.max()))
        scales = np.concatenate(sc_parts) if sc_parts else np.ones(1, np.float32)
        sinvs = np.concatenate(si_parts) if si_parts else np.ones(1, np.float32)
        scanned, cnt, e2 = pass_b(xc, start, n, vint, vflt, scales, sinvs, part_count(xc.size),
                                   scan=not need_a)  # fmt: skip
        if scanned is not None:
            _add_scan(scanned)
        vcounts += cnt
        verr += e2
        if progress is not None:  # 2 x numel in all, also when pass A was not needed
            progress(xc.size if need_a else 2 * xc.size)
    res.nan, res.inf, res.zero = (int(v) for v in counts)
    res.amax = float(np.array([amax_bits], np.uint32).view(np.float32)[0])
    res.sig2, res.log2_counts = _combine(sig2), log2

    for k, v in enumerate(variants):
        lost = int(vcounts[k, 3])
        if lost and not vint[k, 10]:
            raise AssertionError(f"{v.fmt.name} {v.scaling}: values lost to a scale not foreseen")
        # the signal: every finite value's x^2, or (values lost to a NaN MX scale) the kept ones
        s_m, s_e = _mant_exp((verr[k, 2], 0.0) if vint[k, 10] else sig2)
        e_m, e_e = _mant_exp(verr[k, :2])
        e2 = _combine(verr[k, :2])
        if res.nan + res.inf + lost == numel:  # no finite value kept: nothing to compare, not
            sqnr, rel = math.nan, math.nan  # "exact"
        elif e_m == 0.0:
            sqnr, rel = math.inf, 0.0
        elif not math.isfinite(e_m):  # a dequantized value overflowed float32 (scale_inv near
            # its max), or is NaN (0 x inf: a scale that underflowed to 0, a margin near 126)
            sqnr, rel = -math.inf, math.inf
        elif s_m > 0:
            sqnr = 10.0 * (math.log10(s_m / e_m) + (s_e - e_e) * math.log10(2.0))
            try:
                rel = math.ldexp(e_m / s_m, e_e - s_e)
            except OverflowError:
                rel = math.inf
        else:
            sqnr, rel = -math.inf, math.inf
        res.variants.append(
            VariantStats(
                format=v.fmt.name,
                scaling=v.scaling,
                scale=float(smin[k]) if smax[k] >= smin[k] else math.nan,
                scale_max=float(smax[k]) if smax[k] >= smin[k] else math.nan,
                overflow=int(vcounts[k, 0]),
                # the kernels count the zeros with the values that round to 0: off they come
                underflow=int(vcounts[k, 1]) - (res.zero - int(vcounts[k, 4])),
                subnormal=int(vcounts[k, 2] - vcounts[k, 1]),
                lost=lost,
                err2=e2,
                sqnr_db=sqnr,
                rel_mse=rel,
            )
        )
    return res
