"""fp8sim analysis: FP8 statistics of tensors (files, checkpoints, traces, arrays in memory) and
scaling policies replayed over recorded traces. Depends on the ``fp8sim`` core; ``fp8sim`` never
imports ``analysis``.

From Python::

    from fp8sim.analysis import analyze, replay
    result = analyze("checkpoint/", formats="e4m3,e5m2", scalings="tensor,mx")
    result.worst(5); result.table(); result.to_json("analysis.json"); result.to_pandas()
    replay("my-trace", ["delayed:history=16", "current"]).table()

Modules: :mod:`.api` (:func:`analyze`), :mod:`.replay_api` (:func:`replay`), :mod:`.results`,
:mod:`.replay_result` and :mod:`.records`
(what they return), :mod:`.dumps` (loading, FP8 companion scales), :mod:`.stats` (numba
statistics), :mod:`.jobs` (tensors in worker processes: ``jobs=N``), :mod:`.merge`
(:func:`merge_results`: results of parts of one job, e.g. one per machine), :mod:`.trace_summary` (a trace's recorded statistics), :mod:`.verdict` (per-layer
verdicts of a trace), :mod:`.policy_replay`
(policies over traces, the columns), :mod:`.status` (the ok / warning / critical rule),
:mod:`.report` (tables, ``fail_on`` rules),
:mod:`.json_output` (JSON files), :mod:`.plots` (PNG), :mod:`.allreduce_replay` (the simulated
FP8 all-reduce over a trace). The commands (``fp8sim analyze`` / ``replay`` / ``demo``) live in
the CLI layer, :mod:`fp8sim.commands`.

The names below are imported on first use (PEP 562): ``fp8sim --help`` registers the commands
without loading numba.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8sim.lazy_exports import lazy_attributes

#: public name -> the module that defines it
_EXPORTS = {
    "analyze": "fp8sim.analysis.api",
    "replay": "fp8sim.analysis.replay_api",
    "merge_results": "fp8sim.analysis.merge",
    "load_result": "fp8sim.analysis.merge",
    "AnalysisResult": "fp8sim.analysis.results",
    "ReplayResult": "fp8sim.analysis.replay_result",
    "Log2Histogram": "fp8sim.analysis.results",
    "TensorRecord": "fp8sim.analysis.records",
    "TraceTensorRecord": "fp8sim.analysis.records",
    "Note": "fp8sim.analysis.records",
    "BadInput": "fp8sim.analysis.records",
    "Crossing": "fp8sim.analysis.records",
    "PolicySummary": "fp8sim.analysis.records",
    "ReplayRecord": "fp8sim.analysis.records",
    "ReplayCrossing": "fp8sim.analysis.records",
    "LayerVerdict": "fp8sim.analysis.records",
    "TraceSummary": "fp8sim.analysis.trace_summary",
    "Thresholds": "fp8sim.analysis.status",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports
    from fp8sim.analysis.api import analyze
    from fp8sim.analysis.merge import load_result, merge_results
    from fp8sim.analysis.replay_api import replay
    from fp8sim.analysis.records import (
        BadInput,
        Crossing,
        LayerVerdict,
        Note,
        PolicySummary,
        ReplayCrossing,
        ReplayRecord,
        TensorRecord,
        TraceTensorRecord,
    )
    from fp8sim.analysis.replay_result import ReplayResult
    from fp8sim.analysis.results import AnalysisResult, Log2Histogram
    from fp8sim.analysis.status import Thresholds
    from fp8sim.analysis.trace_summary import TraceSummary


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
