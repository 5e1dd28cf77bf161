"""Lazy, memory-bounded loading of PyTorch ``.pt``/``.pth`` dumps (see :mod:`analysis.dumps`).

Only torch's weights-only unpickler: a pickle that wants to run code (import a global, call or
build an object torch does not allow) is refused with a clear message, never executed. Bytes that
are no pickle torch can read (random bytes, a damaged pickle) are called that, with torch's reason.

* Zip-format files (torch >= 1.6): ``torch.load(weights_only=True, mmap=True)``; tensors are read
  in chunks out of the mapping, dropping the mapped pages behind the reader. Non-contiguous
  tensors are copied piece by piece (:mod:`analysis.dumps.strided`), never made contiguous whole.
* Legacy files (``_use_new_zipfile_serialization=False``), which torch cannot mmap: the pickles
  are read with the weights-only unpickler onto meta-device storages (no data), the storages'
  byte offsets are taken from the file's storage records, and tensors are read from the file by
  ``pread`` or a strided mapping, bounded like the rest. A legacy file this cannot lay out
  (storage views from very old torch, big-endian) is loaded whole by ``torch.load``, with a note on
  stderr saying so.
* Zip-format files whose members are compressed (deflate: a zip rewritten by a tool, not
  ``torch.save``): mapped, the compressed bytes would be taken for tensor data, and loaded whole
  torch would inflate them all in memory (a 9 MB file of zeros can declare GBs). They are inflated
  piece by piece into a temporary stored copy (member data 64-byte aligned, as ``torch.save``
  aligns it), which is mapped like any other and unlinked at once; memory stays bounded, disk takes
  the inflated size. Other compression methods (bzip2, LZMA), which torch cannot read, are refused.
* Tensors whose shape covers far more elements than their storage holds (``expand()``, stride 0,
  overlapping ``as_strided`` views: 2**36 elements over one stored float) are refused one by one
  (a bad tensor: exit 2, ``--keep-going`` analyzes the others), never read element by element:
  see :data:`MAX_ELEMENTS_PER_STORED`.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import tempfile
import warnings
import zipfile
import zlib
from typing import Any

import numpy as np

from fp8sim.input_files import open_regular
from fp8sim.analysis.dumps.core import (
    RAW_DTYPES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    Dump,
    TensorSource,
    pread_reader,
    unique_names,
)
from fp8sim.analysis.dumps.strided import copy_c_range, drop_pages, mmap_strided_reader, readahead

__all__ = ["open_pt", "MAX_ELEMENTS_PER_STORED", "ALWAYS_READ_ELEMENTS"]

#: a tensor whose shape covers more than this many elements per element its storage holds is
#: refused (an expanded or overlapping view: the work would be that many times the bytes given)...
MAX_ELEMENTS_PER_STORED = 16
#: ... unless it has at most this many elements (cheap to read whatever its strides)
ALWAYS_READ_ELEMENTS = 1 << 24

def _torch_reader(t: Any, dtype: str, mmapped: bool):
    """read(start, stop) of a loaded tensor. Contiguous: slices of its flat view. Strided: copied
    piece by piece out of a numpy view of its storage (never ``t.contiguous()``, which would copy
    the whole tensor). ``mmapped``: drop the file pages behind each read."""
    import torch

    if dtype == "bfloat16":
        t = t.view(torch.int16)  # same element size: works for any strides
    elif dtype in FP8_DTYPES or dtype == "float8_e8m0fnu":
        t = t.view(torch.uint8)  # the codes
    if not t.is_contiguous():
        arr = t.numpy()  # a strided view of the storage, no copy
        drop = None
        if mmapped:
            st = t.untyped_storage()
            bounds = (st.data_ptr(), st.data_ptr() + st.nbytes())
            drop = lambda a, n: drop_pages(a, n, bounds)  # noqa: E731

        def strided(start: int, stop: int) -> np.ndarray:
            out = copy_c_range(arr, start, stop, drop=drop)
            return out.view(np.uint16) if dtype == "bfloat16" else out

        return readahead(strided, t.numel(), t.element_size())
    flat = t.reshape(-1)

    def read(start: int, stop: int) -> np.ndarray:
        part = flat[start:stop]
        out = part.numpy().copy()
        if mmapped:
            drop_pages(part.data_ptr(), part.numel() * part.element_size())
        return out.view(np.uint16) if dtype == "bfloat16" else out

    return read


class _NotLegacy(Exception):
    """The file is no legacy-format .pt this module can lay out without loading it."""


def _load_legacy_layout(path: str) -> tuple[Any, dict[int, int]]:
    """Read a legacy (pre-zip, ``_use_new_zipfile_serialization=False``) .pt without its data:
    (the object with its tensors on the meta device, {storage ``_cdata``: byte offset of the
    storage's data in the file}).

    The format: pickles of the magic number, protocol version and system info, the object pickle
    (storages as persistent ids), the pickled list of storage keys, then per key an int64 element
    count and the raw bytes. Every pickle goes through torch's weights-only unpickler: a pickle
    that wants to run code raises ``pickle.UnpicklingError`` before anything runs.

    Raises _NotLegacy when the header is not the legacy one (or uses storage views or byte orders
    this reader does not lay out), ValueError for a truncated or inconsistent file.
    """
    import torch
    from torch._weights_only_unpickler import Unpickler
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    roots: dict[str, tuple[Any, Any, int]] = {}  # key -> (meta storage, dtype, numel)

    def persistent_load(pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[5] is None):
            raise _NotLegacy(f"persistent id {type(pid).__name__} (storage views are not laid out)")
        _, storage_type, key, _location, numel, _view = pid
        dtype = storage_type.dtype
        if key not in roots:
            size = int(numel) * torch._utils._element_size(dtype)
            roots[key] = (torch.UntypedStorage(size, device="meta"), dtype, int(numel))
        return torch.storage.TypedStorage(wrap_storage=roots[key][0], dtype=dtype, _internal=True)

    size = os.path.getsize(path)
    with open_regular(path) as f:
        try:
            head = [Unpickler(f, encoding="utf-8").load() for _ in range(3)]
        except Exception as exc:  # tar-era files, raw pickles, garbage: torch.load decides
            raise _NotLegacy(str(exc)) from None
        if head[0] != MAGIC_NUMBER or head[1] != PROTOCOL_VERSION or not (
            isinstance(head[2], dict) and head[2].get("little_endian") is True
        ):
            raise _NotLegacy("not a little-endian legacy .pt header")
        unpickler = Unpickler(f, encoding="utf-8")
        unpickler.persistent_load = persistent_load
        obj = unpickler.load()
        keys = Unpickler(f, encoding="utf-8").load()
        if not isinstance(keys, list) or set(keys) != set(roots):
            raise ValueError(f"{path}: corrupt legacy .pt: storage keys do not match the object")
        pos = f.tell()
        offsets = {}
        for key in keys:
            storage, dtype, numel = roots[key]
            f.seek(pos)
            head8 = f.read(8)
            if len(head8) < 8:
                raise ValueError(f"{path}: truncated legacy .pt: storage {key} missing")
            (n,) = struct.unpack("<q", head8)
            if n != numel:
                raise ValueError(f"{path}: corrupt legacy .pt: storage {key} holds {n} elements, "
                                 f"its tensors say {numel}")  # fmt: skip
            offsets[storage._cdata] = pos + 8
            pos += 8 + n * torch._utils._element_size(dtype)
            if pos > size:
                raise ValueError(f"{path}: truncated legacy .pt: storage {key} ends past the file")
    return obj, offsets


def _legacy_reader(path: str, t: Any, dtype: str, offsets: dict[int, int]):
    """read(start, stop) of a meta tensor laid out by :func:`_load_legacy_layout`: pread when it
    is contiguous, else a strided copy out of a file mapping (both bounded)."""
    isz = t.element_size()
    storage = t.untyped_storage()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    if t.numel() and (last + 1) * isz > storage.nbytes():
        raise ValueError(f"{path}: corrupt legacy .pt: a tensor reaches past its storage")
    offset = offsets[storage._cdata] + t.storage_offset() * isz
    if t.is_contiguous():
        return pread_reader(path, offset, RAW_DTYPES[dtype], isz)
    strides = tuple(s * isz for s in t.stride())
    return mmap_strided_reader(path, offset, tuple(t.shape), strides, RAW_DTYPES[dtype])


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _torch_dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


#: zip compression methods by number, for messages
_ZIP_METHODS = {zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "LZMA"}


def _compressed_zip(path: str) -> bool:
    """Whether a zip-format .pt has compressed members (then it cannot be memory-mapped: torch
    would map the compressed bytes as tensor data). ValueError for a method torch cannot read
    (only stored and deflated members are). False when Python's zipfile cannot read the
    directory: torch.load then says what is wrong."""
    try:
        with zipfile.ZipFile(path) as zf:
            methods = {i.compress_type for i in zf.infolist()} - {zipfile.ZIP_STORED}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False
    unreadable = sorted(methods - {zipfile.ZIP_DEFLATED})
    if unreadable:
        how = ", ".join(_ZIP_METHODS.get(m, f"method {m}") for m in unreadable)
        raise ValueError(f"{path}: zip members compressed with {how}, which torch cannot read "
                         "(only stored or deflated members)")  # fmt: skip
    return bool(methods)


#: the zip extra field id torch.save pads its local headers with (to align member data)
_PAD_EXTRA_ID = 0x4246  # "FB"
_ALIGN = 64


def _inflated_copy(path: str) -> str:
    """A temporary stored (uncompressed) copy of the zip ``path``, every member inflated piece by
    piece (16 MiB at a time: memory bounded, whatever size a member declares; zipfile checks each
    member's size and CRC-32), its data aligned to 64 bytes as torch.save aligns it. The caller
    unlinks it. ValueError naming ``path`` for a damaged member or a failed write."""
    fd, tmp = tempfile.mkstemp(prefix="fp8sim-inflated-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as raw, zipfile.ZipFile(path) as zin, \
                zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as zout:  # fmt: skip
            for info in zin.infolist():
                name = info.filename.encode("ascii" if info.filename.isascii() else "utf-8")
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.compress_type = zipfile.ZIP_STORED
                out.file_size = info.file_size
                zip64 = info.file_size * 1.05 > zipfile.ZIP64_LIMIT  # as zipfile decides it
                base = raw.tell() + 30 + len(name) + (20 if zip64 else 0) + 4
                pad = -base % _ALIGN
                out.extra = struct.pack("<HH", _PAD_EXTRA_ID, pad) + b"\0" * pad
                with zin.open(info) as src, zout.open(out, "w", force_zip64=zip64) as dst:
                    while piece := src.read(1 << 20):
                        dst.write(piece)
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        os.unlink(tmp)
        raise ValueError(f"{path}: corrupt compressed zip member ({_first_line(exc)})") from None
    except OSError as exc:
        os.unlink(tmp)
        raise ValueError(f"{path}: cannot inflate its compressed zip members into a temporary file "
                         f"in {tempfile.gettempdir()} ({exc.strerror or exc})") from None  # fmt: skip
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _expanded(t: Any) -> str | None:
    """Why a tensor is refused as far larger than its storage (see
    :data:`MAX_ELEMENTS_PER_STORED`), or None."""
    n = t.numel()
    if n <= ALWAYS_READ_ELEMENTS:
        return None
    stored = t.untyped_storage().nbytes() // max(1, t.element_size())
    if n <= MAX_ELEMENTS_PER_STORED * stored:
        return None
    return (f"its shape {list(t.shape)} covers {n} elements but its storage holds {stored} "
            f"(strides {list(t.stride())}: an expand()ed or overlapping view); refused, as reading "
            f"it would read each stored value {n // max(1, stored)} times over -- save "
            "t.contiguous() to analyze it")  # fmt: skip


#: what torch's weights-only unpickler says when a pickle wants to import, call or build
#: something it does not allow (GLOBAL, REDUCE, NEWOBJ, BUILD); everything else it raises is
#: about bytes it cannot parse
_CODE_SIGNS = ("GLOBAL", "call reduce", "create new object", "Can only build")
#: lines of torch's wrapping around the unpickler's own message
_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation",
                      "(1)", "(2)", "In PyTorch")  # fmt: skip


def _unpickling_error(path: str, exc: BaseException) -> ValueError:
    """The one-line ValueError of a pickle torch's weights-only unpickler refused: "refused: the
    pickle wants to run code" only when it refused to import or call something; otherwise the
    bytes are no valid torch pickle (random bytes, a damaged or foreign pickle)."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    detail = ""
    for ln in lines:
        if "WeightsUnpickler error:" in ln:
            detail = ln.split("WeightsUnpickler error:", 1)[1].strip()
        elif not detail and ln and not ln.startswith(_TORCH_BOILERPLATE):
            detail = ln
        if detail:
            break
    if not detail and lines:  # "Weights only load failed. <reason>" (e.g. a module to import)
        rest = lines[0].removeprefix("Weights only load failed.").strip()
        detail = "" if rest.startswith(("In PyTorch", "This file")) else rest
    if any(sign in detail for sign in _CODE_SIGNS):
        # torch's advice (add_safe_globals) is for code that calls torch.load itself; the fix
        # here is in how the file was saved
        detail = detail.split(" Please use `torch.serialization.add_safe_globals", 1)[0]
        return ValueError(f"{path}: refused: the pickle wants to run code ({detail}); .pt files are loaded "
                          "with torch.load(weights_only=True) only: save tensors, not objects (a whole "
                          "model: torch.save(model.state_dict(), path))")  # fmt: skip
    if "must be imported" in detail:  # NJTs, DTensors: a real torch file this reader cannot load
        return ValueError(f"{path}: torch.load(weights_only=True) cannot load it here ({detail})")
    return ValueError(f"{path}: not a valid PyTorch file (corrupt or not a torch.save pickle: "
                      f"{detail or type(exc).__name__})")  # fmt: skip


def _refused(reason: str):
    """read(start, stop) that refuses the tensor: ValueError ``reason`` (a bad tensor)."""

    def read(start: int, stop: int) -> np.ndarray:
        raise ValueError(reason)

    return read


def open_pt(path: str) -> Dump:
    import torch

    source = path  # what torch maps: the file, or the stored copy of a compressed zip

    def load(use_mmap: bool):
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error says it all
            warnings.simplefilter("ignore")
            return torch.load(source, map_location="cpu", weights_only=True, mmap=use_mmap)

    mmapped, offsets, whole = True, {}, None
    try:
        layout = None
        if zipfile.is_zipfile(path):
            if _compressed_zip(path):
                source = _inflated_copy(path)  # mapped below like a stored zip, then unlinked
        else:
            try:
                with warnings.catch_warnings():  # as in load(): the error says it all
                    warnings.simplefilter("ignore")
                    layout = _load_legacy_layout(path)
            except (ValueError, pickle.UnpicklingError):
                raise
            except Exception as exc:  # _NotLegacy, or a layout this reader does not handle
                whole = _first_line(exc)
        if layout is not None:
            (obj, offsets), mmapped = layout, False
        else:
            try:
                obj = load(True)
            except RuntimeError as exc:
                if "mmap" not in str(exc) and "zip" not in str(exc).lower():
                    raise
                mmapped = False  # not a zip: cannot be mmap'd, so torch reads it whole
                obj = load(False)
                print(f"note: {path}: loaded whole into memory (a non-zip .pt this reader cannot "
                      f"lay out: {whole})", file=sys.stderr)  # fmt: skip
    except ValueError:
        raise
    except pickle.UnpicklingError as exc:
        raise _unpickling_error(path, exc) from None
    except Exception as exc:  # truncated zip, EOF, bad magic number, a key torch did not find...
        why = _first_line(exc)
        if isinstance(exc, (LookupError, TypeError, AttributeError)):  # KeyError('101'): say so
            why = f"{type(exc).__name__}: {why}"
        raise ValueError(f"{path}: corrupt or truncated torch file ({why})") from None
    finally:
        if source != path:
            os.unlink(source)  # the mapping stays valid; the disk space goes with it
    pairs: list[tuple[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    _flatten(obj, "", pairs, skipped, path=path)
    tensors = []
    for name, t in unique_names(pairs):
        if t.layout != torch.strided:
            skipped.append((name, f"{str(t.layout).replace('torch.', '')} tensor (only dense tensors are read)"))
            continue
        dtype = _torch_dtype_name(t.dtype)
        reader = None
        why = _expanded(t) if dtype in RAW_DTYPES else None
        if why is not None:
            reader = _refused(f"{path}: {name}: {why}")
        elif dtype in FLOAT_DTYPES and t.device.type == "meta":
            reader = _legacy_reader(path, t, dtype, offsets)
        elif dtype in RAW_DTYPES:  # the float dtypes, and E8M0 (codes read only as companion scales)
            reader = _torch_reader(t, dtype, mmapped)
        tensors.append(TensorSource(name, path, tuple(t.shape), dtype, reader))
    return Dump(path, "pt", tensors, skipped)
