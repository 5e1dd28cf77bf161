"""Backends: one interface (:class:`~fp8sim.backends.base.Backend`), three implementations.

``get("emulator")`` -- the numba emulator (CPU, the reference);
``get("torch")`` -- torch native float8 casts, ``torch._scaled_mm`` where the GPU has it;
``get("triton")`` -- the Triton kernels of ``kernels/`` (GPU, or the interpreter with
``TRITON_INTERPRET=1``), imported only when asked for.
"""

from __future__ import annotations

import importlib

from fp8sim.backends.base import AdamStepResult, Backend

__all__ = ["get", "BACKENDS", "Backend", "AdamStepResult"]

#: name -> (module, class); modules are imported on first use (triton is heavy and optional)
BACKENDS = {
    "emulator": ("fp8sim.backends.emulator", "EmulatorBackend"),
    "torch": ("fp8sim.backends.torch_backend", "TorchBackend"),
    "triton": ("fp8sim.backends.triton_backend", "TritonBackend"),
}

_INSTANCES: dict[str, Backend] = {}


def get(name: str) -> Backend:
    """The backend called ``name`` (one shared, stateless instance per name)."""
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    if key == "triton":
        _check_triton_usable()
    if key not in _INSTANCES:
        module, cls = BACKENDS[key]
        _INSTANCES[key] = getattr(importlib.import_module(module), cls)()
    return _INSTANCES[key]


def _check_triton_usable() -> None:
    """ValueError, in words a user can act on, when the triton backend cannot run here: Triton
    not installed (an optional extra), or neither a CUDA GPU nor Triton's CPU interpreter."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        raise ValueError("backend 'triton' needs Triton, which is not installed: "
                         "pip install 'fp8sim[gpu]' (or pip install triton)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError("backend 'triton' needs a CUDA GPU, or TRITON_INTERPRET=1 in the "
                         "environment (set before fp8sim starts) to run its kernels in Triton's "
                         "CPU interpreter")
