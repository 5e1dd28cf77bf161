"""Files written whole or not at all."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "save_figure"]


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
        with open(path, "wb") as f:
            write(f)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600: give the file the old one's permissions, or open()'s for a new one
        os.fchmod(fd, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save_figure(fig, path, **kw) -> None:
    """A matplotlib figure as a PNG at ``path`` through :func:`atomic_write` (a failed or
    interrupted save keeps the old file). Plot names are the program's, in a plot directory: a
    symbolic link found there is replaced by the PNG, never followed to write elsewhere."""
    atomic_write(Path(path), lambda f: fig.savefig(f, format="png", **kw), follow_symlinks=False)
