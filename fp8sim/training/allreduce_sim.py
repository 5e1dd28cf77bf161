"""Deprecated: the simulated FP8 all-reduce moved to :mod:`fp8sim.allreduce_sim` (the numerics,
shared by training and analysis) and :mod:`fp8sim.analysis.allreduce_replay` (over a recorded
trace). The names this module had still resolve, for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

_REPLAY = ("load_rank_gradients", "replay_allreduce", "format_allreduce_report")


def __getattr__(name: str) -> Any:
    import importlib

    home = "fp8sim.analysis.allreduce_replay" if name in _REPLAY else "fp8sim.allreduce_sim"
    module = importlib.import_module(home)  # by name: training never imports analysis itself
    if not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"fp8sim.training.allreduce_sim.{name} moved to {home}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(module, name)
