"""Bounded-memory reads of flat C-order element ranges from strided data: Fortran-ordered
``.npy``/``.npz`` arrays and non-contiguous or legacy-format torch tensors (see
:mod:`analysis.dumps`).

A flat C-order range ``[start, stop)`` of an array of shape ``S`` is at most ``2 * ndim - 1``
rectangular blocks (:func:`c_range_blocks`). Each block is copied in pieces whose first and last
elements are less than :data:`WINDOW_BYTES` apart (or single elements); file pages mapped for a piece are dropped
(``madvise(MADV_DONTNEED)``) right after it is copied, and the whole mapping is closed after each
read. Resident memory per read: the output plus one window, never the tensor.

Reads run ahead in C order up to :data:`READAHEAD_BYTES` (cached, served to the next reads):
a C-order walk over a Fortran array touches every column once per block of rows, so bigger blocks
mean fewer page touches. A *deflated* Fortran ``.npz`` member has no random access: it is
inflated once, at its first read, into an unnamed temporary file (as much disk as the member's
data; gone with the reader), which is then read like a stored one
(:func:`spilled_strided_reader`).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import tempfile
from typing import Any, Callable, Iterator

import numpy as np

from fp8sim.input_files import open_regular

__all__ = [
    "WINDOW_BYTES",
    "READAHEAD_BYTES",
    "drop_pages",
    "c_range_blocks",
    "copy_c_range",
    "readahead",
    "mmap_strided_reader",
    "spilled_strided_reader",
    "fortran_strides",
]

#: largest memory span (bytes) one piece of a strided copy may touch before its pages are dropped
WINDOW_BYTES = 8 << 20
#: C-order read-ahead of a strided reader (bytes of raw elements); its cache lives as long as the
#: reader, one per tensor being read
READAHEAD_BYTES = 32 << 20

_libc: Any = None


def drop_pages(addr: int, nbytes: int, bounds: tuple[int, int] | None = None) -> None:
    """``madvise(MADV_DONTNEED)`` the pages of ``[addr, addr + nbytes)`` of a read-only file
    mapping: they leave resident memory and are read again from the file if touched.

    Without ``bounds`` only whole pages inside the range are dropped; with ``bounds`` (an address
    range known to lie in the same mapping) the range is widened to whole pages, clamped to it.
    """
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
    if bounds is None:
        lo = (addr + page - 1) // page * page
        hi = (addr + nbytes) // page * page
    else:
        lo = max(addr // page * page, bounds[0] // page * page)
        hi = min((addr + nbytes + page - 1) // page * page, (bounds[1] + page - 1) // page * page)
    if hi > lo:
        _libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED)


def fortran_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a Fortran-ordered (column-major) array."""
    out, s = [], itemsize
    for n in shape:
        out.append(s)
        s *= max(int(n), 1)
    return tuple(out)


def c_range_blocks(shape: tuple[int, ...], start: int, stop: int) -> list[tuple]:
    """Index tuples (ints and unit-step slices) of rectangular blocks whose C-order elements,
    concatenated, are the flat C-order elements ``[start, stop)`` of an array of ``shape``.
    At most ``2 * len(shape) - 1`` blocks; ``[]`` for an empty range."""
    out: list[tuple] = []

    def walk(dims: tuple[int, ...], lo: int, hi: int, prefix: tuple) -> None:
        if lo >= hi:
            return
        if len(dims) == 1:
            out.append(prefix + (slice(lo, hi),))
            return
        inner = math.prod(dims[1:])
        r0, o0 = divmod(lo, inner)
        r1, o1 = divmod(hi, inner)
        if r0 == r1:
            walk(dims[1:], o0, o1, prefix + (r0,))
            return
        if o0:
            walk(dims[1:], o0, inner, prefix + (r0,))
            r0 += 1
        if r1 > r0:
            out.append(prefix + (slice(r0, r1),) + (slice(None),) * (len(dims) - 1))
        if o1:
            walk(dims[1:], 0, o1, prefix + (r1,))

    if shape and stop > start:
        walk(tuple(int(n) for n in shape), start, stop, ())
    return out


def _span(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """(lowest, highest) byte offset of an element, relative to the first element."""
    lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0 and n > 0)
    hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0 and n > 0)
    return lo, hi


def _pieces(shape: tuple[int, ...], strides: tuple[int, ...], window: int) -> Iterator[tuple]:
    """Index tuples splitting an array (byte ``strides``) into parts whose memory span is below
    ``window`` bytes (or single elements), in ascending order along the largest stride."""
    lo, hi = _span(shape, strides)
    if hi - lo < window or math.prod(shape) <= 1:
        yield ()
        return
    ax = max((i for i, n in enumerate(shape) if n > 1), key=lambda i: abs(strides[i]))
    rest_shape = shape[:ax] + shape[ax + 1 :]
    rest_strides = strides[:ax] + strides[ax + 1 :]
    rlo, rhi = _span(rest_shape, rest_strides)
    pre = (slice(None),) * ax
    if rhi - rlo < window:
        step = max(1, (window - 1 - (rhi - rlo)) // abs(strides[ax]) + 1)
        for i in range(0, shape[ax], step):
            yield pre + (slice(i, min(i + step, shape[ax])),)
        return
    for i in range(shape[ax]):
        for sub in _pieces(rest_shape, rest_strides, window):
            full = sub + (slice(None),) * (len(rest_shape) - len(sub))
            yield full[:ax] + (i,) + full[ax:]


def copy_c_range(arr: np.ndarray, start: int, stop: int, *,
                 drop: Callable[[int, int], None] | None = None,
                 window: int | None = None) -> np.ndarray:  # fmt: skip
    """Elements ``[start, stop)`` of the flat C-order ``arr`` (any strides; typically a view of a
    file mapping), copied piece by piece; ``drop(addr, nbytes)`` is called with the memory span
    of each piece after it is copied. ``window``: default :data:`WINDOW_BYTES`."""
    window = WINDOW_BYTES if window is None else window
    out = np.empty(max(0, stop - start), arr.dtype)
    pos = 0
    for idx in c_range_blocks(arr.shape, start, stop):
        block = arr[idx + (Ellipsis,)]
        dst = out[pos : pos + block.size].reshape(block.shape)
        for pidx in _pieces(block.shape, block.strides, window):
            piece = block[pidx + (Ellipsis,)]
            dst[pidx + (Ellipsis,)] = piece
            if drop is not None:
                lo, hi = _span(piece.shape, piece.strides)
                drop(piece.__array_interface__["data"][0] + lo, hi - lo + piece.itemsize)
        pos += block.size
    return out


def readahead(read: Callable[[int, int], np.ndarray], numel: int, itemsize: int,
              budget: int | None = None) -> Callable[[int, int], np.ndarray]:  # fmt: skip
    """``read(start, stop)`` that reads at least ``budget`` bytes (default
    :data:`READAHEAD_BYTES`) ahead and serves later reads inside that range from the cache
    (returning copies)."""
    budget = READAHEAD_BYTES if budget is None else budget
    ahead = max(1, budget // max(itemsize, 1))
    cache: dict[str, Any] = {"lo": 0, "hi": 0, "buf": None}

    def cached(start: int, stop: int) -> np.ndarray:
        if cache["buf"] is None or not (cache["lo"] <= start and stop <= cache["hi"]):
            cache["buf"] = None  # release before reading the next block
            end = min(numel, max(stop, start + ahead))
            cache["buf"], cache["lo"], cache["hi"] = read(start, end), start, end
        return cache["buf"][start - cache["lo"] : stop - cache["lo"]].copy()

    return cached


def mmap_strided_reader(path: str, offset: int, shape: tuple[int, ...],
                        strides: tuple[int, ...], raw: Any) -> Callable[[int, int], np.ndarray]:  # fmt: skip
    """read(start, stop) of a strided array at byte ``offset`` of ``path`` (byte ``strides``,
    non-negative): the file is mapped for each read, pages dropped piece by piece, then unmapped.
    The caller checks that the file holds the whole array."""
    dt = np.dtype(raw)
    numel = math.prod(shape)

    def read(start: int, stop: int) -> np.ndarray:
        with open_regular(path) as f:
            return _mapped_read(f.fileno(), offset, shape, strides, dt, start, stop)

    return readahead(read, numel, dt.itemsize)


def _mapped_read(fileno: int, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 dt: np.dtype, start: int, stop: int) -> np.ndarray:  # fmt: skip
    """C-order elements [start, stop) of a strided array at byte ``offset`` of an open file,
    copied out of a fresh read-only mapping piece by piece, pages dropped as they are copied."""
    with mmap.mmap(fileno, 0, access=mmap.ACCESS_READ) as mm:
        arr = np.ndarray(shape, dt, buffer=mm, offset=offset, strides=strides)
        base = arr.__array_interface__["data"][0] - offset
        bounds = (base, base + len(mm))
        try:
            return copy_c_range(arr, start, stop, drop=lambda a, n: drop_pages(a, n, bounds))
        finally:
            del arr  # the mapping cannot close while a view of it exists


def spilled_strided_reader(fill: Callable[[Any], None], shape: tuple[int, ...],
                           strides: tuple[int, ...], raw: Any) -> Callable[[int, int], np.ndarray]:  # fmt: skip
    """read(start, stop) of a strided array whose bytes come once, in storage order, from a
    forward-only source (a deflated .npz member): at the first read ``fill(f)`` writes them into
    an unnamed temporary file (disk, not memory; gone when the reader is), which is then mapped
    as :func:`mmap_strided_reader` maps a file. Without it every C-order piece would decompress
    the member again from its start (measured on a 1 GiB Fortran-ordered member: 5 min 24 s)."""
    dt = np.dtype(raw)
    numel = math.prod(shape)
    state: dict[str, Any] = {"file": None}

    def read(start: int, stop: int) -> np.ndarray:
        if state["file"] is None:
            f = tempfile.TemporaryFile(prefix="fp8sim-spill-")
            try:
                fill(f)
                f.flush()
            except BaseException:
                f.close()
                raise
            state["file"] = f
        return _mapped_read(state["file"].fileno(), 0, shape, strides, dt, start, stop)

    return readahead(read, numel, dt.itemsize)
