"""A trace writer on its own thread: the training loop hands it whole steps and never waits on
the disk (:class:`BackgroundWriter`, used by :mod:`fp8sim.training.recorder`).

Jobs run in the order they were submitted, on one thread that alone touches the
:class:`~fp8sim.trace.TraceWriter`. A job that fails stops the thread's work: the error is raised
in the caller's thread by the next :meth:`~BackgroundWriter.submit`, :meth:`~BackgroundWriter.flush`
or :meth:`~BackgroundWriter.close`, and nothing after it is written (a trace keeps whole steps
only). :meth:`~BackgroundWriter.close` drains the queue and closes the trace; it also runs at
interpreter exit for a writer nobody closed, so the steps handed over are not lost when a
script ends without closing its recorder.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any, Callable

__all__ = ["BackgroundWriter"]

_STOP = object()


class BackgroundWriter:
    """Runs ``job(writer)`` callables on a daemon thread, in order, for one trace writer.

    Args:
        writer: the :class:`~fp8sim.trace.TraceWriter` the jobs write to (touched only by the
            thread once handed over, until :meth:`close` returns).
        max_pending: jobs queued at most; :meth:`submit` blocks beyond that (a disk slower than
            training must not grow memory without bound).
    """

    def __init__(self, writer: Any, max_pending: int = 8) -> None:
        self.writer = writer
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"fp8sim-trace-{writer.path.name}", daemon=True)
        self._thread.start()
        # at exit, close a writer its owner forgot (weakly held: the writer may be collected)
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() is not None) and ref().close(raise_errors=False)
        atexit.register(self._atexit)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:  # after a failure nothing more is written
                    job(self.writer)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self._error = exc
            finally:
                self._jobs.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"trace {self.writer.path}: the background writer failed: "
                               f"{type(exc).__name__}: {exc}") from exc  # fmt: skip

    def submit(self, job: Callable[[Any], None]) -> None:
        """Queue ``job(writer)``; raises the error of an earlier job, if one failed."""
        if self._closed:
            raise ValueError(f"trace writer for {self.writer.path} is closed")
        self._raise_pending()
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait until every queued job has run; raise the error of one that failed."""
        self._jobs.join()
        self._raise_pending()

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(writer)`` in the caller's thread once the queue is drained (truncation,
        discarding: operations whose result the caller needs)."""
        self.drain()
        return fn(self.writer)

    def flush(self) -> None:
        """Write everything handed over so far (the trace's buffered steps included)."""
        self.call(lambda w: w.flush())

    def close(self, raise_errors: bool = True) -> None:
        """Drain the queue, close the trace and stop the thread (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        try:
            self._jobs.join()
            if self._error is None:
                self.writer.close()
        except BaseException as exc:  # noqa: BLE001
            self._error = self._error or exc
        finally:
            self._jobs.put(_STOP)
            self._thread.join()
        if raise_errors:
            self._raise_pending()
