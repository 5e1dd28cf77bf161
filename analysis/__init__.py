"""fp8sim analysis: FP8 statistics of tensors (files, checkpoints, traces, arrays in memory) and
scaling policies replayed over recorded traces. Depends on the ``fp8sim`` core; ``fp8sim`` never
imports ``analysis``.

From Python::

    from fp8sim.analysis import analyze, replay
    result = analyze("checkpoint/", formats="e4m3,e5m2", scalings="tensor,mx")
    result.worst(5); result.table(); result.to_json("analysis.json"); result.to_pandas()
    replay("my-trace", ["delayed:history=16", "current"]).table()

Modules: :mod:`.api` (:func:`analyze`, :func:`replay`), :mod:`.results` and :mod:`.records`
(what they return), :mod:`.dumps` (loading, FP8 companion scales), :mod:`.stats` (numba
statistics), :mod:`.trace_summary` (a trace's recorded statistics), :mod:`.policy_replay`
(policies over traces, the columns), :mod:`.report` (classes, tables, ``fail_on`` rules),
:mod:`.json_output` (JSON files), :mod:`.plots` (PNG), :mod:`.commands` (``fp8sim analyze`` /
``replay``), :mod:`.demo` (``fp8sim demo``).
"""

from fp8sim.analysis.api import analyze, replay
from fp8sim.analysis.records import (
    BadInput,
    Crossing,
    Note,
    PolicySummary,
    ReplayCrossing,
    ReplayRecord,
    TensorRecord,
    TraceTensorRecord,
)
from fp8sim.analysis.results import AnalysisResult, Log2Histogram, ReplayResult
from fp8sim.analysis.trace_summary import TraceSummary

__all__ = [
    "analyze",
    "replay",
    "AnalysisResult",
    "ReplayResult",
    "TensorRecord",
    "TraceTensorRecord",
    "TraceSummary",
    "Log2Histogram",
    "Note",
    "BadInput",
    "Crossing",
    "PolicySummary",
    "ReplayRecord",
    "ReplayCrossing",
]
