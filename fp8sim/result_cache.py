"""Reuse of large result buffers between casts, so that a repeated cast skips the page faults of
fresh memory.

A fresh result of ``np.empty`` is memory the kernel touches for the first time: the operating
system zeroes and maps every page on that first write, which costs about as much as the cast of
float32 input itself (measured in ``benchmarks/bench_emulator.py``: the e4m3 encode of 2**26
elements into a preallocated ``out=`` takes about half the time of the allocating one). A
training step or an analysis loop casts tensors of the same sizes again and again; this module
keeps the blocks behind large results (:data:`MIN_BYTES` or more) and hands a block out again
once nothing refers to it any more.

Safety rule: a block is reused only when the cache holds the only reference to it. Every numpy
view of a result (slices, reshapes, ``.view``, ``torch.from_numpy``, memoryviews) references the
block (numpy keeps the memory's owner as ``base``), so a block is never handed out while any
of them lives. (Raw addresses taken without a reference, e.g. ``arr.ctypes.data`` kept after
``arr`` is gone, are outside that rule, as they are for any allocator.)

Memory bound: blocks nobody uses are kept up to :func:`limit` bytes in all (default 512 MiB,
``FP8SIM_RESULT_CACHE_MB`` in the environment, ``0`` disables the cache); the least recently
returned go first. :func:`clear` drops every free block. Thread-safe (one lock around the
search).
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

__all__ = ["MIN_BYTES", "empty", "limit", "set_limit", "clear", "free_bytes"]

#: results smaller than this come from ``np.empty`` (the allocator already recycles them)
MIN_BYTES = 1 << 22


def _limit_from_env() -> int:
    raw = os.environ.get("FP8SIM_RESULT_CACHE_MB", "512")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"FP8SIM_RESULT_CACHE_MB must be a number of MiB (0 disables), got {raw!r}") from None
    if mb < 0:
        raise ValueError(f"FP8SIM_RESULT_CACHE_MB must be >= 0, got {raw!r}")
    return int(mb * (1 << 20))


_lock = threading.Lock()
_blocks: list[np.ndarray] = []  # uint8 blocks, in use or free; most recently added last
_limit = _limit_from_env()


def _refs_of_listed(blocks: list, i: int) -> int:
    return sys.getrefcount(blocks[i])


#: what :func:`_refs_of_listed` reports for an array only a list holds (measured, not assumed:
#: interpreters differ in the temporary references they count)
_FREE_REFS = _refs_of_listed([np.empty(1, np.uint8)], 0)


def _is_free(i: int) -> bool:
    """Whether only the cache refers to block i (any view of the block adds a reference)."""
    return _refs_of_listed(_blocks, i) <= _FREE_REFS


def _drop_free() -> None:
    free = {i for i in range(len(_blocks)) if _is_free(i)}
    _blocks[:] = [b for i, b in enumerate(_blocks) if i not in free]


def empty(n: int, dtype) -> np.ndarray:
    """A flat, C-contiguous, writable array of ``n`` elements of ``dtype`` whose contents are
    undefined (like ``np.empty``): a free cached block when one fits (at least the size, at most
    twice it), else a new block that the cache keeps for later."""
    dtype = np.dtype(dtype)
    nbytes = int(n) * dtype.itemsize
    if nbytes < MIN_BYTES or _limit == 0:
        return np.empty(n, dtype)
    with _lock:
        best = -1
        for i in range(len(_blocks)):
            size = _blocks[i].nbytes
            if nbytes <= size <= 2 * nbytes and _is_free(i):
                if best < 0 or size < _blocks[best].nbytes:
                    best = i
        if best >= 0:
            block = _blocks.pop(best)
        else:
            block = np.empty(nbytes, np.uint8)
        _blocks.append(block)  # most recently used last
        out = block[:nbytes].view(dtype)
        _trim()
    return out


def _trim() -> None:
    """Drop free blocks, least recently used first, until the free ones fit the limit."""
    free = [i for i in range(len(_blocks)) if _is_free(i)]
    total = sum(_blocks[i].nbytes for i in free)
    drop = set()
    for i in free:
        if total <= _limit:
            break
        total -= _blocks[i].nbytes
        drop.add(i)
    if drop:
        _blocks[:] = [b for i, b in enumerate(_blocks) if i not in drop]


def limit() -> int:
    """Bytes of free blocks the cache may keep (0: disabled)."""
    return _limit


def set_limit(nbytes: int) -> None:
    """Set the bytes of free blocks kept (0 disables the cache and drops every free block)."""
    global _limit
    if int(nbytes) < 0:
        raise ValueError(f"result cache limit must be >= 0 bytes, got {nbytes}")
    with _lock:
        _limit = int(nbytes)
        _trim()


def clear() -> None:
    """Drop every free block (blocks still in use stay with their users)."""
    with _lock:
        _drop_free()


def free_bytes() -> int:
    """Bytes held in free blocks now."""
    with _lock:
        return sum(_blocks[i].nbytes for i in range(len(_blocks)) if _is_free(i))
