"""The JSON files of ``analyze`` and ``replay``: strict JSON text, where it may be written, and
writing it whole or not at all."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fp8sim.atomic_file import atomic_write
from fp8sim.errors import ArgumentError

__all__ = ["json_ready", "json_text", "check_json_path", "write_json"]


def json_ready(v: Any) -> Any:
    """``v`` for strict JSON: numpy scalars as Python numbers, tuples as lists, non-finite
    floats as None (``null``)."""
    if isinstance(v, dict):
        return {k: json_ready(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_ready(x) for x in v]
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


def json_text(obj: Any) -> str:
    """Strict JSON of ``obj`` (:func:`json_ready`), indented by one space, no final newline."""
    return json.dumps(json_ready(obj), indent=1, allow_nan=False)


def check_json_path(path: str | os.PathLike, inputs: Sequence[str] = (), *,
                    name: str = "path") -> None:  # fmt: skip
    """Refuse a JSON destination that cannot be written, or that would overwrite data: one of
    the ``inputs`` read, or a file inside an fp8sim trace directory. Cheap (no data is read):
    call it before long work too. Raises :class:`~fp8sim.errors.ArgumentError` naming ``name``.
    """
    from fp8sim.trace import is_trace

    dest = os.fspath(path)
    if not dest.strip():
        raise ArgumentError.about(name, ": an empty path (give a file, or - for stdout)")
    real = os.path.realpath(dest)  # a link is followed: its target is written (atomic_write)
    parent = os.path.dirname(real)
    if os.path.isdir(real):
        raise ArgumentError.about(name, f" {dest}: is a directory")
    special = os.path.exists(real) and not os.path.isfile(real)  # /dev/null, a FIFO: in place
    if special and not os.access(real, os.W_OK):
        raise ArgumentError.about(name, f" {dest}: not writable")
    if not special:
        if not os.path.isdir(parent):
            raise ArgumentError.about(name, f" {dest}: no such directory {parent}")
        if not os.access(parent, os.W_OK) or (os.path.exists(real) and not os.access(real, os.W_OK)):
            raise ArgumentError.about(name, f" {dest}: not writable")
    if any(real == os.path.realpath(f) for f in inputs):
        raise ArgumentError.about(name, f" {dest}: is one of the files analyzed (it would be "
                                        "overwritten)")  # fmt: skip
    d = os.path.dirname(real)
    while True:
        try:
            inside = is_trace(d)
        except ValueError:  # a damaged trace is still a trace
            inside = True
        if inside:
            raise ArgumentError.about(name, f" {dest}: inside the fp8sim trace {d}, whose files "
                                            "it could overwrite; write it elsewhere")  # fmt: skip
        up = os.path.dirname(d)
        if up == d:
            return
        d = up


def write_json(path: str | os.PathLike, obj: Any, *, name: str = "path") -> None:
    """Strict JSON of ``obj`` and a newline to ``path``, written whole or not at all (a temporary
    file renamed over it: an interrupted run leaves the old file, never half a new one).
    :class:`~fp8sim.errors.ArgumentError` naming ``name`` if it cannot be written."""
    text = json_text(obj) + "\n"
    try:
        atomic_write(Path(path), lambda f: f.write(text.encode()), links="follow")  # the user's path
    except OSError as exc:
        raise ArgumentError.about(name, f" {os.fspath(path)}: cannot write "
                                        f"({exc.strerror or exc})") from None  # fmt: skip
