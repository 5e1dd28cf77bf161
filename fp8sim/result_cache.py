"""Reuse of large result buffers between casts, so that a repeated cast skips the page faults of
fresh memory.

A fresh result of ``np.empty`` is memory the kernel touches for the first time: the operating
system zeroes and maps every page on that first write, which costs about as much as the cast of
float32 input itself (measured in ``benchmarks/bench_emulator.py``: the e4m3 encode of 2**26
elements into a preallocated ``out=`` takes about half the time of the allocating one). A
training step or an analysis loop casts tensors of the same sizes again and again; this module
keeps the blocks behind large results (:data:`MIN_BYTES` or more) and hands a block out again
once nothing refers to its previous result any more.

How a block comes back: each result's memory is owned by its own small *lease* object (the
array's ``base``; every view, slice and reshape keeps it through its chain of ``base`` arrays, and
``torch.from_numpy`` / memoryviews keep the array). When the last of them dies, the lease is
collected and a ``weakref.finalize`` callback returns the block to the free list -- no
reference counting by hand. (Raw addresses taken without a reference, e.g. ``arr.ctypes.data``
kept after ``arr`` is gone, are outside that rule, as they are for any allocator; set
``FP8SIM_RESULT_CACHE_MB=0`` while debugging such code.)

Memory bound: free blocks are kept up to :func:`limit` bytes in all (default 512 MiB,
``FP8SIM_RESULT_CACHE_MB`` in the environment, ``0`` disables the cache), enforced when a block
is returned; the least recently returned go first. :func:`clear` drops every free block.
Thread-safe and re-entrant; a block returned while another thread holds the cache is queued and
taken in as soon as that thread lets go.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import weakref

import numpy as np

__all__ = ["MIN_BYTES", "empty", "limit", "set_limit", "clear", "free_bytes"]

#: results smaller than this come from ``np.empty`` (the allocator already recycles them)
MIN_BYTES = 1 << 22


def _limit_from_env() -> int:
    """FP8SIM_RESULT_CACHE_MB as bytes; a bad value is one clear ValueError."""
    raw = os.environ.get("FP8SIM_RESULT_CACHE_MB", "512")
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and 0 <= mb <= 1 << 40):
        raise ValueError(
            f"FP8SIM_RESULT_CACHE_MB must be a number of MiB between 0 (off) and 2**40, got {raw!r}"
        )
    return int(mb * (1 << 20))


class _Lease:
    """Owner of one result's memory: holds the block; numpy reads the address from
    ``__array_interface__``. Not copyable or picklable (a copy would outlive the finalizer that
    returns the block); code should not keep the end of a result's ``.base`` chain itself."""

    __slots__ = ("__array_interface__", "block", "__weakref__")

    def __copy__(self):
        raise TypeError("a result-cache lease cannot be copied; copy the array instead")

    def __deepcopy__(self, memo):
        raise TypeError("a result-cache lease cannot be copied; copy the array instead")

    def __reduce__(self):
        raise TypeError("a result-cache lease cannot be pickled; pickle the array instead")


# Re-entrant: a garbage collection inside a locked section may run finalizers and gc callbacks
# that call back into this module on the same thread. Every locked section is written to stay
# consistent under such re-entry (iterate over copies; each step adjusts the total for its own
# block).
_lock = threading.RLock()
_free: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()  # oldest first
_free_total = 0
_returned: collections.deque = collections.deque()  # blocks returned while the lock was busy
_limit: int | None = None  # bytes; read from the environment at the first use


def _current_limit() -> int:
    global _limit
    if _limit is None:
        _limit = _limit_from_env()
    return _limit


def _after_fork_in_child() -> None:
    """A fork while another thread held the lock (or was halfway through an update) must leave
    the child a free lock and a total that matches its free list."""
    global _lock, _free_total
    _lock = threading.RLock()
    _free_total = sum(b.nbytes for b in list(_free.values()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _take_in_returned() -> None:
    """Move queued returned blocks to the free list and trim it to the limit (lock held)."""
    global _free_total
    lim = _current_limit()
    while _returned:
        try:
            block = _returned.popleft()
        except IndexError:  # taken by a re-entrant call
            break
        if lim > 0:
            _free[id(block)] = block
            _free_total += block.nbytes
    while _free_total > lim and _free:
        try:
            _, b = _free.popitem(last=False)
        except KeyError:
            break
        _free_total -= b.nbytes


def _drain() -> None:
    """Take in returned blocks unless another thread holds the lock (it drains them then);
    called after every locked section, so no block stays queued once the calls are over."""
    while _returned and _lock.acquire(blocking=False):
        try:
            _take_in_returned()
        finally:
            _lock.release()


def _give_back(block: np.ndarray) -> None:
    """finalize callback of a lease: its block is free again."""
    _returned.append(block)  # atomic; never blocks (a finalizer may run inside a cache call)
    _drain()


def _cacheable(dtype: np.dtype) -> bool:
    """Plain numeric dtypes that ``__array_interface__``'s type string carries unchanged (not
    objects: an old block's bytes must never be read as pointers)."""
    return not dtype.hasobject and dtype.fields is None and np.dtype(dtype.str) == dtype


def empty(n: int, dtype) -> np.ndarray:
    """A flat, C-contiguous, writable array of ``n`` elements of ``dtype`` whose contents are
    undefined (like ``np.empty``): a free cached block when one fits (at least the size, at most
    twice it), else a new block, returned to the cache when the result's last view dies.
    Dtypes other than plain numeric ones come from ``np.empty``."""
    global _free_total
    dtype = np.dtype(dtype)
    nbytes = int(n) * dtype.itemsize
    if nbytes < MIN_BYTES or _current_limit() == 0 or not _cacheable(dtype):
        return np.empty(n, dtype)
    block = None
    with _lock:
        _take_in_returned()
        best = None
        for key, b in list(_free.items()):
            if nbytes <= b.nbytes <= 2 * nbytes and (best is None or b.nbytes < best[1]):
                best = (key, b.nbytes)
        if best is not None:
            block = _free.pop(best[0], None)  # None: dropped by a re-entrant trim meanwhile
            if block is not None:
                _free_total -= block.nbytes
    _drain()
    if block is None:
        block = np.empty(nbytes, np.uint8)
    lease = _Lease()
    lease.block = block
    lease.__array_interface__ = {
        "shape": (int(n),),
        "typestr": dtype.str,
        "data": (block.__array_interface__["data"][0], False),
        "version": 3,
    }
    out = np.asarray(lease)
    weakref.finalize(lease, _give_back, block).atexit = False
    return out


def limit() -> int:
    """Bytes of free blocks the cache may keep (0: disabled)."""
    return _current_limit()


def set_limit(nbytes: int) -> None:
    """Set the bytes of free blocks kept (an int; 0 disables the cache and drops every free
    block; results alive now are dropped, not kept, when they die)."""
    global _limit
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"result cache limit must be an int number of bytes, got {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"result cache limit must be >= 0 bytes, got {nbytes}")
    with _lock:
        _limit = int(nbytes)
        _take_in_returned()
    _drain()


def clear() -> None:
    """Drop every free block (blocks still in use stay with their users)."""
    global _free_total
    with _lock:
        _take_in_returned()
        while _free:
            try:
                _, b = _free.popitem(last=False)
            except KeyError:
                break
            _free_total -= b.nbytes
    _drain()


def free_bytes() -> int:
    """Bytes held in free blocks now."""
    with _lock:
        _take_in_returned()
        total = _free_total
    _drain()
    return total
