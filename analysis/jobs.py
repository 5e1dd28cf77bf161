"""The statistics of many tensors, in this process or in worker processes (``analyze(jobs=N)``,
``fp8sim analyze --jobs N``).

:func:`stats_in_order` yields one result per tensor, in the order given, whatever the number of
jobs: the figures are computed by the same :func:`~fp8sim.analysis.stats.tensor_stats` call
with the same chunks, so a run with N jobs returns what a run with one returns, bit for bit
(JSON, table and plots are built from these results, in this order, by the caller).

Workers: ``jobs - 1`` helpers are never idle while the caller merges; each worker is a fresh
(spawned) process that opens the files itself, links each file's companion scales as the caller
did (:func:`~fp8sim.analysis.dumps.link_fp8_scales` on that file alone: a companion is looked
for in the file and its shard set only, so the file alone links the same way), and analyzes one
tensor at a time, chunk by chunk: a worker's memory is bounded like a single run's, whatever the
checkpoint's size. Tensors go to the workers in order, one at a time (a big file's tensors are
shared out too); each worker's numba threads are the machine's divided by the jobs, so N workers
use the cores one run would. Tensors held in memory (arrays, a ``state_dict``) are analyzed in
this process. Progress: the workers report the elements they finished to one bar.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import OrderedDict
from typing import Any, Callable, Iterator

__all__ = ["stats_in_order"]

#: files a worker keeps opened and linked (a worker's tensors come mostly from one file)
_KEEP_OPEN = 4
#: seconds between progress updates while the caller waits for a result
_POLL_S = 0.2

# worker state, set by _init in each worker process
_WORKER: dict[str, Any] = {}


def _init(variants, chunk, mode, block, progress_queue, threads) -> None:
    import numba

    numba.set_num_threads(threads)
    _WORKER.update(variants=variants, chunk=chunk, mode=mode, block=block, queue=progress_queue,
                   dumps=OrderedDict())  # fmt: skip


def _linked(path: str):
    """The file at ``path``, opened and its companions linked as the caller did (cached)."""
    from fp8sim.analysis.dumps import link_fp8_scales, open_dump

    dumps = _WORKER["dumps"]
    if path in dumps:
        dumps.move_to_end(path)
        return dumps[path]

    def failed(_path: str, exc: ValueError) -> None:
        raise exc

    opened = [open_dump(path)]
    link_fp8_scales(opened, _WORKER["mode"], _WORKER["block"], failed, census=False)
    dumps[path] = {t.name: t for t in opened[0].tensors}
    if len(dumps) > _KEEP_OPEN:
        dumps.popitem(last=False)
    return dumps[path]


def _run(task: tuple) -> Any:
    """A worker's tensor: its TensorStats, or the ValueError's text when its data cannot be
    read."""
    from fp8sim.analysis.stats import tensor_stats

    path, name, shape, dtype = task
    queue = _WORKER["queue"]
    try:
        src = _linked(path).get(name)
        if src is None or tuple(src.shape) != shape or src.dtype != dtype:
            raise ValueError(f"{path}: {name} changed while it was analyzed (its file was "
                             "rewritten)")  # fmt: skip
        return tensor_stats(src, _WORKER["variants"], name=name, chunk=_WORKER["chunk"],
                            progress=queue.put)  # fmt: skip
    except ValueError as exc:
        return ValueError(str(exc))


def _worker_threads(jobs: int) -> int:
    import numba

    return max(1, numba.config.NUMBA_NUM_THREADS // jobs)


def stats_in_order(items: list[tuple[str, Any, Any]], variants: list, chunk: int | None, jobs: int,
                   link: tuple[str, Any], progress: Callable[[int], None]) -> Iterator[Any]:  # fmt: skip
    """For each ``(path, dump, source)`` of ``items`` (``path``: the file a worker opens for
    ``dump``, which may show another, e.g. a run directory for its merged trace), in order: its
    :class:`~fp8sim.analysis.stats.TensorStats`, or the ValueError its data raised. ``jobs``:
    processes (1: this one only); ``link``: the ``(fp8_scales mode, block)`` the caller linked
    the files with; ``progress(n)``: elements finished (as ``tensor_stats`` reports them).

    A worker that dies (killed, out of memory) raises OSError naming the first tensor whose
    result is lost (the pool is broken then: no figure of a dead worker is ever used); closing
    the generator early (an error, an interrupt) stops the workers at once."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    from fp8sim.analysis.stats import tensor_stats

    def here(src):
        try:
            return tensor_stats(src, variants, name=src.name, chunk=chunk, progress=progress)
        except ValueError as exc:
            return exc

    in_files = [(p, s) for p, d, s in items if d.kind != "memory"]
    if jobs <= 1 or not in_files:
        for _, _, src in items:
            yield here(src)
        return
    ctx = mp.get_context("spawn")  # a clean process: no threads or locks inherited
    queue = ctx.Queue()
    n = min(jobs, len(in_files))
    pool = ProcessPoolExecutor(n, ctx, initializer=_init,
                               initargs=(variants, chunk, link[0], link[1], queue, _worker_threads(jobs)))  # fmt: skip
    tasks = iter([(p, s.name, tuple(s.shape), s.dtype) for p, s in in_files])
    pending: list = []  # futures in input order; at most 2 per worker ahead (results are small)

    def drain() -> None:
        while True:
            try:
                progress(queue.get_nowait())
            except Exception:  # queue.Empty
                return

    def top_up() -> None:
        while len(pending) < 2 * n:
            task = next(tasks, None)
            if task is None:
                return
            pending.append((task, pool.submit(_run, task)))

    done_cleanly = False
    try:
        top_up()
        for _, dump, src in items:
            if dump.kind == "memory":
                yield here(src)
                continue
            task, fut = pending.pop(0)
            while not fut.done():
                wait([fut], timeout=_POLL_S, return_when=FIRST_COMPLETED)
                drain()
            drain()
            try:
                res = fut.result()
            except BrokenProcessPool:
                raise OSError(f"a worker process of --jobs died (killed, or out of memory: fewer jobs need "
                              f"less); first tensor not analyzed: {task[0]}: {task[1]}") from None  # fmt: skip
            top_up()
            yield res
        done_cleanly = True
    finally:
        if not done_cleanly:  # stop the workers now, not after their current tensor
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        queue.close()
