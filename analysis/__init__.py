"""fp8sim analysis: open tensor dumps safely and lazily, single-pass FP8 statistics, policy replay
over recorded traces, reports and plots. Depends on the ``fp8sim`` core; ``fp8sim`` never imports
``analysis``.

Packages and modules: :mod:`analysis.dumps` (loading, FP8 companion scales), :mod:`analysis.stats`
(numba statistics), :mod:`analysis.replay` (policies over traces), :mod:`analysis.report`
(classes, tables, JSON, --fail-on), :mod:`analysis.plots` (PNG), :mod:`analysis.commands`
(``fp8sim analyze``/``replay``).
"""

__all__ = ["dumps", "stats", "replay", "report", "plots", "commands"]
