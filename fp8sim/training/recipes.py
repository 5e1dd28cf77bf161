"""The recipes now live in :mod:`fp8sim.recipes` (the core); this module re-exports them so
``from fp8sim.training.recipes import get_recipe`` keeps working (``fp8sim.training`` exports
the same names)."""

from fp8sim.recipes import *  # noqa: F401,F403
from fp8sim.recipes import __all__  # noqa: F401
