"""The fp8sim trace format: per-step tensor statistics of a run, written by the training recorder
and read by ``fp8sim.analysis`` (neither imports the other; both import this package).

Import everything from here (``from fp8sim.trace import TraceReader``). The modules:

- :mod:`fp8sim.trace.layout`: the directory layout, file names, chunk columns, :func:`is_trace`;
- :mod:`fp8sim.trace.histogram`: the |x| histograms and why their over/underflow counts are exact;
- :mod:`fp8sim.trace.statistics`: one pass over a tensor for its record, on the tensor's device;
- :mod:`fp8sim.trace.background`: :class:`BackgroundWriter`, a trace writer on its own thread;
- :mod:`fp8sim.trace.writer`: :class:`TraceWriter` (atomic writes; whole steps per chunk);
- :mod:`fp8sim.trace.reader`: :class:`TraceReader`, :class:`TensorInfo`, :class:`TraceRecord`;
- :mod:`fp8sim.trace.checks`: the consistency checks the reader runs on untrusted files;
- :mod:`fp8sim.trace.truncate`: cutting a trace back to a step (a resumed run);
- :mod:`fp8sim.trace.merge`: one trace per run, the rank traces merged by placement.
"""

from fp8sim.trace.histogram import (
    COUNT_ROUNDINGS,
    DEFAULT_HIST_MANTISSA_BITS,
    EXPONENT_MAX,
    EXPONENT_MIN,
    AbsHistogram,
    CastThresholds,
    cast_thresholds,
)
from fp8sim.trace.layout import ROLES, SCALAR_COLUMNS, SCHEMA, VERSION, is_trace
from fp8sim.trace.statistics import abs_histogram
from fp8sim.trace.reader import TensorInfo, TraceReader, TraceRecord
from fp8sim.trace.truncate import truncate_trace
from fp8sim.trace.merge import merge_rank_traces, rank_trace_dirs, read_rank_scales
from fp8sim.trace.writer import TraceWriter

__all__ = [
    "TraceWriter",
    "TraceReader",
    "TensorInfo",
    "TraceRecord",
    "truncate_trace",
    "merge_rank_traces",
    "rank_trace_dirs",
    "read_rank_scales",
    "is_trace",
    "AbsHistogram",
    "CastThresholds",
    "abs_histogram",
    "cast_thresholds",
    "ROLES",
    "SCALAR_COLUMNS",
    "SCHEMA",
    "VERSION",
    "EXPONENT_MIN",
    "EXPONENT_MAX",
    "DEFAULT_HIST_MANTISSA_BITS",
    "COUNT_ROUNDINGS",
]
