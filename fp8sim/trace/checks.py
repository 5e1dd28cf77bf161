"""Consistency checks a :class:`fp8sim.trace.TraceReader` runs on what it reads: a trace is
untrusted input (files can be lost, copied or edited), and a damaged one must fail with one line
naming the file, never replay wrong numbers or silently skip steps.

What the writer guarantees and is checked here:

* chunk files are numbered 0, 1, 2, ... without gaps (a truncation deletes from the last one
  down, so an interrupted one leaves a prefix), and their step ranges strictly ascend (a step is
  never flushed twice);
* within a chunk: steps inside the file name's range and non-decreasing (a tensor may have
  several records in one step: micro-batches, a layer called twice); counts non-negative;
  ``zero + nan + inf + (histogram total) == numel``; overflow at most the finite values,
  underflow at most the finite nonzero ones; scales finite and positive as float32 (the cast is
  rebuilt from them); amax non-negative (or NaN/inf); histogram bin ids strictly ascending within
  a record and inside the histogram's range.

Before any of that, the columns themselves (:func:`check_chunk_columns`): every one present,
one-dimensional, integer columns of an integer dtype and float columns of a float dtype (the one
verdict ``analyze`` and ``replay`` both act on), and every integer within ``0..2**62`` (counts
within :data:`MAX_COUNT`), so that no sum or difference the checks form wraps around in int64
(a uint64 count of ``2**64 - 1`` must not pass for ``-1``).

Across chunks: every chunk carries its trace's id (:func:`check_chunk_identity`: a chunk copied
in from another trace is refused, naming both), and one tensor's counts over the whole trace add
up to at most :data:`MAX_TOTAL` (:func:`check_count_totals`), so no figure summed from them is
inexact or wraps (1100 records of 2**53 values each would).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp8sim.formats import get_format
from fp8sim.trace.histogram import COUNT_ROUNDINGS
from fp8sim.trace.layout import SCALAR_COLUMNS

__all__ = ["check_catalogue", "check_chunk_columns", "check_chunk_sequence", "check_chunk_values",
           "check_chunk_identity", "check_count_totals", "MAX_COUNT", "MAX_TOTAL"]  # fmt: skip

#: the largest element count a record may hold (2**53: exact in float64 too); a sum of the four
#: counts of a record stays far inside int64
MAX_COUNT = 2**53
#: the largest sum of one tensor's counts over the whole trace (its numel over every step, say):
#: every sum of a column a reader forms is then exact in int64 (< 2**63), and none wraps around
MAX_TOTAL = 2**61
#: the largest step or index a column may hold
_MAX_INDEX = 2**62
#: the counts of a record
_COUNT_COLUMNS = ("numel", "zero", "nan", "inf", "overflow", "underflow")
#: chunk columns of floats; every other column holds integers
_FLOAT_COLUMNS = ("amax", "scale")
_HIST_COLUMNS = ("hist_offsets", "hist_bins", "hist_counts")


def check_catalogue(rounding: str, formats: list[str], tensors: list) -> None:
    """ValueError unless trace.json's rounding is one a writer takes, its formats are known and
    its tensor names are distinct (a second entry of a name would be merged away silently)."""
    if rounding not in COUNT_ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} is not one of {', '.join(COUNT_ROUNDINGS)}")
    for f in formats + [t.format for t in tensors]:
        get_format(f)  # ValueError naming the valid formats
    names = [t.name for t in tensors]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tensor names listed twice: {', '.join(dup)}")


def check_chunk_sequence(trace: Path, chunks: list[tuple[int, int, int, Path]]) -> None:
    """ValueError naming ``trace`` if a chunk is missing or the chunks' steps do not ascend.
    ``chunks``: (seq, first step, last step, path) by seq (:func:`fp8sim.trace.layout.list_chunks`)."""
    for i, (seq, first, last, f) in enumerate(chunks):
        if seq != i:
            raise ValueError(
                f"{trace}: damaged trace: chunk {i:06d} is missing (found {f.name} next); "
                "the steps it held would be lost"
            )
        if first > last:
            raise ValueError(f"{f}: damaged trace: steps {first}..{last} in the name run backwards")
        if i and first <= chunks[i - 1][2]:
            raise ValueError(
                f"{f}: damaged trace: starts at step {first}, not after step {chunks[i - 1][2]} "
                f"where {chunks[i - 1][3].name} ends (steps are written once, ascending)"
            )


def check_chunk_columns(path: Path, cols: dict[str, np.ndarray]) -> None:
    """Check, and normalise in place to int64 / float64, the columns of a chunk just loaded:
    ValueError ``"<path>: corrupt trace chunk: ..."`` for a missing column, one that is not 1-D,
    of another kind (strings, bools, structured; floats where integers belong), an integer
    outside ``0..2**62`` (a negative one passes here: the value checks name it), or lengths that
    disagree."""

    def bad(what: str) -> None:
        raise ValueError(f"{path}: corrupt trace chunk: {what}")

    missing = [c for c in (*SCALAR_COLUMNS, *_HIST_COLUMNS) if c not in cols]
    if missing:
        bad(f"lacks columns {missing}")
    for c in (*SCALAR_COLUMNS, *_HIST_COLUMNS):
        a = cols[c]
        if a.ndim != 1:
            bad(f"column {c} has shape {a.shape}, not one dimension")
        want = "f" if c in _FLOAT_COLUMNS else "iu"
        if a.dtype.kind not in want:
            bad(f"column {c} is {a.dtype}, not {'a float' if want == 'f' else 'an integer'} column")
        if want == "f":
            cols[c] = a.astype(np.float64)
            continue
        if a.size and (int(a.max()) > _MAX_INDEX or int(a.min()) < -_MAX_INDEX):
            bad(f"column {c} holds {int(a.max()) if int(a.max()) > _MAX_INDEX else int(a.min())}, "
                f"outside -2**62..2**62")  # fmt: skip
        cols[c] = a.astype(np.int64)
    n = cols["step"].size
    if any(cols[c].size != n for c in SCALAR_COLUMNS) or cols["hist_offsets"].size != n + 1:
        bad("columns differ in length")
    if cols["hist_counts"].size != cols["hist_bins"].size:
        bad("histogram bins and counts differ in length")


def check_chunk_values(path: Path, cols: dict[str, np.ndarray], first: int, last: int,
                       n_bins: int) -> None:  # fmt: skip
    """ValueError ``"<path>: corrupt trace chunk: ..."`` unless the columns hold what the writer
    writes (see the module docstring). ``first``, ``last``: the steps the file name gives;
    ``n_bins``: the histogram's number of bin ids."""

    def bad(what: str) -> None:
        raise ValueError(f"{path}: corrupt trace chunk: {what}")

    step = cols["step"]  # int64 and within +-2**62 (check_chunk_columns)
    if step.size and (step.min() < first or step.max() > last):
        bad(f"steps outside {first}..{last}, the range its name gives")
    if (np.diff(step) < 0).any():
        bad("steps out of order")
    for c in ("numel", "zero", "nan", "inf", "overflow", "underflow"):
        if cols[c].size and cols[c].min() < 0:
            bad(f"negative {c}")
        if cols[c].size and cols[c].max() > MAX_COUNT:
            bad(f"{c} {int(cols[c].max())} above 2**53")
    counts = cols["hist_counts"]
    if counts.size and counts.min() < 0:
        bad("negative histogram counts")
    if counts.size and float(counts.sum(dtype=np.float64)) > 2.0**62:  # float: the sum cannot wrap
        bad("histogram counts summing past 2**62")
    off = cols["hist_offsets"]
    cum = np.concatenate([[0], np.cumsum(counts)])
    nonzero = cum[off[1:]] - cum[off[:-1]]
    zero, nan, inf = (cols[c] for c in ("zero", "nan", "inf"))
    if (zero + nan + inf + nonzero != cols["numel"]).any():
        bad("zero + nan + inf + histogram total differs from numel")
    if (cols["overflow"] > cols["numel"] - nan - inf).any() or (cols["underflow"] > nonzero).any():
        bad("more overflow than finite values, or more underflow than nonzero ones")
    with np.errstate(over="ignore", invalid="ignore"):
        scale = cols["scale"].astype(np.float32)  # float64 here (check_chunk_columns)
    if not (np.isfinite(scale) & (scale > 0)).all():
        bad("a scale that is not finite and > 0 as a float32")
    if (cols["amax"] < 0).any():
        bad("negative amax")
    bins = cols["hist_bins"]
    if bins.size and (bins.min() < 0 or bins.max() >= n_bins):
        bad(f"histogram bin ids outside 0..{n_bins - 1}")
    rises = np.diff(bins) > 0
    starts = off[1:-1]  # the first bin of every record after the first
    rises[starts[(starts > 0) & (starts < bins.size)] - 1] = True
    if not rises.all():
        bad("histogram bins not ascending within a record")


def check_chunk_identity(path: Path, cols: dict[str, np.ndarray], trace: Path, trace_id: str | None) -> None:
    """Take the ``trace_id`` entry out of a chunk's columns and check it: ValueError naming the
    chunk, its trace's id, ``trace`` and its id, unless the chunk is ``trace``'s (the same id;
    a trace of an older fp8sim has none, and neither have its chunks). A chunk copied in from
    another trace is refused: its records would be credited to this trace's tensors."""
    raw = cols.pop("trace_id", None)
    if raw is not None and not (raw.ndim == 0 and raw.dtype.kind == "U"):
        raise ValueError(f"{path}: corrupt trace chunk: trace_id is {raw.dtype} of shape {raw.shape}, not a string")
    own = None if raw is None else str(raw)
    if own != trace_id:
        whose = f"a chunk of another trace (id {own})" if own is not None else "a chunk without a trace id"
        mine = f"id {trace_id}" if trace_id is not None else "which has no id: an older fp8sim's"
        raise ValueError(f"{path}: {whose}, not of {trace} ({mine}); refused: copied in from elsewhere?")


def check_count_totals(trace: Path, tensor: np.ndarray, cols: dict[str, np.ndarray], names: list[str]) -> None:
    """ValueError naming ``trace`` and the tensor unless each tensor's counts (``tensor``: the
    catalogue index of every record) add up to at most :data:`MAX_TOTAL`: a figure summed past
    it could not be exact (nor wrap-free) in int64, and no run records that many values."""
    if tensor.size == 0:
        return
    for c in _COUNT_COLUMNS:
        # float64 sums cannot wrap; their relative error (n * 2**-53, n records) leaves the exact
        # sum of a total that passes below 2**62, far inside int64
        totals = np.bincount(tensor, weights=cols[c].astype(np.float64))
        worst = int(np.argmax(totals))
        if totals[worst] > MAX_TOTAL:
            name = names[worst] if worst < len(names) else f"#{worst}"
            raise ValueError(f"{trace}: damaged trace: the {c} counts of {name!r} add up to about "
                             f"{totals[worst]:.3g}, past 2**61 (no run records that many values); "
                             "refused rather than summed inexactly")  # fmt: skip
