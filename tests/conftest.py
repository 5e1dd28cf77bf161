"""Shared test setup.

Triton runs through its CPU interpreter unless a CUDA GPU is present; the variable must be set
before triton (or anything importing it) is imported, so it is set here, first.
"""

import os

import torch  # noqa: E402  (after os; torch does not import triton at import time)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache"))
