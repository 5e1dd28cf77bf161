"""Tensors already in memory as a :class:`~fp8sim.analysis.dumps.core.Dump`: a numpy array, a
torch tensor, or a dict (a ``state_dict``) / list / tuple of them, nested, so that they are
analyzed exactly as the same tensors read from a file.

Names are dotted as in a ``.pt`` file (``{"model": {"layers": [w]}}`` -> ``model.layers.0``; a
bare array is ``array``, a bare tensor ``tensor``); an object reached twice is analyzed once,
under its first name (the others are skipped with a note); entries that are no array or tensor
are skipped with a note. Dtypes: as for files (:data:`~fp8sim.analysis.dumps.core.FLOAT_DTYPES`:
float16, bfloat16 -- torch's or ml_dtypes' --, float32, float64 and the FP8 dtypes of torch or
ml_dtypes; others are skipped with a note).

Nothing is copied whole: a contiguous array is read through views of its flat elements, a
strided one (a transpose, a slice) piece by piece. A torch tensor on a device (CUDA) is made
contiguous there once and copied to the host a chunk at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from fp8sim.analysis.dumps.core import RAW_DTYPES, Dump, TensorSource, unique_names
from fp8sim.analysis.dumps.strided import copy_c_range

__all__ = ["memory_dump", "is_in_memory"]

#: deepest nesting of containers read (deeper entries are skipped with a note)
MAX_DEPTH = 64


def _is_torch_tensor(x: Any) -> bool:
    from fp8sim.emulator import is_torch_tensor

    return is_torch_tensor(x)


def is_in_memory(x: Any) -> bool:
    """Whether ``x`` is something :func:`memory_dump` reads (an array, a tensor, a mapping)."""
    return isinstance(x, (np.ndarray, Mapping)) or _is_torch_tensor(x)


def _array_reader(arr: np.ndarray, raw: Any) -> Callable[[int, int], np.ndarray]:
    """read(start, stop) of the flat C-order elements of ``arr`` as ``raw`` (same item size)."""
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1).view(raw)
        return lambda start, stop: flat[start:stop]
    return lambda start, stop: copy_c_range(arr, start, stop).view(raw)


def _numpy_source(name: str, label: str, arr: np.ndarray) -> TensorSource:
    dtype = arr.dtype.name
    raw = RAW_DTYPES.get(dtype)
    if dtype in ("float16", "float32", "float64"):
        raw = arr.dtype  # its byte order kept: TensorSource.read makes it native
    reader = _array_reader(arr, raw) if raw is not None else None
    return TensorSource(name, label, tuple(int(n) for n in arr.shape), dtype, reader)


def _torch_source(name: str, label: str, t: Any) -> TensorSource | tuple[str, str]:
    """A source of a dense tensor, or (name, why it is skipped)."""
    import torch

    if t.layout != torch.strided:
        return name, f"{str(t.layout).replace('torch.', '')} tensor (only dense tensors are read)"
    if t.device.type == "meta":
        return name, "meta tensor (it holds no data)"
    dtype = str(t.dtype).replace("torch.", "")
    shape = tuple(int(n) for n in t.shape)
    raw = RAW_DTYPES.get(dtype)
    if raw is None:
        return TensorSource(name, label, shape, dtype, None)
    t = t.detach()
    if dtype == "bfloat16":
        t = t.view(torch.int16)  # the bits; same element size, any strides
    elif np.dtype(raw) == np.uint8:
        t = t.view(torch.uint8)  # FP8 / E8M0 codes
    if t.device.type == "cpu":
        return TensorSource(name, label, shape, dtype, _array_reader(t.numpy(), raw))
    flat = t.contiguous().reshape(-1)  # on its device; chunks come to the host one at a time
    return TensorSource(name, label, shape, dtype,
                        lambda start, stop: flat[start:stop].cpu().numpy().view(raw))  # fmt: skip


def _flatten(obj: Any, prefix: str, out: list, skipped: list, seen: dict[int, str],
             depth: int = 0) -> None:  # fmt: skip
    """Dotted (name, array or tensor) pairs of ``obj``; skipped entries as (name, reason)."""
    leaf = isinstance(obj, np.ndarray) or _is_torch_tensor(obj)
    if leaf or (isinstance(obj, (Mapping, list, tuple)) and obj):
        first = seen.get(id(obj))
        if first is not None:
            skipped.append((prefix or "value", f"same object as {first or '(root)'}"))
            return
        seen[id(obj)] = prefix
    if depth > MAX_DEPTH:
        skipped.append((prefix, "nested too deeply"))
    elif leaf:
        out.append((prefix or ("array" if isinstance(obj, np.ndarray) else "tensor"), obj))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, skipped, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out, skipped, seen, depth + 1)
    else:
        skipped.append((prefix or "value", f"not a tensor ({type(obj).__name__})"))


def memory_dump(obj: Any, label: str) -> Dump:
    """``obj`` (an array, a tensor, or a mapping / list / tuple of them) as a dump named
    ``label`` (it stands where a file's path stands: in records, notes and errors)."""
    pairs: list[tuple[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    _flatten(obj, "", pairs, skipped, {})
    tensors = []
    for name, x in unique_names(pairs):
        src = _numpy_source(name, label, x) if isinstance(x, np.ndarray) else _torch_source(name, label, x)
        if isinstance(src, TensorSource):
            tensors.append(src)
        else:
            skipped.append(src)
    return Dump(label, "memory", tensors, skipped)
