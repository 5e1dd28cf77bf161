"""The result cache reuses a block only when nothing refers to it (fp8sim.result_cache)."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

import fp8sim
from fp8sim import result_cache

N = 1 << 23  # 8 MiB of e4m3 codes: above result_cache.MIN_BYTES


def _addr(a) -> int:
    return np.asarray(a).__array_interface__["data"][0]


@pytest.fixture(autouse=True)
def _fresh_cache():
    old = result_cache.limit()
    result_cache.set_limit(256 << 20)
    result_cache.clear()
    yield
    result_cache.set_limit(old)
    result_cache.clear()


def _cached(a) -> bool:
    """Whether a's memory is leased from the cache (a lease at the end of its base chain)."""
    b = np.asarray(a)
    while isinstance(b, np.ndarray):
        b = b.base
    return isinstance(b, result_cache._Lease)


def _data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def test_a_dropped_result_is_reused_and_rewritten():
    x1, x2 = _data(1), _data(2)
    first = fp8sim.encode(x1, "e4m3")
    a1 = _addr(first)
    del first
    second = fp8sim.encode(x2, "e4m3")
    assert _addr(second) == a1 and _cached(second)  # the same memory again
    # every code rewritten: equal to a cast into fresh memory
    assert np.array_equal(second, fp8sim.encode(x2, "e4m3", out=np.empty(N, np.uint8)))


@pytest.mark.parametrize("keep", ["slice", "reshape", "view", "torch", "memoryview"])
def test_no_reuse_while_any_view_lives(keep):
    x1, x2 = _data(3), _data(4)
    first = fp8sim.encode(x1, "e4m3")
    expect = first.copy()
    if keep == "slice":
        held = first[5:]
    elif keep == "reshape":
        held = first.reshape(2, -1)
    elif keep == "view":
        held = first.view(np.int8)
    elif keep == "torch":
        torch = pytest.importorskip("torch")
        held = torch.from_numpy(first)
    else:
        held = memoryview(first)
    a1 = _addr(first)
    del first
    second = fp8sim.encode(x2, "e4m3")
    assert _addr(second) != a1
    flat = np.asarray(held).view(np.uint8).reshape(-1)
    assert np.array_equal(flat, expect.view(np.uint8)[-flat.size:])  # untouched


def test_decode_results_are_cached_too_and_limit_zero_disables():
    codes = fp8sim.encode(_data(5), "e4m3")
    v = fp8sim.decode(codes, "e4m3")
    a = _addr(v)
    del v
    w = fp8sim.decode(codes, "e4m3")
    assert _addr(w) == a
    del w
    assert result_cache.free_bytes() >= 4 * N
    result_cache.set_limit(0)
    assert result_cache.free_bytes() == 0
    u1 = fp8sim.decode(codes, "e4m3")
    assert not _cached(u1)  # a plain np.empty result


def test_free_blocks_stay_within_the_limit_as_soon_as_they_are_freed():
    result_cache.set_limit(3 * N)  # room for three free 8 MiB blocks, not four
    keep = [fp8sim.encode(_data(k), "e4m3") for k in range(5)]
    assert result_cache.free_bytes() == 0
    del keep
    assert result_cache.free_bytes() == 3 * N  # trimmed when returned, not at the next cast
    r = fp8sim.encode(_data(9), "e4m3")  # reuses one
    assert result_cache.free_bytes() == 2 * N and _cached(r)


def test_limit_zero_drops_blocks_of_results_alive_now_when_they_die():
    r = fp8sim.encode(_data(6), "e4m3")
    result_cache.set_limit(0)
    del r
    assert result_cache.free_bytes() == 0


def test_a_block_returned_while_the_cache_is_busy_is_taken_in_later():
    # a finalizer may run inside a cache call (a garbage collection): it must not wait for the
    # lock (a deadlock) and the block must not be lost
    r = fp8sim.encode(_data(7), "e4m3")
    with result_cache._lock:
        del r  # the lease dies here, its block is queued
    assert result_cache.free_bytes() == N


def test_bad_limits_are_clear_errors():
    with pytest.raises(ValueError, match=">= 0"):
        result_cache.set_limit(-1)
    for bad in ("100", 2.5, True):
        with pytest.raises(TypeError, match="int number of bytes"):
            result_cache.set_limit(bad)


def test_small_results_are_not_cached():
    r = fp8sim.encode(np.ones(1000, np.float32), "e4m3")
    assert not _cached(r)


def test_concurrent_encodes_get_their_own_memory():
    xs = [_data(10 + k) for k in range(4)]
    expect = [fp8sim.encode(x, "e4m3", out=np.empty(N, np.uint8)) for x in xs]
    got: list = [None] * 4

    def work(k):
        for _ in range(3):
            got[k] = fp8sim.encode(xs[k], "e4m3")

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len({_addr(g) for g in got}) == 4
    for g, e in zip(got, expect):
        assert np.array_equal(g, e)


@pytest.mark.parametrize("raw", ["lots", "nan", "inf", "1e400", "-3"])
def test_bad_environment_value_is_one_clear_error(monkeypatch, raw):
    monkeypatch.setenv("FP8SIM_RESULT_CACHE_MB", raw)
    with pytest.raises(ValueError, match="FP8SIM_RESULT_CACHE_MB must be a number of MiB"):
        result_cache._limit_from_env()


_REENTRY_SCRIPT = r"""
import gc, sys
import ml_dtypes
import numpy as np
import fp8sim
from fp8sim import result_cache
x = np.ones(1 << 22, np.float32)
keep = [fp8sim.encode(x, "e4m3") for _ in range(3)]
busy = [False]
def cb(phase, info):
    if phase == "start" and not busy[0]:
        busy[0] = True
        try:
            result_cache.free_bytes()
            fp8sim.encode(x, "e4m3")
            result_cache.set_limit(result_cache.limit())
            if info.get("generation") == 2:
                result_cache.clear()
        finally:
            busy[0] = False
gc.callbacks.append(cb)
gc.set_threshold(1)
for i in range(300):
    y = fp8sim.encode(x, "e4m3")
    assert int(y[0]) == 0x38 and int(y[-1]) == 0x38
    del y
    if i % 50 == 0:
        result_cache.clear(); result_cache.free_bytes()
gc.callbacks.clear()
print("ok", result_cache.free_bytes() <= result_cache.limit())
"""


def test_reentry_from_gc_callbacks_neither_deadlocks_nor_corrupts():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REENTRY_SCRIPT], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "True"]


def test_queued_blocks_are_taken_in_when_the_holder_lets_go():
    r = fp8sim.encode(_data(8), "e4m3")
    held = threading.Event()
    go = threading.Event()

    def holder():
        with result_cache._lock:
            held.set()
            go.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    del r  # the lock is busy in another thread: queued, not waited for
    assert len(result_cache._returned) == 1
    go.set()
    t.join()
    assert result_cache.free_bytes() == N


def test_unusual_dtypes_and_the_lease_itself():
    import copy
    import pickle

    a = result_cache.empty(N, object)  # never an old block's bytes read as pointers
    assert not _cached(a) and a.dtype == object
    b = result_cache.empty(N // 2, ml_dtypes.bfloat16)
    assert b.dtype == ml_dtypes.bfloat16 and b.size == N // 2
    c = result_cache.empty(N, np.float64)
    assert _cached(c) and c.dtype == np.float64 and c.flags.writeable and c.flags.c_contiguous
    lease = c.base
    while isinstance(lease, np.ndarray):
        lease = lease.base
    for bad in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="lease cannot be"):
            bad(lease)
