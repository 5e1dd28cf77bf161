"""safetensors files, checked as the ``safetensors`` library checks them (see :mod:`analysis.dumps`).

The header is parsed and checked before a byte of tensor data is read:

* the header is one JSON object whose keys occur once each (a key given twice would hide the
  first tensor, as a plain ``json.loads`` keeps only the last);
* each entry's ``data_offsets`` lie inside the data section and hold exactly its shape's bytes;
* the tensors' byte ranges cover the data section exactly: no two share a byte, no byte lies in
  a gap between them or after the last one (bytes no tensor claims mean a damaged or foreign
  file). Tensors with no elements take no bytes; an entry whose dtype the analysis does not read
  is skipped, but its byte range still counts.

Tensors are read lazily by ``os.pread`` (:func:`analysis.dumps.core.pread_reader`).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from fp8sim.input_files import open_regular
from fp8sim.analysis.dumps.core import ITEMSIZE, RAW_DTYPES, SAFETENSORS_DTYPES, Dump, TensorSource
from fp8sim.analysis.dumps.core import checked_numel, pread_reader

__all__ = ["open_safetensors", "MAX_HEADER_BYTES"]

#: largest header the reader parses (the safetensors library's own limit is 100 MB)
MAX_HEADER_BYTES = 100 << 20


class _DuplicateKey(ValueError):
    """A JSON object of the header names a key twice."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for the header: a dict, or _DuplicateKey for a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _read_header(path: str, size: int) -> tuple[dict[str, Any], int]:
    """(the header object, its length in bytes). ValueError naming ``path`` otherwise."""
    with open_regular(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: corrupt safetensors: header size {hlen} exceeds the file")
        raw = f.read(hlen)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise ValueError(f"{path}: corrupt safetensors header: the key {exc.args[0]!r} is given "
                         "twice (the first entry would be lost)") from None  # fmt: skip
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        text = str(exc).strip()
        raise ValueError(f"{path}: corrupt safetensors header "
                         f"({text.splitlines()[0] if text else type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, hlen


def _check_coverage(path: str, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """ValueError unless the byte ranges ``(begin, end, name)`` tile ``[0, data_size)`` exactly:
    two that share bytes, a gap, or bytes after the last one. Empty ranges take no bytes."""
    reach, last = 0, ""  # the furthest end so far, and whose
    for begin, end, name in sorted(s for s in spans if s[1] > s[0]):
        if begin < reach:
            raise ValueError(f"{path}: corrupt safetensors: {last!r} and {name!r} share bytes "
                             f"(offsets overlap at {begin})")  # fmt: skip
        if begin > reach:
            after = f"after {last!r}" if last else "at the start of the data section"
            raise ValueError(f"{path}: corrupt safetensors: bytes {reach}..{begin} {after} "
                             "belong to no tensor")  # fmt: skip
        reach, last = end, name
    if reach != data_size:
        n = data_size - reach
        raise ValueError(f"{path}: corrupt safetensors: " + (
            f"{n} bytes after the last tensor ({last!r}) belong to no tensor" if last
            else f"{n} bytes of data, but no tensor holds any"))  # fmt: skip


def open_safetensors(path: str) -> Dump:
    """Open a safetensors file (see the module docstring). Raises ValueError ``"<path>: ..."``
    for a corrupt, truncated or inconsistent one."""
    size = os.path.getsize(path)
    header, hlen = _read_header(path, size)
    data_start = 8 + hlen
    data_size = size - data_start
    tensors, skipped = [], []
    spans: list[tuple[int, int, str]] = []  # (begin, end, name) of every entry
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, raw_shape = info["dtype"], info["shape"]
            begin, end = info["data_offsets"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt safetensors header entry {name!r}") from None
        shape, numel = checked_numel(raw_shape, f"{path}: {name!r}")
        if begin < 0 or end < begin:
            raise ValueError(f"{path}: corrupt: safetensors {name!r} has data_offsets "
                             f"[{begin}, {end}]")  # fmt: skip
        dtype = SAFETENSORS_DTYPES.get(st_dtype)
        if dtype is not None and end - begin != numel * ITEMSIZE[dtype]:
            raise ValueError(
                f"{path}: corrupt: safetensors {name!r} has {end - begin} bytes for shape "
                f"{list(shape)} of {st_dtype}"
            )
        if end > data_size:
            raise ValueError(
                f"{path}: truncated safetensors: {name!r} needs bytes up to {end}, "
                f"the data section has {data_size}"
            )
        spans.append((begin, end, name))  # a skipped entry's bytes are still its own
        if dtype is None:
            skipped.append((name, f"unsupported dtype {st_dtype}"))
            continue
        reader = None
        if dtype in RAW_DTYPES:
            reader = pread_reader(path, data_start + begin, RAW_DTYPES[dtype], ITEMSIZE[dtype])
        tensors.append(TensorSource(name, path, shape, dtype, reader))
    _check_coverage(path, spans, data_size)
    return Dump(path, "safetensors", tensors, skipped)
