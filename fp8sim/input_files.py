"""Files fp8sim reads: regular files only, never more bytes than a stated bound.

Every file fp8sim opens is untrusted: a trace copied from elsewhere, a run directory, a dump.
Two things can go wrong before a byte is parsed:

* the path is no regular file: opening a named pipe (FIFO) blocks until a writer comes (forever),
  a character device may never end, a socket cannot be read at all. :func:`open_regular` checks
  the path with ``stat`` before opening it (never opening a device: opening some has effects),
  then opens it non-blocking and checks the opened file again with ``fstat`` (a file swapped in
  between is caught), so it never blocks;
* the file is far larger than what it is for (a 1 GiB ``trace.json``, a corpus of 2 GiB of which
  16 MiB are used): :func:`read_bounded` reads at most ``limit`` bytes, and either refuses a longer
  file (metadata: one line naming the file and the limit) or keeps its head (a corpus cut to a
  cap). Memory follows the bound, not the file.

Errors are one ``ValueError`` line naming the file (bad input: the CLI's exit 2), except a
missing file, which stays ``FileNotFoundError`` for callers that treat absence on its own.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO

__all__ = [
    "MAX_JSON_BYTES",
    "file_kind",
    "require_regular_file",
    "open_regular",
    "read_bounded",
    "read_json",
]

#: default bound of a JSON metadata file (a run's config, run.json, a checkpoint index): KiBs in
#: practice; a trace.json has its own bound (:data:`fp8sim.trace.layout.MAX_TRACE_JSON_BYTES`)
MAX_JSON_BYTES = 16 << 20

_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISDIR, "a directory"))  # fmt: skip


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words ("a named pipe (FIFO)", "a socket", ...)."""
    return next((what for test, what in _FILE_KINDS if test(mode)), "a special file")


def _not_regular(path: Any, mode: int) -> ValueError:
    return ValueError(f"{path}: {file_kind(mode)}, not a regular file")


def require_regular_file(path: str | os.PathLike) -> None:
    """ValueError ``"<path>: a named pipe (FIFO), not a regular file"`` unless ``path`` (through
    symbolic links) is a regular file; FileNotFoundError if it does not exist. Only stat'ed."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"{os.fspath(path)}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(os.fspath(path), mode)


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading in binary mode, if it is a regular file (see the module
    docstring); never blocks. ValueError naming ``path`` for anything else or an unreadable file,
    FileNotFoundError for a missing one."""
    require_regular_file(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueError(f"{os.fspath(path)}: cannot read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped for a FIFO since the stat above
            raise _not_regular(os.fspath(path), mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, *, what: str = "file",
                 keep_head: bool = False) -> bytes:  # fmt: skip
    """At most ``limit`` bytes of the regular file ``path``, never more in memory.

    A longer file raises ValueError ``"<path>: <what> of more than <limit> bytes; refused"``,
    or with ``keep_head=True`` gives its first ``limit`` bytes (a corpus cut to a cap)."""
    with open_regular(path) as f:
        try:
            data = f.read(limit if keep_head else limit + 1)
        except OSError as exc:
            raise ValueError(f"{os.fspath(path)}: cannot read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise ValueError(f"{os.fspath(path)}: {what} of more than {limit} bytes "
                         f"({_size(path)}); refused as damaged or not fp8sim's")  # fmt: skip
    return data


def _size(path: str | os.PathLike) -> str:
    try:
        return f"{os.stat(path).st_size} bytes"
    except OSError:
        return "size unknown"


def read_json(path: str | os.PathLike, limit: int = MAX_JSON_BYTES, *, what: str = "JSON file") -> Any:
    """The JSON value of the regular file ``path`` (at most ``limit`` bytes, see
    :func:`read_bounded`). ValueError ``"<path>: corrupt <what> (...)"`` for bytes that are no
    JSON, text that is no UTF-8 and nesting too deep to parse (a RecursionError)."""
    raw = read_bounded(path, limit, what=what)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        text = str(exc).strip()
        why = text.splitlines()[0] if text else type(exc).__name__
        if isinstance(exc, RecursionError):
            why = "nested too deeply"
        raise ValueError(f"{os.fspath(path)}: corrupt {what} ({why})") from None
