"""fp8sim's tests.

Importing this package first imports Hugging Face's ``kernels`` (a hard dependency of
transformers 5.x) with the repository root out of sys.path. Only a run from a checkout needs it:
pytest, and the test subprocesses that ``import tests.*``, put the root on sys.path, where the
folder ``kernels/`` -- installed as ``fp8sim.kernels``, never as a top-level ``kernels``
(tests/test_packaging.py) -- would shadow the PyPI package of that name.
"""

import importlib
import importlib.util
import os
import sys


def _import_foreign_kernels() -> None:
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != root]
    try:
        if "kernels" not in sys.modules and importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")  # Hugging Face's; stays in sys.modules
    finally:
        sys.path[:] = saved


_import_foreign_kernels()
