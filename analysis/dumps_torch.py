"""Lazy, memory-bounded loading of PyTorch ``.pt``/``.pth`` dumps (see :mod:`analysis.dumps`).

Only ``torch.load(..., weights_only=True)``: a pickle that wants to run code is refused with a
clear message, never executed. Zip-format files are memory-mapped and read in chunks, dropping
the mapped pages behind the reader.
"""

from __future__ import annotations

import ctypes
import mmap
import pickle
import warnings
from typing import Any

import numpy as np

from analysis.dumps import FLOAT_DTYPES, Dump, TensorSource

__all__ = ["open_pt"]

# ------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------
_libc = None


def _drop_pages(addr: int, nbytes: int) -> None:
    """madvise(MADV_DONTNEED) the whole pages of [addr, addr + nbytes): the mmap'd file pages
    leave resident memory and are read again from the file if touched."""
    global _libc
    if nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return
    page = mmap.PAGESIZE
    lo = (addr + page - 1) // page * page
    hi = (addr + nbytes) // page * page
    if hi > lo:
        _libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED)


def _torch_reader(t: Any, dtype: str, mmapped: bool):
    import torch

    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    if dtype == "bfloat16":
        flat = flat.view(torch.int16)

    def read(start: int, stop: int) -> np.ndarray:
        part = flat[start:stop]
        out = part.numpy().copy()
        if mmapped:
            _drop_pages(part.data_ptr(), part.numel() * part.element_size())
        return out.view(np.uint16) if dtype == "bfloat16" else out

    return read


#: most container entries and tensors a .pt may hold (a pickle of shared references can
#: describe an exponentially large tree in a few KB)
MAX_PT_NODES = 100_000


def _flatten(obj: Any, prefix: str, out: list[tuple[str, Any]], skipped: list, depth: int = 0,
             seen: dict[int, str] | None = None, budget: list[int] | None = None,
             path: str = "") -> None:  # fmt: skip
    """Dotted (name, tensor) pairs of a loaded .pt object. A container or tensor reached again
    through a shared reference is reported once, under its first name (later names are noted
    in ``skipped``). More than :data:`MAX_PT_NODES` entries raise ValueError naming ``path``."""
    import torch

    if seen is None:
        seen = {}
    if budget is None:
        budget = [MAX_PT_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"{path}: more than {MAX_PT_NODES} entries in the .pt object; refused")
    if depth > 64:
        skipped.append((prefix, "nested too deeply"))
        return
    if isinstance(obj, (torch.Tensor, np.ndarray)) or (isinstance(obj, (dict, list, tuple)) and obj):
        first = seen.get(id(obj))
        if first is not None:
            skipped.append((prefix or "value", f"same object as {first or '(root)'}"))
            return
        seen[id(obj)] = prefix
    if isinstance(obj, torch.Tensor):
        out.append((prefix or "tensor", obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, skipped, depth + 1, seen,
                     budget, path)  # fmt: skip
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out, skipped, depth + 1, seen,
                     budget, path)  # fmt: skip
    elif isinstance(obj, np.ndarray):
        out.append((prefix or "array", torch.from_numpy(obj)))
    else:
        skipped.append((prefix or "value", f"not a tensor ({type(obj).__name__})"))


def _torch_dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def open_pt(path: str) -> Dump:
    import torch

    def load(use_mmap: bool):
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error says it all
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)

    mmapped = True
    try:
        try:
            obj = load(True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc).lower():
                raise
            mmapped = False  # the legacy (pre-zip) format cannot be mmap'd
            obj = load(False)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        detail = next((ln.strip() for ln in first if "GLOBAL" in ln or "Unsupported" in ln), "")
        raise ValueError(
            f"{path}: refused: the pickle wants to run code, and .pt files are loaded with "
            f"torch.load(weights_only=True) only ({detail or 'unsafe pickle'})"
        ) from None
    except Exception as exc:  # truncated zip, EOF, bad magic number, ...
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: corrupt or truncated torch file ({msg})") from None
    pairs: list[tuple[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    _flatten(obj, "", pairs, skipped, path=path)
    tensors = []
    for name, t in pairs:
        if t.layout != torch.strided:
            skipped.append((name, f"{str(t.layout).replace('torch.', '')} tensor (only dense tensors are read)"))
            continue
        dtype = _torch_dtype_name(t.dtype)
        reader = _torch_reader(t, dtype, mmapped) if dtype in FLOAT_DTYPES else None
        tensors.append(TensorSource(name, path, tuple(t.shape), dtype, reader))
    return Dump(path, "pt", tensors, skipped)
