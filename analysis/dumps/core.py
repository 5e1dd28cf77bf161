"""Open tensor dumps safely and lazily: safetensors, torch .pt/.pth, .npy, .npz, directories of
them, and fp8sim traces.

Everything is untrusted input:

* ``.pt``/``.pth`` load only through ``torch.load(..., weights_only=True)``: a pickle that wants
  to import or call code is refused with a clear message and never executed.
* ``.npy``/``.npz`` load with ``allow_pickle=False`` semantics (object arrays are refused).
* safetensors headers are parsed and checked (:mod:`analysis.dumps.safetensors_reader`: no key
  twice, sizes matching shapes, byte ranges tiling the data section exactly) before a byte of
  tensor data is read.
* Only regular files (or symbolic links to them) are opened: a named pipe, socket or device with
  a dump's name is refused by name, never opened (opening a FIFO blocks until a writer comes).
* A stored (uncompressed) .npz member's CRC-32 is checked as its data is first read through
  (Fortran-ordered ones: when opened), as ``np.load`` checks it; deflated members are checked
  by zipfile itself. Big-endian arrays are read in native byte order, values unchanged.

Memory: tensor data is never loaded whole. A :class:`TensorSource` hands out flat C-order element
ranges (``read(start, stop)``) through ``os.pread`` (safetensors, .npy, stored .npz members), a
sequential decompressing stream (deflated .npz members), or torch's mmap with the pages dropped
again after each range (.pt), so resident memory stays bounded by the chunk size, not the dump.
Fortran-ordered arrays and non-contiguous tensors are copied out of a file mapping piece by piece
(:mod:`analysis.dumps.strided`), which bounds them the same way.

Nested containers (dicts, lists, tuples in a .pt; ``/`` in npz member names) become dotted names:
``{"model": {"layers": [{"w": t}]}}`` -> ``model.layers.0.w``. Two entries of one file that come
to the same name (key ``"a.b"`` next to ``{"a": {"b": ..}}``; members ``a/b.npy`` and ``a.b.npy``)
are told apart as ``a.b`` and ``a.b#2`` (:func:`unique_names`).

FP8 tensors (safetensors ``F8_E4M3``/``F8_E5M2``, torch's four float8 dtypes) read as the exact
float32 values of their codes (NaN codes: NaN), as stored: no companion scale is applied.
"""

from __future__ import annotations

import math
import os
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from fp8sim.input_files import open_regular
from fp8sim.analysis.dumps.strided import fortran_strides, mmap_strided_reader
from fp8sim.analysis.dumps.strided import spilled_strided_reader
from fp8sim.analysis.dumps.inputs import require_regular_file
from fp8sim.trace import TraceReader, is_trace

__all__ = [
    "TensorSource",
    "Dump",
    "open_dump",
    "expand_paths",
    "iter_dumps",
    "DUMP_SUFFIXES",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    # for the readers of each container (modules of this package)
    "SAFETENSORS_DTYPES",
    "ITEMSIZE",
    "RAW_DTYPES",
    "checked_numel",
    "pread_reader",
    "unique_names",
]

#: file suffixes recognised inside directories (and ``pytorch_model*.bin``: see expand_paths)
DUMP_SUFFIXES = (".safetensors", ".pt", ".pth", ".npy", ".npz")
#: torch checkpoints named ``.bin`` (Hugging Face ``pytorch_model.bin``) open as .pt files
_TORCH_BIN = ".bin"
_HF_BIN = re.compile(r"^pytorch_model.*\.bin$")  # pytorch_model.bin, pytorch_model-00001-of-00002.bin
#: FP8 dtypes (torch's names) and the fp8sim format whose decode table gives their values
FP8_DTYPES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float8_e4m3fnuz": "e4m3fnuz",
              "float8_e5m2fnuz": "e5m2fnuz"}  # fmt: skip
#: dtypes the analysis reads (others are listed as skipped)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64", *FP8_DTYPES)

SAFETENSORS_DTYPES = {
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
ITEMSIZE = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "int16": 2,
    "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
}  # fmt: skip
RAW_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
              "float64": np.float64, **{name: np.uint8 for name in (*FP8_DTYPES, "float8_e8m0fnu")},
              "uint8": np.uint8}  # E8M0: scales only; uint8: packed NVFP4 weights (fp4_scales)


def checked_numel(shape: Any, where: str) -> tuple[tuple[int, ...], int]:
    """(shape as a tuple of ints, element count) of a shape read from a file. Entries must be
    non-negative ints (not bools, not floats); the count is an exact Python int (never wraps).
    Raises ValueError ``"<where>: corrupt: ..."`` otherwise."""
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) and s >= 0
        for s in shape
    ):
        raise ValueError(f"{where}: corrupt: shape {shape!r} is not a list of non-negative ints")
    shape = tuple(int(s) for s in shape)
    return shape, math.prod(shape)


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """float32/float64 values of raw elements (bfloat16 given as uint16 bits, FP8 as uint8
    codes); exact."""
    if dtype in FP8_DTYPES:
        from fp8sim.emulator import decode_table

        return decode_table(FP8_DTYPES[dtype], np.float32)[raw]
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return raw.astype(np.float32)
    return raw


@dataclass
class TensorSource:
    """One tensor in a dump, read lazily.

    Attributes:
        name: dotted name inside the dump (``model.layers.0.w``; ``w@step100`` in a trace).
        file: the file it lives in.
        shape: tuple of ints.
        dtype: one of :data:`FLOAT_DTYPES` (or another dtype name for tensors the analysis
            skips; see :attr:`is_float`).
    """

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    _read_raw: Callable[[int, int], np.ndarray] = field(repr=False, default=None)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def read_raw(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` as stored (bfloat16 as uint16 bits, FP8 and E8M0 as uint8
        codes, possibly big-endian): the reader this source was opened with, unchecked."""
        return self._read_raw(start, stop)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flat C-order tensor as float32 (float16/bfloat16/
        float32/FP8 inputs, exact) or float64. Raises ValueError naming the file if the data cannot
        be read (truncated, corrupt)."""
        if not self.is_float:
            raise TypeError(f"{self.file}: {self.name} has dtype {self.dtype}, not a float tensor")
        start, stop = max(0, int(start)), min(self.numel, int(stop))
        if stop <= start:
            return np.zeros(0, np.float64 if self.dtype == "float64" else np.float32)
        try:
            raw = self._read_raw(start, stop)
        except ValueError:
            raise
        except Exception as exc:  # zlib/zip/OS errors while streaming
            raise ValueError(f"{self.file}: cannot read {self.name}: {exc}") from None
        if not raw.dtype.isnative:  # a big-endian .npy/.npz: the same values, native order
            raw = raw.astype(raw.dtype.newbyteorder("="))
        return _widen(raw, self.dtype)

    def read_all(self) -> np.ndarray:
        """The whole tensor in its shape (float32/float64). Loads it into memory."""
        return self.read(0, self.numel).reshape(self.shape)


@dataclass
class Dump:
    """An opened dump: ``tensors`` (float and non-float sources), ``skipped`` (name, reason) for
    entries that are no tensors at all, ``kind`` and, for traces, ``trace`` (a TraceReader)."""

    path: str
    kind: str
    tensors: list[TensorSource]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    trace: TraceReader | None = None


def unique_names(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Distinct names: a dotted name that comes again (key ``"a.b"`` next to ``{"a": {"b": ..}}``)
    becomes ``a.b#2``, ``a.b#3``, ... so no record is mistaken for another."""
    seen: dict[str, int] = {}
    taken = {name for name, _ in pairs}
    out = []
    for name, t in pairs:
        k = seen.get(name, 0) + 1
        seen[name] = k
        if k > 1:
            while f"{name}#{k}" in taken:
                k += 1
            taken.add(f"{name}#{k}")
            name = f"{name}#{k}"
        out.append((name, t))
    return out


# ------------------------------------------------------------------------------------------
# byte ranges
# ------------------------------------------------------------------------------------------
def pread_reader(path: str, offset: int, raw_dtype: Any, itemsize: int):
    """read(start, stop) of elements at byte ``offset`` of ``path`` through os.pread."""

    def read(start: int, stop: int) -> np.ndarray:
        nbytes = (stop - start) * itemsize
        buf = bytearray(nbytes)
        with open_regular(path) as f:
            view = memoryview(buf)
            got = 0
            while got < nbytes:
                n = os.preadv(f.fileno(), [view[got:]], offset + start * itemsize + got)
                if n == 0:
                    raise ValueError(
                        f"{path}: truncated: data ends {nbytes - got} bytes early"
                    )
                got += n
        return np.frombuffer(buf, dtype=raw_dtype)

    return read


# ------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------
def _open_safetensors(path: str) -> Dump:
    from fp8sim.analysis.dumps.safetensors_reader import open_safetensors  # header checks there

    return open_safetensors(path)


# ------------------------------------------------------------------------------------------
# numpy
# ------------------------------------------------------------------------------------------
def _npy_header(f, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) of the .npy header at ``f``. Errors of reading ``f`` itself
    (a damaged zip member: bad CRC-32, a broken deflate stream; an OS error) pass through: they
    are no fault of the header."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError):
        raise
    except Exception as exc:
        raise ValueError(f"{where}: corrupt .npy header ({exc})") from None
    if dtype.hasobject:
        raise ValueError(f"{where}: object arrays are refused (they are pickles)")
    return tuple(shape), bool(fortran), dtype


def _np_dtype_name(dt: np.dtype) -> tuple[str, Any]:
    """(dtype name, raw numpy dtype to read, or None for a non-float).

    An ml_dtypes bfloat16 array saved with numpy is stored as raw 2-byte voids (``<V2``): its
    type is lost and it is reported as ``void16`` (skipped), never guessed.
    """
    if dt.kind == "f" and dt.itemsize in (2, 4, 8):
        return dt.name, dt
    return dt.name, None


def _is_fortran_strided(fortran: bool, shape: tuple[int, ...]) -> bool:
    """Whether a Fortran-ordered array's C order differs from its memory order (two or more
    axes longer than 1)."""
    return fortran and sum(n > 1 for n in shape) > 1


def _open_npy(path: str) -> Dump:
    with open_regular(path) as f:
        shape, fortran, dt = _npy_header(f, path)
        offset = f.tell()
    name, raw = _np_dtype_name(dt)
    shape, numel = checked_numel(shape, path)
    size = os.path.getsize(path)
    have = size - offset
    if numel * dt.itemsize > size:
        raise ValueError(
            f"{path}: corrupt: shape {list(shape)} of {dt.name} needs {numel * dt.itemsize} "
            f"bytes, the file has {size}"
        )
    if have < numel * dt.itemsize:
        raise ValueError(
            f"{path}: truncated .npy: {numel * dt.itemsize} data bytes expected, {have} present"
        )
    reader = None
    if raw is not None:
        if _is_fortran_strided(fortran, shape):
            reader = mmap_strided_reader(path, offset, shape, fortran_strides(shape, dt.itemsize), raw)
        else:
            reader = pread_reader(path, offset, raw, dt.itemsize)
    return Dump(path, "npy", [TensorSource(Path(path).stem, path, shape, name, reader)])


def _zip_data_offset(path: str, info: zipfile.ZipInfo) -> int:
    """Byte offset of a stored zip member's data (after its local header)."""
    with open_regular(path) as f:
        f.seek(info.header_offset)
        local = f.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"{path}: corrupt zip local header of {info.filename}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _member_error(path: str, member: zipfile.ZipInfo, exc: BaseException) -> ValueError:
    """The one-line ValueError of a damaged .npz member: zipfile's "Bad CRC-32" is said as a
    CRC-32 mismatch of the member's data (as :func:`_crc_checked` says it)."""
    if "CRC" in str(exc):
        return ValueError(f"{path}: corrupt .npz member {member.filename} (CRC-32 mismatch: the "
                          "stored data is damaged)")  # fmt: skip
    return ValueError(f"{path}: corrupt .npz member {member.filename} ({exc})")


def _member_filler(path: str, member: zipfile.ZipInfo, header_len: int, nbytes: int):
    """fill(f): write the data bytes of a deflated npz member into ``f``, piece by piece (zipfile
    checks the CRC-32 at the end). Raises ValueError naming the member if it is damaged or
    short."""

    def fill(f) -> None:
        got = _read_member_through(path, member, header_len, f.write)
        if got != nbytes:
            raise ValueError(f"{path}: corrupt .npz member {member.filename}: {got} data bytes, "
                             f"{nbytes} expected")  # fmt: skip

    return fill


def _read_member_through(path: str, member: zipfile.ZipInfo, skip: int,
                         write: Callable[[bytes], Any]) -> int:  # fmt: skip
    """Read a zip member to its end (zipfile checks its CRC-32 there), handing every byte past
    the first ``skip`` to ``write``; returns their count. ValueError naming the member if it is
    damaged. Members are passed as ZipInfo, not by name: a zip may hold two of one name."""
    got = 0
    try:
        with zipfile.ZipFile(path) as zf, zf.open(member) as fh:
            fh.read(skip)
            while piece := fh.read(16 << 20):
                write(piece)
                got += len(piece)
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise _member_error(path, member, exc) from None
    return got


def _stream_reader(path: str, member: zipfile.ZipInfo, header_len: int, raw: Any, itemsize: int):
    """Sequential reads of a deflated npz member; a backwards read reopens the stream."""
    state: dict[str, Any] = {"pos": None, "zf": None, "fh": None}

    def read(start: int, stop: int) -> np.ndarray:
        if state["pos"] is None or start < state["pos"]:
            if state["zf"] is not None:
                state["fh"].close()
                state["zf"].close()
            state["zf"] = zipfile.ZipFile(path)
            state["fh"] = state["zf"].open(member)
            state["fh"].read(header_len)
            state["pos"] = 0
        fh = state["fh"]
        skip = (start - state["pos"]) * itemsize
        while skip > 0:
            got = fh.read(min(skip, 1 << 24))
            if not got:
                raise ValueError(f"{path}: truncated npz member {member.filename}")
            skip -= len(got)
        want = (stop - start) * itemsize
        data = fh.read(want)
        if len(data) != want:
            raise ValueError(f"{path}: truncated npz member {member.filename}")
        state["pos"] = stop
        return np.frombuffer(data, dtype=raw)

    return read


def _header_crc(zf: zipfile.ZipFile, info: zipfile.ZipInfo, header_len: int) -> int:
    """CRC-32 of a stored member's first ``header_len`` bytes (its .npy header)."""
    with zf.open(info) as fh:
        return zlib.crc32(fh.read(header_len))


def _crc_checked(read: Callable[[int, int], np.ndarray], crc: int, expected: int, numel: int,
                 where: str) -> Callable[[int, int], np.ndarray]:  # fmt: skip
    """``read`` that checks a stored .npz member's CRC-32 (numpy's np.load does, for the same
    reason: a stored member's bytes are otherwise taken as they are). The CRC runs over the
    data as it is first read through in order (the analysis' first pass does, chunk by chunk);
    the read that reaches the end raises ValueError ``where (CRC-32 mismatch...)`` if the data is
    damaged. ``crc``: the CRC of the member's header."""
    state = {"pos": 0, "crc": crc}

    def checked(start: int, stop: int) -> np.ndarray:
        arr = read(start, stop)
        if start == state["pos"] and stop > start:
            state["crc"] = zlib.crc32(np.ascontiguousarray(arr), state["crc"])
            state["pos"] = stop
            if stop == numel and state["crc"] != expected:
                raise ValueError(f"{where} (CRC-32 mismatch: the stored data is damaged)")
        return arr

    return checked


def _open_npz(path: str) -> Dump:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ValueError(f"{path}: corrupt .npz ({exc})") from None
    tensors, skipped = [], []
    with zf:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                skipped.append((info.filename, "not an .npy member"))
                continue
            member_name = info.filename[: -len(".npy")].replace("/", ".")
            try:
                with zf.open(info) as fh:
                    shape, fortran, dt = _npy_header(fh, f"{path}:{info.filename}")
                    header_len = fh.tell()
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
                raise _member_error(path, info, exc) from None
            name, raw = _np_dtype_name(dt)
            shape, numel = checked_numel(shape, f"{path}:{info.filename}")
            if info.file_size - header_len != numel * dt.itemsize:
                raise ValueError(
                    f"{path}: corrupt: .npz member {info.filename}: size does not match shape "
                    f"{list(shape)}"
                )
            reader = None
            if raw is not None:
                strided = _is_fortran_strided(fortran, shape)
                strides = fortran_strides(shape, dt.itemsize)
                if info.compress_type == zipfile.ZIP_STORED:
                    off = _zip_data_offset(path, info) + header_len
                    if off + numel * dt.itemsize > os.path.getsize(path):
                        raise ValueError(f"{path}: truncated .npz: member {info.filename} cut off")
                    if strided or numel == 0:  # read out of file order (or nothing): check now
                        _read_member_through(path, info, 0, lambda b: None)
                        reader = (mmap_strided_reader(path, off, shape, strides, raw) if strided
                                  else pread_reader(path, off, raw, dt.itemsize))  # fmt: skip
                    else:  # checked as the data is first read through, in order
                        where = f"{path}: corrupt .npz member {info.filename}"
                        reader = _crc_checked(pread_reader(path, off, raw, dt.itemsize),
                                              _header_crc(zf, info, header_len), info.CRC,
                                              numel, where)  # fmt: skip
                elif strided:  # C order out of a stream in storage order: spilled to disk once
                    reader = spilled_strided_reader(
                        _member_filler(path, info, header_len, numel * dt.itemsize),
                        shape, strides, raw,
                    )  # fmt: skip
                else:
                    reader = _stream_reader(path, info, header_len, raw, dt.itemsize)
            tensors.append(TensorSource(member_name, path, shape, name, reader))
    for src, (unique, _) in zip(tensors, unique_names([(t.name, t) for t in tensors])):
        src.name = unique  # members a/b.npy and a.b.npy: a.b and a.b#2
    return Dump(path, "npz", tensors, skipped)


# ------------------------------------------------------------------------------------------
# traces
# ------------------------------------------------------------------------------------------
def _open_trace(path: str) -> Dump:
    reader = TraceReader(path)
    tensors = []
    for step, name in reader.saved_tensors():
        f = str(reader.tensor_file(step, name))
        require_regular_file(f)
        st = _open_safetensors(f)
        for src in st.tensors:
            src.name = f"{name}@step{step}"
            tensors.append(src)
    return Dump(path, "trace", tensors, trace=reader)


# ------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------
def _open_pt(path: str) -> Dump:
    from fp8sim.analysis.dumps.torch_reader import open_pt  # torch is imported only for .pt files

    return open_pt(path)


def _open_bin(path: str) -> Dump:
    """A ``.bin`` file as a torch checkpoint (Hugging Face ``pytorch_model.bin``) when it starts
    like one (a zip, or a pickle: the legacy format), else ValueError: never guessed further."""
    with open_regular(path) as f:
        head = f.read(4)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":
        raise ValueError(f"{path}: a .bin file that is not a torch checkpoint (neither a zip nor "
                         "a pickle); valid .bin dumps are torch.save files")  # fmt: skip
    return _open_pt(path)


_OPENERS = {
    ".safetensors": _open_safetensors,
    ".pt": _open_pt,
    ".pth": _open_pt,
    ".npy": _open_npy,
    ".npz": _open_npz,
    _TORCH_BIN: _open_bin,
}


def open_dump(path: str | os.PathLike) -> Dump:
    """Open one dump file or trace directory (not a plain directory: see :func:`expand_paths`).

    Raises ValueError ``"<path>: <reason>"`` for a missing, unknown, corrupt, truncated or
    refused (code-running pickle) file, and for a path that is no regular file (a FIFO, socket
    or device, which is never opened).
    """
    p = str(path)
    if os.path.isdir(p):
        if is_trace(p):
            return _open_one_line(_open_trace, p)
        raise ValueError(f"{p}: a directory that is not an fp8sim trace; use expand_paths")
    if not os.path.exists(p):
        raise ValueError(f"{p}: no such file")
    require_regular_file(p)  # a FIFO, socket or device: refused, never opened
    suffix = Path(p).suffix.lower()
    opener = _OPENERS.get(suffix)
    if opener is None:
        raise ValueError(
            f"{p}: unknown dump type {suffix or '(no suffix)'}; valid: "
            f"{', '.join(DUMP_SUFFIXES)}, {_TORCH_BIN} (a torch checkpoint), or an fp8sim trace "
            "directory"
        )
    return _open_one_line(opener, p)


def _open_one_line(opener: Callable[[str], Dump], p: str) -> Dump:
    """``opener(p)`` with every failure turned into one ValueError line naming ``p``."""
    try:
        return opener(p)
    except ValueError:
        raise
    except OSError as exc:
        raise ValueError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # RecursionError, NotImplementedError, ...: still one line
        raise ValueError(f"{p}: {type(exc).__name__}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _trace_or_damaged(d: str) -> bool:
    """Whether a subdirectory is to be opened as a trace: a trace, or a damaged one (whose
    trace.json names the schema but does not parse: :func:`open_dump` then refuses it by name,
    and the walk goes on)."""
    try:
        return is_trace(d)
    except ValueError:
        return True


def expand_paths(paths: list[str | os.PathLike]) -> list[str]:
    """Files and trace directories to open: directories are walked (sorted) for
    :data:`DUMP_SUFFIXES` files, Hugging Face weight files ``pytorch_model*.bin`` (not other
    ``.bin`` files such as ``training_args.bin``: name those explicitly) and trace
    subdirectories. A missing path raises ValueError. A FIFO, socket or device with a dump's name
    is listed like a file (:func:`open_dump` refuses it by name, as it does an unreadable file or
    a broken link found in a directory), never opened here."""
    out: list[str] = []
    for path in paths:
        p = str(path)
        if not os.path.exists(p):
            raise ValueError(f"{p}: no such file or directory")
        if os.path.isdir(p) and not is_trace(p):
            for root, dirs, files in os.walk(p):
                dirs.sort()
                traces = [d for d in dirs if _trace_or_damaged(os.path.join(root, d))]
                out.extend(os.path.join(root, d) for d in traces)
                dirs[:] = [d for d in dirs if d not in traces]
                out.extend(
                    os.path.join(root, f)
                    for f in sorted(files)
                    if Path(f).suffix.lower() in DUMP_SUFFIXES or _HF_BIN.match(f)
                )
        else:
            out.append(p)
    return out


def iter_dumps(paths: list[str | os.PathLike]) -> Iterator[tuple[str, Dump | ValueError]]:
    """(path, Dump) per expanded path, or (path, the ValueError) for a bad one."""
    for p in expand_paths(paths):
        try:
            yield p, open_dump(p)
        except ValueError as exc:
            yield p, exc
