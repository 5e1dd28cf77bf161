"""Checkpoints: everything a run needs to continue as if it had never stopped.

One file, ``checkpoint.pt`` in the run directory, written atomically (temp file + rename, so a
kill during the write leaves the previous checkpoint intact) and read with
``torch.load(weights_only=True)`` (a checkpoint is untrusted input). It holds the model and
optimizer state dicts, the FP8 scaling policies' states, the data position (the number of
completed steps: batch ``i`` is a pure function of the seed and ``i``, see
:mod:`fp8sim.training.data`), the torch and Python RNG states, and the run config it belongs to.

Policy states may contain numpy arrays, which ``weights_only`` loading refuses; they are stored
as ``{"__ndarray__": tensor}`` and turned back into arrays on load.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp8sim.atomic_file import atomic_write
from fp8sim.input_files import open_regular

__all__ = ["CHECKPOINT_NAME", "save_checkpoint", "load_checkpoint", "capture_rng", "restore_rng", "to_storable",
           "from_storable", "restored"]

CHECKPOINT_NAME = "checkpoint.pt"
_FORMAT_VERSION = 1


def to_storable(obj: Any) -> Any:
    """``obj`` with numpy arrays and scalars replaced by what ``torch.load(weights_only=True)``
    accepts (arrays as ``{"__ndarray__": tensor, "dtype": name}``); inverse: :func:`from_storable`."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(obj).copy()), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_storable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_storable(v) for v in obj)
    return obj


def from_storable(obj: Any) -> Any:
    """Undo :func:`to_storable`: ``{"__ndarray__": ...}`` entries become numpy arrays again."""
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            return obj["__ndarray__"].numpy().astype(obj["dtype"], copy=True)
        return {k: from_storable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_storable(v) for v in obj)
    return obj


def capture_rng() -> dict:
    """The torch (CPU) and Python ``random`` generator states."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(
    run_dir: str | os.PathLike,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    policies: dict | None,
    config: dict,
    extra: dict | None = None,
) -> Path:
    """Write the checkpoint after ``step`` completed steps; returns its path.

    ``extra``: more plain-data state stored under its own keys (e.g. a recorder's policies).
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    payload = {
        "version": _FORMAT_VERSION,
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "policies": to_storable(policies),
        "rng": capture_rng(),
        "config": to_storable(config),
    }
    for key, value in (extra or {}).items():
        if key in payload:
            raise ValueError(f"save_checkpoint: extra key {key!r} collides with a checkpoint field")
        payload[key] = to_storable(value)
    save_whole(payload, path)
    return path


class _KeepsWriteError:
    """A file object for ``torch.save`` that keeps the ``OSError`` a write raised: torch reports
    a failed write as a RuntimeError of its own (``[enforce fail at inline_container.cc:672] .
    unexpected pos 768 vs 662`` on a full disk), which says neither the file nor the reason."""

    def __init__(self, f) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def _torch_save(payload: dict, f) -> None:
    """``torch.save(payload, f)``; a write that failed raises its own ``OSError`` (a full disk:
    ENOSPC), which :func:`~fp8sim.atomic_file.atomic_write` then names with the file."""
    kept = _KeepsWriteError(f)
    try:
        torch.save(payload, kept)
    except RuntimeError:
        if kept.error is not None:
            raise kept.error from None
        raise


def save_whole(payload: dict, path: Path, *, root: Path | None = None) -> None:
    """``torch.save`` of ``payload`` into ``path`` whole or not at all (an interrupted save leaves
    the old file and removes its temporary one; a full disk is a :class:`~fp8sim.atomic_file.
    WriteError` naming ``path``), and the temporary files of saves killed outright (SIGKILL)
    before it removed. ``root``: the run directory (the directories between it and ``path`` are
    made without following links, see :func:`~fp8sim.atomic_file.atomic_write`)."""
    atomic_write(path, lambda f: _torch_save(payload, f), root=root)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # atomic_write's own names only
        stale.unlink(missing_ok=True)


def load_payload(path: Path, version: int, keys: tuple[str, ...]) -> dict:
    """The dict ``torch.load(path, weights_only=True)`` gives, checked: ValueError ``"<path>:
    corrupt or not an fp8sim checkpoint (...)"`` for an unreadable file, another object, another
    format version or missing ``keys``."""
    try:
        with open_regular(path) as f:  # a FIFO: refused, never opened
            body = torch.load(f, map_location="cpu", weights_only=True)
    except ValueError as exc:
        if str(exc).startswith(str(path)):  # not a regular file, unreadable: said as it is
            raise
        raise ValueError(f"{path}: corrupt or not an fp8sim checkpoint ({_first_line(exc)})") from None
    except Exception as exc:  # truncated zip, EOF, a refused pickle, deep nesting, ...
        raise ValueError(f"{path}: corrupt or not an fp8sim checkpoint ({_first_line(exc)})") from None
    if not isinstance(body, dict):
        raise ValueError(f"{path}: corrupt or not an fp8sim checkpoint (a {type(body).__name__})")
    if body.get("version") != version:
        raise ValueError(f"{path}: checkpoint version {body.get('version')!r}, expected {version}")
    missing = [k for k in keys if k not in body]
    if missing:
        raise ValueError(f"{path}: corrupt or not an fp8sim checkpoint (no {', '.join(missing)})")
    for key, least in (("step", 0), ("rank", 0), ("world", 1)):  # counts: exact ints in range
        v = body.get(key, least)
        if type(v) is not int or not least <= v < 2**62:
            raise ValueError(f"{path}: corrupt checkpoint: {key} {v!r:.40} is not an int >= {least}")
    if not isinstance(body.get("config", {}), dict):
        raise ValueError(f"{path}: corrupt checkpoint: its config is a {type(body['config']).__name__}")
    return body


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def load_checkpoint(run_dir: str | os.PathLike) -> dict:
    """Read ``run_dir/checkpoint.pt`` (weights_only). Raises FileNotFoundError when absent."""
    path = Path(run_dir) / CHECKPOINT_NAME
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    payload = load_payload(path, _FORMAT_VERSION, ("step", "model", "optimizer", "policies", "rng", "config"))
    return restored(path, payload)


def restored(path: Path, payload: dict) -> dict:
    """:func:`from_storable` of a payload read from ``path``; ValueError naming the file for one
    that is damaged (an array entry that is none, nesting too deep to walk)."""
    try:
        return {k: from_storable(v) for k, v in payload.items()}
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else f"{type(exc).__name__}: {_first_line(exc)}"
        raise ValueError(f"{path}: corrupt checkpoint ({why})") from None
