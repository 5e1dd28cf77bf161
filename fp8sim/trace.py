"""The fp8sim trace format: per-step tensor statistics of a run, written by the training recorder
and read by ``analysis`` (neither imports the other; both import this module).

A trace is a directory::

    trace.json                                  schema, run config, tensor catalogue
    chunks/chunk-000000-s00000000-00000049.npz  per-step scalars + histograms, whole steps only
    tensors/00000100-00003.safetensors          optional full tensor (step 100, tensor #3)

``trace.json``: ``{"schema": "fp8sim-trace", "version": 1, "config": {...run config...},
"rounding": "rne", "chunk_steps": N, "hist": {"mantissa_bits": k, "exponent_min": -150,
"exponent_max": 128}, "formats": [names], "tensors": [{"name", "role", "format", "shape"}]}``.
Roles: :data:`ROLES`.

Each chunk holds one row per (step, tensor) record, columnar (see :data:`SCALAR_COLUMNS`):
``step, tensor`` (catalogue index), ``format`` (index into ``formats``), ``numel, zero, nan, inf,
amax, scale, overflow, underflow``, plus a sparse histogram per row (``hist_offsets`` into
``hist_bins`` / ``hist_counts``).

Scale convention: ``scale`` is the multiplier applied before the cast, as in
``fp8sim.scaling``: ``codes = encode(float32(float32(x) * float32(scale)))`` -- the input taken
to float32, the product rounded once to float32, as a GPU kernel does. ``overflow`` counts finite values whose scaled magnitude rounds above ``fmt.max``
(whatever the saturation rule then does with them); ``underflow`` counts nonzero values that
round to zero. Both follow the trace's ``rounding`` (``rne`` by default; ``rna`` and ``rtz`` are
also understood) unless the recorder passed measured counts.

The histogram of |x|
--------------------
Every finite nonzero value is binned by ``a = float32(|x|) = 2**e * (1 + f)``, 0 <= f < 1:
the bin is ``(e, m, inexact)`` with ``m = floor(f * 2**k)`` (the k leading mantissa bits) and
``inexact = f * 2**k != m`` (whether any lower bit is set). Bin ids
``(e - EXPONENT_MIN) * 2**(k+1) + 2*m + inexact`` increase with |x|, and bin ``(e, m, 0)`` holds
only values exactly equal to its lower edge ``2**e * (1 + m/2**k)``.

Why this is exact: for round-to-nearest the overflow threshold of a format with ``M`` mantissa bits
is ``max + ulp(max)/2``, a number with ``M + 1`` mantissa bits, and the underflow threshold
``min_subnormal / 2`` is a power of two. Multiplying by a power-of-two scale ``2**j`` moves a value
by whole binades without rounding (in float32's normal range). So with ``k >= M + 1`` both
thresholds, divided by ``2**j``, are lower edges of an exact bin: values above a threshold are
whole bins, values equal to it (the tie, decided by the rounding rule) are exactly the exact bin.
``k = 5`` (the default) covers every 8-bit format (e3m4 has the most mantissa bits, 4).

Exactness holds for every input dtype, because the cast sees ``float32(x)`` too (float64 inputs
are rounded to float32 first). Two sentinel binades hold float64 values outside float32's range:
``e = EXPONENT_MIN`` nonzero values whose float32 is 0 (they underflow under any scale),
``e = EXPONENT_MAX`` finite values whose float32 is inf (they overflow under any scale). Exactness
needs the scaled threshold values in float32's normal range: true for every 8-bit format and any
scale with ``|log2 scale| < 100``.

Atomicity: every file is written to a temporary name in the same directory, fsync'ed and moved
into place with ``os.replace``. A chunk contains whole steps only and a step never spans two
chunks, so a reader never sees half a step; ``trace.json`` is updated before a chunk that needs a
new catalogue entry. An interrupted writer loses only steps not yet flushed.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numba
import numpy as np

from fp8sim._jit import jit_kernel
from fp8sim.formats import FloatFormat, get_format

__all__ = [
    "TraceWriter",
    "TraceReader",
    "TensorInfo",
    "TraceRecord",
    "AbsHistogram",
    "abs_histogram",
    "cast_thresholds",
    "is_trace",
    "ROLES",
    "SCALAR_COLUMNS",
    "SCHEMA",
    "VERSION",
    "EXPONENT_MIN",
    "EXPONENT_MAX",
    "DEFAULT_HIST_MANTISSA_BITS",
    "COUNT_ROUNDINGS",
]

SCHEMA = "fp8sim-trace"
VERSION = 1
#: what a tensor is for; the analysis groups and colours by it
ROLES = ("activation", "weight", "grad_output", "weight_grad", "optimizer_state")
#: per-record columns of a chunk (besides the histogram arrays)
SCALAR_COLUMNS = (
    "step", "tensor", "format", "numel", "zero", "nan", "inf",
    "amax", "scale", "overflow", "underflow",
)  # fmt: skip
#: the histogram's binades: EXPONENT_MIN is the "nonzero, float32(|x|) == 0" sentinel (float32's
#: smallest subnormal is 2**-149), EXPONENT_MAX the "finite, float32(|x|) == inf" sentinel
EXPONENT_MIN = -150
EXPONENT_MAX = 128
DEFAULT_HIST_MANTISSA_BITS = 5
#: rounding modes for which over/underflow is a pure function of |x| (thresholds)
COUNT_ROUNDINGS = ("rne", "rna", "rtz")

_TRACE_JSON = "trace.json"
_CHUNK_DIR = "chunks"
_TENSOR_DIR = "tensors"
_CHUNK_RE = re.compile(r"^chunk-(\d{6})-s(\d+)-(\d+)\.npz$")
_TENSOR_RE = re.compile(r"^(\d{8})-(\d{5})\.safetensors$")


# ------------------------------------------------------------------------------------------
# rounding thresholds
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CastThresholds:
    """Where a scaled magnitude ``p`` over- or underflows in one format and rounding mode.

    ``p`` overflows iff ``p > overflow_at`` or (``overflow_tie`` and ``p == overflow_at``);
    a nonzero ``p`` underflows iff ``p < underflow_at`` or (``underflow_tie`` and
    ``p == underflow_at``). ``*_e, *_m`` give the threshold as ``2**e * (1 + m/2**m_bits)``.
    """

    overflow_at: float
    overflow_tie: bool
    overflow_e: int
    overflow_m: int
    underflow_at: float
    underflow_tie: bool
    underflow_e: int
    underflow_m: int
    m_bits: int  # mantissa bits the thresholds need


def cast_thresholds(fmt: str | FloatFormat, rounding: str = "rne") -> CastThresholds:
    """Over/underflow thresholds of ``fmt`` under ``rounding`` (one of :data:`COUNT_ROUNDINGS`).

    rne: overflow above ``max + ulp/2``; the tie overflows iff max's mantissa is odd (it rounds
    to the even neighbour above). Underflow at or below ``min_subnormal/2`` (the tie goes to 0).
    rna: ties go away from zero: the overflow tie overflows, the underflow tie does not.
    rtz: overflow at or above ``max + ulp`` (what truncates above max before the clamp);
    underflow below ``min_subnormal``.

    "Rounds above max" means: rounded with the format's precision and an unbounded exponent,
    the result exceeds ``fmt.max`` -- whatever the saturation rule then makes of it.
    """
    fmt = get_format(fmt)
    if rounding not in COUNT_ROUNDINGS:
        raise ValueError(
            f"over/underflow counts from thresholds need rounding in {COUNT_ROUNDINGS}, "
            f"got {rounding!r} (directed and stochastic modes depend on more than |x|)"
        )
    if not fmt.has_zero or not fmt.signed:
        raise ValueError(f"format {fmt.name} has no zero or no sign; over/underflow undefined")
    mb = fmt.mantissa_bits
    max_m = fmt.max_code & ((1 << mb) - 1)
    if rounding == "rtz":
        # max + ulp is the first value that truncates to something above max
        e, m = (fmt.emax, 2 * (max_m + 1)) if max_m + 1 < (1 << mb) else (fmt.emax + 1, 0)
        return CastThresholds(
            fmt.max + 2.0 ** (fmt.emax - mb), True, e, m,
            fmt.min_subnormal, False, fmt.emin - mb, 0,
            mb + 1,
        )  # fmt: skip
    tie_up = (max_m & 1) == 1 if rounding == "rne" else True
    return CastThresholds(
        fmt.max + 2.0 ** (fmt.emax - mb - 1), tie_up, fmt.emax, 2 * max_m + 1,
        fmt.min_subnormal / 2, rounding == "rne", fmt.emin - mb - 1, 0,
        mb + 1,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# one-pass histogram kernel
# ------------------------------------------------------------------------------------------
def _n_bins(k: int) -> int:
    return (EXPONENT_MAX - EXPONENT_MIN + 1) << (k + 1)


@jit_kernel
def _abs_hist_kernel(x, scale, ov_at, ov_tie, un_at, un_tie, k, n_bins, n_parts):
    """One pass over flat ``x`` (float32 or float64): per part a dense |x| histogram, and counts.

    Returns (hist (n_parts, n_bins) int64, stats (n_parts, 5) int64 = zero, nan, inf, overflow,
    underflow, amax (n_parts,) float64 over finite values).
    """
    n = x.size
    hist = np.zeros((n_parts, n_bins), np.int64)
    stats = np.zeros((n_parts, 5), np.int64)
    amax = np.zeros(n_parts, np.float64)
    per = (n + n_parts - 1) // n_parts
    scale_k = 2.0**k
    lo_id = 1  # sentinel: (EXPONENT_MIN, 0, inexact)
    hi_id = ((EXPONENT_MAX - EXPONENT_MIN) << (k + 1)) + 1
    for p in numba.prange(n_parts):
        start = p * per
        stop = min(n, start + per)
        zero = 0
        nan = 0
        inf = 0
        over = 0
        under = 0
        mx = 0.0
        for i in range(start, stop):
            v = np.float64(x[i])
            if v != v:
                nan += 1
                continue
            a = abs(v)
            if a == np.inf:
                inf += 1
                continue
            if a == 0.0:
                zero += 1
                continue
            if a > mx:
                mx = a
            a32 = np.float64(np.float32(a))
            if a32 == 0.0:
                b = lo_id
            elif a32 == np.inf:
                b = hi_id
            else:
                fr, ex = math.frexp(a32)  # a32 = fr * 2**ex, 0.5 <= fr < 1
                f = (2.0 * fr - 1.0) * scale_k
                m = int(f)
                b = ((ex - 1 - EXPONENT_MIN) << (k + 1)) + 2 * m + (1 if f != m else 0)
            hist[p, b] += 1
            q = np.float64(np.float32(a32 * scale))  # float32(float32(x) * scale)
            if q > ov_at or (ov_tie and q == ov_at):
                over += 1
            elif q < un_at or (un_tie and q == un_at):
                under += 1
        stats[p, 0] = zero
        stats[p, 1] = nan
        stats[p, 2] = inf
        stats[p, 3] = over
        stats[p, 4] = under
        amax[p] = mx
    return hist, stats, amax


def _as_float_array(x: Any, what: str = "x") -> np.ndarray:
    """Flat float32/float64 numpy view or copy of a numpy array or torch tensor (any device).

    bfloat16 and float16 widen to float32 exactly. Integer and complex inputs raise TypeError.
    """
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach()
        if not t.is_floating_point():
            raise TypeError(f"{what}: expected a floating-point tensor, got {t.dtype}")
        if t.dtype not in (torch.float32, torch.float64):
            t = t.float()
        return t.cpu().contiguous().numpy().reshape(-1)
    a = np.asarray(x)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise TypeError(f"{what}: expected a floating-point array, got dtype {a.dtype}")
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    return np.ascontiguousarray(a).reshape(-1)


@dataclass
class _HistResult:
    bins: np.ndarray  # uint32, sorted
    counts: np.ndarray  # int64
    numel: int
    zero: int
    nan: int
    inf: int
    overflow: int
    underflow: int
    amax: float  # max finite |x| (0.0 if none)


def _histogram_and_counts(
    x: Any, fmt: FloatFormat, scale: float, rounding: str, k: int
) -> _HistResult:
    a = _as_float_array(x)
    thr = cast_thresholds(fmt, rounding)
    n_parts = max(1, min(numba.get_num_threads(), a.size // (1 << 16)))
    hist, stats, amax = _abs_hist_kernel(
        a, float(np.float32(scale)), thr.overflow_at, thr.overflow_tie,
        thr.underflow_at, thr.underflow_tie, k, _n_bins(k), n_parts,
    )  # fmt: skip
    dense = hist.sum(axis=0)
    nz = np.flatnonzero(dense)
    s = stats.sum(axis=0)
    return _HistResult(
        nz.astype(np.uint32), dense[nz], int(a.size), int(s[0]), int(s[1]), int(s[2]),
        int(s[3]), int(s[4]), float(amax.max()) if amax.size else 0.0,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# the histogram object
# ------------------------------------------------------------------------------------------
class AbsHistogram:
    """Sparse histogram of ``float32(|x|)`` over finite nonzero values (see the module docstring).

    Attributes: ``bins`` (sorted uint32 bin ids), ``counts`` (int64), ``mantissa_bits`` (k),
    ``zero``, ``nan``, ``inf`` (counts of values outside the histogram), ``numel``.
    """

    def __init__(
        self,
        bins: np.ndarray,
        counts: np.ndarray,
        mantissa_bits: int,
        *,
        zero: int = 0,
        nan: int = 0,
        inf: int = 0,
    ) -> None:
        self.bins = np.asarray(bins, dtype=np.uint32)
        self.counts = np.asarray(counts, dtype=np.int64)
        if self.bins.shape != self.counts.shape:
            raise ValueError("histogram bins and counts differ in length")
        self.mantissa_bits = int(mantissa_bits)
        self.zero, self.nan, self.inf = int(zero), int(nan), int(inf)
        self._ids = self.bins.astype(np.int64)
        self._cum = np.concatenate([[0], np.cumsum(self.counts)])

    @property
    def nonzero(self) -> int:
        """Finite nonzero values (the histogram's total)."""
        return int(self._cum[-1])

    @property
    def numel(self) -> int:
        return self.nonzero + self.zero + self.nan + self.inf

    def _count_below(self, bin_id: int) -> int:
        """Values in bins with id < bin_id."""
        return int(self._cum[np.searchsorted(self._ids, bin_id, side="left")])

    def _bin_id(self, e: int, m_top: int, m_bits: int) -> int:
        """Exact bin of ``2**e * (1 + m_top/2**m_bits)``; needs m_bits <= k."""
        k = self.mantissa_bits
        return ((e - EXPONENT_MIN) << (k + 1)) + 2 * (m_top << (k - m_bits))

    def _check(self, thr: CastThresholds, fmt: FloatFormat) -> None:
        if thr.m_bits > self.mantissa_bits:
            raise ValueError(
                f"exact counts for {fmt.name} need a histogram with >= {thr.m_bits} mantissa bits; "
                f"this one keeps {self.mantissa_bits}"
            )

    def overflow(self, fmt: str | FloatFormat, scale_exp: int, rounding: str = "rne") -> int:
        """Exact count of values overflowing ``fmt`` when scaled by ``2**scale_exp``."""
        fmt = get_format(fmt)
        thr = cast_thresholds(fmt, rounding)
        self._check(thr, fmt)
        edge = self._bin_id(thr.overflow_e - int(scale_exp), thr.overflow_m, thr.m_bits)
        return self.nonzero - self._count_below(edge if thr.overflow_tie else edge + 1)

    def underflow(self, fmt: str | FloatFormat, scale_exp: int, rounding: str = "rne") -> int:
        """Exact count of nonzero values rounding to zero in ``fmt`` when scaled by ``2**scale_exp``."""
        fmt = get_format(fmt)
        thr = cast_thresholds(fmt, rounding)
        self._check(thr, fmt)
        edge = self._bin_id(thr.underflow_e - int(scale_exp), thr.underflow_m, thr.m_bits)
        return self._count_below(edge + 1 if thr.underflow_tie else edge)

    def _value_bin(self, v: float) -> tuple[int, bool]:
        """(bin id holding float64 v > 0, whether v is exactly that bin's lower edge)."""
        fr, ex = math.frexp(v)
        f = (2.0 * fr - 1.0) * 2.0**self.mantissa_bits
        m = int(f)
        exact = f == m
        return ((ex - 1 - EXPONENT_MIN) << (self.mantissa_bits + 1)) + 2 * m + (not exact), exact

    def overflow_bounds(
        self, fmt: str | FloatFormat, scale: float, rounding: str = "rne"
    ) -> tuple[int, int]:
        """(lower, upper) bound of the overflow count under any positive ``scale``.

        Equal (exact) when ``scale`` is a power of two; otherwise the bin that straddles
        ``threshold / scale`` is the uncertainty.
        """
        fmt = get_format(fmt)
        j = _pow2_exponent(scale)
        if j is not None:
            n = self.overflow(fmt, j, rounding)
            return n, n
        thr = cast_thresholds(fmt, rounding)
        if not scale > 0:
            return 0, 0
        b, _ = self._value_bin(thr.overflow_at / float(np.float32(scale)))
        return self.nonzero - self._count_below(b + 1), self.nonzero - self._count_below(b)

    def underflow_bounds(
        self, fmt: str | FloatFormat, scale: float, rounding: str = "rne"
    ) -> tuple[int, int]:
        """(lower, upper) bound of the underflow count under any positive ``scale``."""
        fmt = get_format(fmt)
        j = _pow2_exponent(scale)
        if j is not None:
            n = self.underflow(fmt, j, rounding)
            return n, n
        thr = cast_thresholds(fmt, rounding)
        if not scale > 0:
            return self.nonzero, self.nonzero
        b, _ = self._value_bin(thr.underflow_at / float(np.float32(scale)))
        return self._count_below(b), self._count_below(b + 1)

    def count_scaled_above(
        self, threshold: float, scale: float, *, inclusive: bool = False
    ) -> tuple[int, int]:
        """(lower, upper) bound of the number of values with ``|x| * scale > threshold``
        (``>=`` if ``inclusive``). Exact (equal bounds) when ``threshold / scale`` is a bin edge,
        i.e. a power-of-two ``scale`` and a threshold with at most k mantissa bits; otherwise the
        bin holding ``threshold / scale`` is the uncertainty (and the float32 rounding of the
        product, within that bin)."""
        s = float(np.float32(scale))
        if not (s > 0 and threshold > 0):
            return (self.nonzero, self.nonzero) if threshold <= 0 < s else (0, 0)
        t = float(threshold) / s
        if t == math.inf:
            return 0, 0
        if t == 0.0:
            return self.nonzero, self.nonzero
        b, exact = self._value_bin(t)
        if exact:  # b is the exact bin of t: values == t are exactly its count
            n = self.nonzero - self._count_below(b if inclusive else b + 1)
            return n, n
        return self.nonzero - self._count_below(b + 1), self.nonzero - self._count_below(b)

    def binades(self) -> tuple[np.ndarray, np.ndarray]:
        """(exponents e, counts) of values with ``floor(log2 float32(|x|)) == e``, e ascending.

        The sentinel binades appear as EXPONENT_MIN / EXPONENT_MAX.
        """
        e = (self._ids >> (self.mantissa_bits + 1)) + EXPONENT_MIN
        if e.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        uniq, inv = np.unique(e, return_inverse=True)
        return uniq, np.bincount(inv, weights=self.counts, minlength=uniq.size).astype(np.int64)

    def max_value(self) -> float:
        """Upper edge of the highest occupied bin (>= max finite |x|); 0.0 if empty."""
        if self._ids.size == 0:
            return 0.0
        k = self.mantissa_bits
        top = int(self._ids[-1])
        e = (top >> (k + 1)) + EXPONENT_MIN
        m = (top >> 1) & ((1 << k) - 1)
        return float(2.0**e * (1 + (m + (top & 1)) / 2.0**k))

    def __repr__(self) -> str:
        return (
            f"AbsHistogram(nonzero={self.nonzero}, zero={self.zero}, nan={self.nan}, "
            f"inf={self.inf}, bins={self.bins.size}, k={self.mantissa_bits})"
        )


def _pow2_exponent(scale: float) -> int | None:
    """j if float32(scale) == 2**j exactly, else None."""
    s = float(np.float32(scale))
    if not (s > 0 and math.isfinite(s)):
        return None
    fr, ex = math.frexp(s)
    return ex - 1 if fr == 0.5 else None


def abs_histogram(x: Any, mantissa_bits: int = DEFAULT_HIST_MANTISSA_BITS) -> AbsHistogram:
    """The trace histogram of a numpy array or torch tensor (one numba pass)."""
    _check_k(mantissa_bits)
    r = _histogram_and_counts(x, get_format("e4m3"), 1.0, "rne", mantissa_bits)
    return AbsHistogram(r.bins, r.counts, mantissa_bits, zero=r.zero, nan=r.nan, inf=r.inf)


def _check_k(k: int) -> None:
    if not (isinstance(k, (int, np.integer)) and 0 <= k <= 10):
        raise ValueError(f"hist_mantissa_bits must be an int in 0..10, got {k!r}")


# ------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------
def _atomic_write(path: Path, write) -> None:
    """Write through ``write(fileobj)`` to a temp file in path's directory, fsync, os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def is_trace(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a trace directory (has a trace.json of this schema)."""
    p = Path(path) / _TRACE_JSON
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("schema") == SCHEMA
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class TensorInfo:
    """One catalogue entry: ``name``, ``role`` (:data:`ROLES`), ``format`` name, ``shape``."""

    name: str
    role: str
    format: str
    shape: tuple[int, ...]
    index: int = -1


@dataclass
class TraceRecord:
    """One tensor at one step, as read back (scale: multiplier before the cast)."""

    step: int
    name: str
    format: str
    numel: int
    zero: int
    nan: int
    inf: int
    amax: float
    scale: float
    overflow: int
    underflow: int
    hist: AbsHistogram


# ------------------------------------------------------------------------------------------
# writer
# ------------------------------------------------------------------------------------------
class TraceWriter:
    """Record per-step tensor statistics into a trace directory.

    Usage (the training recorder)::

        with TraceWriter("runs/x/trace", config={"model": "gpt-tiny", "recipe": "te"}) as tw:
            tw.add_tensor("h0.attn.qkv.weight", "weight", "e4m3", (384, 128))
            for step in range(n):
                ...
                tw.record(step, "h0.attn.qkv.weight", w, amax=amax, scale=scale)
                if step % 100 == 0:
                    tw.save_tensor(step, "h0.attn.qkv.weight", w)

    Steps must not decrease. A step is complete when a larger step is recorded, or at
    :meth:`flush` / :meth:`close`; recording into a flushed step raises ValueError. Every
    ``chunk_steps`` complete steps are written as one chunk file.

    Args:
        path: trace directory; created. ``mode="w"`` refuses a directory that already holds a
            trace unless ``overwrite=True``; ``mode="a"`` appends to an existing trace (a resumed
            run): new steps must be larger than the last one stored.
        config: JSON-serializable run configuration, stored in trace.json.
        chunk_steps: complete steps per chunk file.
        hist_mantissa_bits: k, mantissa bits kept by the |x| histogram (5: exact for every 8-bit
            format; a format with M mantissa bits needs k >= M + 1).
        rounding: rounding the stored overflow/underflow counts assume (:data:`COUNT_ROUNDINGS`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        config: Mapping[str, Any] | None = None,
        *,
        mode: str = "w",
        overwrite: bool = False,
        chunk_steps: int = 50,
        hist_mantissa_bits: int = DEFAULT_HIST_MANTISSA_BITS,
        rounding: str = "rne",
    ) -> None:
        self.path = Path(path)
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        if not (isinstance(chunk_steps, int) and chunk_steps >= 1):
            raise ValueError(f"chunk_steps must be an int >= 1, got {chunk_steps!r}")
        _check_k(hist_mantissa_bits)
        if rounding not in COUNT_ROUNDINGS:
            raise ValueError(f"rounding must be one of {COUNT_ROUNDINGS}, got {rounding!r}")
        self._buf: list[dict[str, Any]] = []
        self._buf_steps: list[int] = []  # distinct steps in the buffer, ascending
        self._last_flushed_step: int | None = None
        self._closed = False
        if mode == "a" and is_trace(self.path):
            meta = json.loads((self.path / _TRACE_JSON).read_text())
            if meta.get("version") != VERSION:
                raise ValueError(f"{self.path}: trace version {meta.get('version')} != {VERSION}")
            self._meta = meta
            chunks = _list_chunks(self.path)
            self._seq = chunks[-1][0] + 1 if chunks else 0
            self._last_flushed_step = max((c[2] for c in chunks), default=None)
            if config is not None:
                self._meta.setdefault("resumes", []).append(_json_ready(dict(config)))
        else:
            if (self.path / _TRACE_JSON).exists() and not overwrite:
                raise ValueError(
                    f"{self.path} already holds a trace; use mode='a' to append or overwrite=True"
                )
            if overwrite and self.path.exists():
                for sub in (_CHUNK_DIR, _TENSOR_DIR):
                    for f in (self.path / sub).glob("*"):
                        f.unlink()
            self._meta = {
                "schema": SCHEMA,
                "version": VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "config": _json_ready(dict(config or {})),
                "rounding": rounding,
                "chunk_steps": chunk_steps,
                "hist": {
                    "mantissa_bits": int(hist_mantissa_bits),
                    "exponent_min": EXPONENT_MIN,
                    "exponent_max": EXPONENT_MAX,
                    "value": "float32(|x|)",
                },
                "formats": [],
                "tensors": [],
            }
            self._seq = 0
        self.chunk_steps = int(self._meta["chunk_steps"]) if mode == "a" else chunk_steps
        self.hist_mantissa_bits = int(self._meta["hist"]["mantissa_bits"])
        self.rounding = self._meta["rounding"]
        self._index = {t["name"]: i for i, t in enumerate(self._meta["tensors"])}
        self._meta_dirty = True
        self._write_meta()

    # -- catalogue ---------------------------------------------------------------------------
    def add_tensor(
        self, name: str, role: str, fmt: str | FloatFormat, shape: Sequence[int]
    ) -> None:
        """Declare a tensor. Re-declaring it with the same role/format/shape is a no-op."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        if role not in ROLES:
            raise ValueError(f"tensor {name!r}: role must be one of {ROLES}, got {role!r}")
        fmt_name = get_format(fmt).name
        entry = {"name": name, "role": role, "format": fmt_name, "shape": [int(s) for s in shape]}
        if name in self._index:
            old = self._meta["tensors"][self._index[name]]
            if old != entry:
                raise ValueError(f"tensor {name!r} already declared as {old}, now {entry}")
            return
        self._index[name] = len(self._meta["tensors"])
        self._meta["tensors"].append(entry)
        self._format_id(fmt_name)
        self._meta_dirty = True

    def _format_id(self, fmt_name: str) -> int:
        fl = self._meta["formats"]
        if fmt_name not in fl:
            fl.append(fmt_name)
            self._meta_dirty = True
        return fl.index(fmt_name)

    def _tensor_id(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(f"tensor {name!r} not declared; call add_tensor first") from None

    # -- recording ---------------------------------------------------------------------------
    def record(
        self,
        step: int,
        name: str,
        x: Any,
        *,
        scale: float,
        amax: float | None = None,
        fmt: str | FloatFormat | None = None,
        overflow: int | None = None,
        underflow: int | None = None,
    ) -> None:
        """Record tensor ``name`` at ``step``: one numba pass over ``x`` (numpy array or torch
        tensor, any float dtype, any device) computes the |x| histogram, zero/NaN/inf counts and
        the overflow/underflow counts of ``encode(float32(float32(x) * float32(scale)))`` in ``fmt``
        (default: the catalogue's) under the trace's rounding.

        ``amax``: the amax the scaling policy saw (default: max finite |x|). ``overflow``,
        ``underflow``: measured counts from the actual cast, stored instead of computed ones
        (use this when the cast used stochastic rounding).
        """
        self._check_open()
        step = int(step)
        tid = self._tensor_id(name)
        if self._last_flushed_step is not None and step <= self._last_flushed_step:
            raise ValueError(
                f"step {step} of {name!r}: steps up to {self._last_flushed_step} are already "
                "flushed; steps must increase"
            )
        if self._buf_steps and step < self._buf_steps[-1]:
            raise ValueError(f"step {step} of {name!r} after step {self._buf_steps[-1]}")
        fmt_obj = get_format(fmt if fmt is not None else self._meta["tensors"][tid]["format"])
        if not (isinstance(scale, (int, float, np.floating)) or np.ndim(scale) == 0):
            raise TypeError(f"{name!r}: scale must be a scalar (per-tensor scaling)")
        scale_f = float(np.float32(float(scale)))
        r = _histogram_and_counts(x, fmt_obj, scale_f, self.rounding, self.hist_mantissa_bits)
        if not self._buf_steps or self._buf_steps[-1] != step:
            self._complete_steps_ready()  # the previous step is now complete
            self._buf_steps.append(step)
        self._buf.append(
            dict(
                step=step, tensor=tid, format=self._format_id(fmt_obj.name), numel=r.numel,
                zero=r.zero, nan=r.nan, inf=r.inf,
                amax=float(r.amax if amax is None else float(amax)), scale=scale_f,
                overflow=r.overflow if overflow is None else int(overflow),
                underflow=r.underflow if underflow is None else int(underflow),
                bins=r.bins, counts=r.counts,
            )
        )  # fmt: skip

    def _complete_steps_ready(self) -> None:
        # called when a new step starts: every buffered step is complete
        if len(self._buf_steps) >= self.chunk_steps:
            self._write_chunk()

    def save_tensor(self, step: int, name: str, x: Any) -> Path:
        """Store the full tensor as ``tensors/{step:08d}-{index:05d}.safetensors`` (atomic).

        Keeps the dtype (float32, bfloat16, float16, float64). Returns the file path.
        """
        self._check_open()
        import torch
        from safetensors.torch import save

        tid = self._tensor_id(name)
        if type(x).__module__.startswith("torch"):
            t = x.detach().cpu().contiguous()
        else:
            a = np.ascontiguousarray(np.asarray(x))
            if a.dtype.name == "bfloat16":
                t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
            else:
                t = torch.from_numpy(a.copy())
        data = save({name: t}, metadata={"step": str(int(step)), "name": name})
        path = self.path / _TENSOR_DIR / f"{int(step):08d}-{tid:05d}.safetensors"
        _atomic_write(path, lambda f: f.write(data))
        return path

    # -- output ----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every buffered step (all are treated as complete) and trace.json."""
        self._check_open()
        if self._buf:
            self._write_chunk()
        self._write_meta()

    def close(self) -> None:
        """Flush and close; further calls raise ValueError."""
        if self._closed:
            return
        self.flush()
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"trace writer for {self.path} is closed")

    def _write_meta(self) -> None:
        if self._meta_dirty:
            text = json.dumps(self._meta, indent=1)
            _atomic_write(self.path / _TRACE_JSON, lambda f: f.write(text.encode()))
            self._meta_dirty = False

    def _write_chunk(self) -> None:
        self._write_meta()  # the catalogue first: a reader never sees a chunk it cannot name
        rows = self._buf
        cols: dict[str, np.ndarray] = {}
        for c, dt in zip(SCALAR_COLUMNS, _COLUMN_DTYPES):
            cols[c] = np.array([r[c] for r in rows], dtype=dt)
        sizes = np.array([r["bins"].size for r in rows], dtype=np.int64)
        cols["hist_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        cols["hist_bins"] = np.concatenate([r["bins"] for r in rows] + [np.zeros(0, np.uint32)])
        cols["hist_counts"] = np.concatenate([r["counts"] for r in rows] + [np.zeros(0, np.int64)])
        first, last = self._buf_steps[0], self._buf_steps[-1]
        name = f"chunk-{self._seq:06d}-s{first:08d}-{last:08d}.npz"
        _atomic_write(self.path / _CHUNK_DIR / name, lambda f: np.savez_compressed(f, **cols))
        self._seq += 1
        self._last_flushed_step = last
        self._buf = []
        self._buf_steps = []


_COLUMN_DTYPES = (
    np.int64, np.int32, np.int16, np.int64, np.int64, np.int64, np.int64,
    np.float64, np.float64, np.int64, np.int64,
)  # fmt: skip


def _json_ready(d: dict) -> dict:
    try:
        json.dumps(d)
    except TypeError as exc:
        raise TypeError(f"trace config must be JSON-serializable: {exc}") from None
    return d


def _list_chunks(path: Path) -> list[tuple[int, int, int, Path]]:
    """(seq, first_step, last_step, path) of every complete chunk file, by seq."""
    out = []
    d = path / _CHUNK_DIR
    if d.is_dir():
        for f in d.iterdir():
            m = _CHUNK_RE.match(f.name)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), f))
    return sorted(out)


# ------------------------------------------------------------------------------------------
# reader
# ------------------------------------------------------------------------------------------
class TraceReader:
    """Read a trace directory. Chunks are loaded lazily, one at a time.

    Attributes: ``config`` (run config), ``tensors`` (list of :class:`TensorInfo`),
    ``rounding``, ``hist_mantissa_bits``, ``meta`` (the whole trace.json).
    Bad or unreadable files raise ValueError naming the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.refresh()

    def refresh(self) -> None:
        """Re-scan: pick up chunks written since the reader was opened."""
        # chunks first, then trace.json: the writer updates trace.json before a chunk, so every
        # chunk listed here is named by the catalogue read below
        self._chunks = _list_chunks(self.path)
        meta_path = self.path / _TRACE_JSON
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{self.path}: not an fp8sim trace (no trace.json)") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{meta_path}: unreadable trace.json ({exc})") from None
        if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
            raise ValueError(f"{meta_path}: not an fp8sim trace (schema != {SCHEMA!r})")
        if meta.get("version") != VERSION:
            raise ValueError(f"{meta_path}: trace version {meta.get('version')}, expected {VERSION}")
        try:
            config = meta.get("config", {})
            rounding = meta.get("rounding", "rne")
            hist_bits = meta["hist"]["mantissa_bits"]
            if isinstance(hist_bits, bool) or not isinstance(hist_bits, int):
                raise TypeError(f"hist.mantissa_bits {hist_bits!r} is not an int")
            formats = [str(f) for f in meta.get("formats", [])]
            tensors = [
                TensorInfo(str(t["name"]), str(t["role"]), str(t["format"]),
                           tuple(int(n) for n in t["shape"]), i)  # fmt: skip
                for i, t in enumerate(meta.get("tensors", []))
            ]
        except Exception as exc:  # missing keys, wrong types: one line naming the file
            raise ValueError(f"{meta_path}: corrupt trace.json: {type(exc).__name__}: {exc}") from None
        self.meta = meta
        self.config = config
        self.rounding = rounding
        self.hist_mantissa_bits = hist_bits
        self.formats = formats
        self.tensors = tensors
        self._by_name = {t.name: t for t in self.tensors}
        self._cache: tuple[Path, dict[str, np.ndarray]] | None = None

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"{self.path}: no tensor {name!r} in the trace") from None

    @property
    def chunk_files(self) -> list[Path]:
        return [c[3] for c in self._chunks]

    def _load_chunk(self, path: Path) -> dict[str, np.ndarray]:
        if self._cache is not None and self._cache[0] == path:
            return self._cache[1]
        try:
            with np.load(path, allow_pickle=False) as z:
                cols = {k: z[k] for k in z.files}
        except Exception as exc:  # zipfile/OSError/ValueError: a corrupt chunk
            raise ValueError(f"{path}: corrupt trace chunk ({type(exc).__name__}: {exc})") from None
        need = set(SCALAR_COLUMNS) | {"hist_offsets", "hist_bins", "hist_counts"}
        if not need <= set(cols):
            raise ValueError(f"{path}: trace chunk lacks columns {sorted(need - set(cols))}")
        n = cols["step"].size
        if any(cols[c].shape != (n,) for c in SCALAR_COLUMNS) or cols["hist_offsets"].size != n + 1:
            raise ValueError(f"{path}: trace chunk columns differ in length")
        if any(cols[c].dtype.kind not in "iu" for c in ("tensor", "format", "hist_offsets")):
            raise ValueError(f"{path}: trace chunk index columns are not integers")
        if cols["tensor"].size and int(cols["tensor"].max()) >= len(self.tensors):
            self.refresh()  # written after we read trace.json
            if int(cols["tensor"].max()) >= len(self.tensors):
                raise ValueError(f"{path}: chunk names a tensor missing from trace.json")
        if cols["tensor"].size and int(cols["tensor"].min()) < 0:
            raise ValueError(f"{path}: corrupt trace chunk: negative tensor index")
        if cols["format"].size and (
            int(cols["format"].min()) < 0 or int(cols["format"].max()) >= len(self.formats)
        ):
            raise ValueError(
                f"{path}: corrupt trace chunk: format index outside 0..{len(self.formats) - 1}"
            )
        off = cols["hist_offsets"]
        nb = cols["hist_bins"].size
        if (
            off.size == 0 or int(off[0]) < 0 or int(off[-1]) > nb
            or cols["hist_counts"].size != nb or (np.diff(off) < 0).any()
        ):  # fmt: skip
            raise ValueError(f"{path}: corrupt trace chunk: histogram offsets out of order or range")
        self._cache = (path, cols)
        return cols

    def steps(self) -> np.ndarray:
        """Sorted distinct steps recorded."""
        parts = [np.unique(self._load_chunk(p)["step"]) for p in self.chunk_files]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def scalars(self, name: str | None = None) -> dict[str, np.ndarray]:
        """Per-record scalar columns (:data:`SCALAR_COLUMNS`) over all chunks, in record order;
        only ``name``'s records if given. ``tensor`` is the catalogue index, ``format`` an
        index into ``self.formats``."""
        tid = self.tensor(name).index if name is not None else None
        out: dict[str, list[np.ndarray]] = {c: [] for c in SCALAR_COLUMNS}
        for p in self.chunk_files:
            cols = self._load_chunk(p)
            sel = slice(None) if tid is None else cols["tensor"] == tid
            for c in SCALAR_COLUMNS:
                out[c].append(cols[c][sel])
        return {
            c: (np.concatenate(v) if v else np.zeros(0, dt))
            for (c, v), dt in zip(out.items(), _COLUMN_DTYPES)
        }

    def _record(self, cols: dict[str, np.ndarray], i: int) -> TraceRecord:
        off = cols["hist_offsets"]
        a, b = int(off[i]), int(off[i + 1])
        zero, nan, inf = int(cols["zero"][i]), int(cols["nan"][i]), int(cols["inf"][i])
        hist = AbsHistogram(
            cols["hist_bins"][a:b], cols["hist_counts"][a:b], self.hist_mantissa_bits,
            zero=zero, nan=nan, inf=inf,
        )  # fmt: skip
        return TraceRecord(
            step=int(cols["step"][i]), name=self.tensors[int(cols["tensor"][i])].name,
            format=self.formats[int(cols["format"][i])], numel=int(cols["numel"][i]),
            zero=zero, nan=nan, inf=inf, amax=float(cols["amax"][i]),
            scale=float(cols["scale"][i]), overflow=int(cols["overflow"][i]),
            underflow=int(cols["underflow"][i]), hist=hist,
        )  # fmt: skip

    def records(self, name: str | None = None) -> Iterator[TraceRecord]:
        """Every record with its histogram, in write order (steps ascending); chunk by chunk."""
        tid = self.tensor(name).index if name is not None else None
        for p in self.chunk_files:
            cols = self._load_chunk(p)
            idx = range(cols["step"].size) if tid is None else np.flatnonzero(cols["tensor"] == tid)
            for i in idx:
                yield self._record(cols, int(i))

    def record(self, step: int, name: str) -> TraceRecord:
        """The record of ``name`` at ``step``."""
        tid = self.tensor(name).index
        for _, first, last, p in self._chunks:
            if first <= step <= last:
                cols = self._load_chunk(p)
                idx = np.flatnonzero((cols["step"] == step) & (cols["tensor"] == tid))
                if idx.size:
                    return self._record(cols, int(idx[0]))
        raise ValueError(f"{self.path}: no record of {name!r} at step {step}")

    def histogram(self, step: int, name: str) -> AbsHistogram:
        """The |x| histogram of ``name`` at ``step``."""
        return self.record(step, name).hist

    def saved_tensors(self) -> list[tuple[int, str]]:
        """(step, name) of every full tensor saved, sorted."""
        d = self.path / _TENSOR_DIR
        out = []
        if d.is_dir():
            for f in d.iterdir():
                m = _TENSOR_RE.match(f.name)
                if m and int(m.group(2)) < len(self.tensors):
                    out.append((int(m.group(1)), self.tensors[int(m.group(2))].name))
        return sorted(out)

    def tensor_file(self, step: int, name: str) -> Path:
        """Path of a saved tensor's safetensors file."""
        p = self.path / _TENSOR_DIR / f"{int(step):08d}-{self.tensor(name).index:05d}.safetensors"
        if not p.is_file():
            raise ValueError(f"{self.path}: no saved tensor {name!r} at step {step}")
        return p

    def load_tensor(self, step: int, name: str) -> Any:
        """A saved tensor as a CPU torch tensor (its recorded dtype)."""
        from safetensors.torch import load_file

        p = self.tensor_file(step, name)
        try:
            return load_file(str(p))[name]
        except Exception as exc:
            raise ValueError(f"{p}: unreadable saved tensor ({exc})") from None
