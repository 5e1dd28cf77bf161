"""Files written whole or not at all, and failures that name the file.

Every file fp8sim writes goes through :func:`atomic_write` (a temporary file renamed over it) or,
for a log that grows a line at a time, :func:`append_line` (the line whole, or the file cut back).
Temporary files are named ``.NAME.PID-XXXXXXXX.tmp`` next to ``NAME``: one left behind by a
process that was killed mid-write (its PID no longer runs) is removed by the next write of
``NAME``. A failed write raises :class:`WriteError`, an ``OSError`` whose message names the file:
``cannot write RUN/config.json: No space left on device``.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "append_line", "save_figure", "WriteError"]


class WriteError(OSError):
    """A write that failed, said with the file's name (``str``: ``cannot write PATH: REASON``)."""

    def __init__(self, path, exc: OSError) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def _named(path, exc: OSError) -> WriteError:
    return exc if isinstance(exc, WriteError) else WriteError(path, exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _remove_stale_temps(path: Path) -> None:
    """Remove the temporary files of writes of ``path`` whose process no longer runs (killed
    mid-write: SIGKILL, OOM); a live writer's (another process writing the same file) is kept."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)-[A-Za-z0-9_]+\.tmp$")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            try:
                os.unlink(path.parent / name)
            except OSError:
                pass


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it back at once
    os.umask(mask)
    return mask


def atomic_write(path: Path, write, follow_symlinks: bool = True) -> None:
    """Write through ``write(fileobj)`` so that ``path`` holds either its old content or the whole
    new one, never a part.

    A regular file, or a path that does not exist yet, is written to a temporary file in its
    directory, fsynced and renamed over it. A symbolic link is followed (a path the user named:
    the file it points to is replaced and the link stays a link), or with
    ``follow_symlinks=False`` (a name the program made up) replaced by the new file. An existing
    path that is not a regular file (a device such as ``/dev/null``, a FIFO) is written in place:
    a rename would put a regular file where the device node was (as root, ``--json /dev/null``
    would have replaced ``/dev/null``). A replaced file keeps its permissions; a new one gets
    ``0o666 & ~umask``, as ``open`` gives.
    """
    given = path  # errors name the path as the caller gave it
    path = Path(os.path.realpath(path) if follow_symlinks else os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode if follow_symlinks else os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        mode = None  # not followed: the link itself is replaced
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(21, "Is a directory", str(path))
    if mode is not None and not stat.S_ISREG(mode):
        try:
            with open(path, "wb") as f:
                write(f)
        except OSError as exc:
            raise _named(given, exc) from None
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _named(given, exc) from None
    try:
        # mkstemp makes 0600: give the file the old one's permissions, or open()'s for a new one
        os.fchmod(fd, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _named(given, exc) from None
        raise
    _remove_stale_temps(path)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` (its newline included) to ``path`` whole or not at all: a failed write (a
    full disk) cuts the file back to its old length and raises :class:`WriteError`. (A process
    killed mid-write may leave part of a last line with no newline: readers drop such a line.)"""
    data = line.encode()
    try:
        with open(path, "ab") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                f.write(data)
                f.flush()
            except OSError:
                try:
                    f.truncate(size)  # the old rows, whole
                except OSError:
                    pass
                raise
    except OSError as exc:
        raise _named(path, exc) from None


def save_figure(fig, path, **kw) -> None:
    """A matplotlib figure as a PNG at ``path`` through :func:`atomic_write` (a failed or
    interrupted save keeps the old file). Plot names are the program's, in a plot directory: a
    symbolic link found there is replaced by the PNG, never followed to write elsewhere."""
    atomic_write(Path(path), lambda f: fig.savefig(f, format="png", **kw), follow_symlinks=False)
