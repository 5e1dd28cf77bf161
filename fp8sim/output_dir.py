"""Output directories: made with a clear error, and one writer at a time.

:func:`output_dir` is how a command takes the directory it writes (``train --out``, ``--record``,
``demo --out``, ``--plot``): it makes the directory (one line naming the option for an empty
path, a link to nothing, a file in the way, a directory it cannot make) and holds an exclusive
lock on it until the command ends, so two fp8sim processes never write one directory at once:
the second is refused in one line, before it writes or deletes anything.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the directory itself (no lock file is left in it):
the kernel releases it when the process ends, however it ends -- a holder killed with SIGKILL
leaves nothing stuck. (flock is advisory: it keeps fp8sim processes apart, not other programs.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Iterator

__all__ = ["output_dir", "DirectoryBusy", "check_output_path"]


class DirectoryBusy(ValueError):
    """Another process holds the directory's lock (a ``ValueError``: exit 2 on the command line)."""


def check_output_path(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a Path, or ValueError naming ``option``: an empty path, a symbolic link to
    nothing, something that is not a directory. Only looked at, nothing made."""
    text = os.fspath(path)
    if not str(text).strip():
        raise ValueError(f"{option}: an empty path (give a directory, or leave the option out)")
    p = Path(text)
    if os.path.islink(p) and not os.path.exists(p):
        raise ValueError(f"{option} {p}: a symbolic link to nothing ({os.readlink(p)} does not exist); "
                         "make that directory, or give another path")  # fmt: skip
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"{option} {p}: exists and is not a directory")
    return p


@contextlib.contextmanager
def output_dir(path: str | os.PathLike, option: str, *, lock: bool = True) -> Iterator[Path]:
    """Make the directory ``path`` (parents too) and hold it for the block: ``with
    output_dir(args.out, "--out") as out: ...``.

    ``lock``: take the directory's exclusive lock (see the module docstring); another process
    holding it raises :class:`DirectoryBusy` naming ``option`` and ``path``. A directory this
    call made that is still empty at the end (the command was refused before it wrote) is
    removed again. Raises ValueError naming ``option`` for a path that cannot be a directory."""
    p = check_output_path(path, option)
    made = not os.path.isdir(p)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {p}: cannot create directory ({exc.strerror or exc})") from None
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        if lock:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ValueError(f"{option} {p}: cannot lock the directory ({exc.strerror or exc})") from None
                raise DirectoryBusy(f"{option} {p}: another fp8sim process is writing there (a run, demo or "
                                    "plot still going); wait for it to end, or choose another "
                                    "directory") from None  # fmt: skip
        yield p
    finally:
        os.close(fd)  # releases the lock
        if made:
            with contextlib.suppress(OSError):
                p.rmdir()  # only if empty: a command refused before it wrote anything
