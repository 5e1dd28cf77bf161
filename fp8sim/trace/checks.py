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
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp8sim.formats import get_format
from fp8sim.trace.histogram import COUNT_ROUNDINGS

__all__ = ["check_catalogue", "check_chunk_sequence", "check_chunk_values"]


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


def check_chunk_values(path: Path, cols: dict[str, np.ndarray], first: int, last: int,
                       n_bins: int) -> None:  # fmt: skip
    """ValueError ``"<path>: corrupt trace chunk: ..."`` unless the columns hold what the writer
    writes (see the module docstring). ``first``, ``last``: the steps the file name gives;
    ``n_bins``: the histogram's number of bin ids."""

    def bad(what: str) -> None:
        raise ValueError(f"{path}: corrupt trace chunk: {what}")

    step = cols["step"].astype(np.int64)
    if step.size and (step.min() < first or step.max() > last):
        bad(f"steps outside {first}..{last}, the range its name gives")
    if (np.diff(step) < 0).any():
        bad("steps out of order")
    for c in ("numel", "zero", "nan", "inf", "overflow", "underflow"):
        if cols[c].size and cols[c].min() < 0:
            bad(f"negative {c}")
    counts = cols["hist_counts"].astype(np.int64)
    if counts.size and counts.min() < 0:
        bad("negative histogram counts")
    off = cols["hist_offsets"].astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(counts)])
    nonzero = cum[off[1:]] - cum[off[:-1]]
    zero, nan, inf = (cols[c].astype(np.int64) for c in ("zero", "nan", "inf"))
    if (zero + nan + inf + nonzero != cols["numel"]).any():
        bad("zero + nan + inf + histogram total differs from numel")
    if (cols["overflow"] > cols["numel"] - nan - inf).any() or (cols["underflow"] > nonzero).any():
        bad("more overflow than finite values, or more underflow than nonzero ones")
    with np.errstate(over="ignore", invalid="ignore"):
        scale = cols["scale"].astype(np.float32)
    if not (np.isfinite(scale) & (scale > 0)).all():
        bad("a scale that is not finite and > 0 as a float32")
    if (cols["amax"] < 0).any():
        bad("negative amax")
    bins = cols["hist_bins"].astype(np.int64)
    if bins.size and (bins.min() < 0 or bins.max() >= n_bins):
        bad(f"histogram bin ids outside 0..{n_bins - 1}")
    rises = np.diff(bins) > 0
    starts = off[1:-1]  # the first bin of every record after the first
    rises[starts[(starts > 0) & (starts < bins.size)] - 1] = True
    if not rises.all():
        bad("histogram bins not ascending within a record")
