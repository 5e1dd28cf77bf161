"""Files written whole or not at all, never through a link, and failures that name the file.

Every file fp8sim writes goes through :func:`atomic_write` (a temporary file renamed over it) or,
for a log that grows a line at a time, :func:`append_line` (the line whole, or the file cut back).
Temporary files are named ``.NAME.PID-XXXXXXXX.tmp`` next to ``NAME``: one left behind by a
process that was killed mid-write (its PID no longer runs) is removed by the next write of
``NAME``. A failed write raises :class:`WriteError`, an ``OSError`` whose message names the file:
``cannot write RUN/config.json: No space left on device``.

Links. A file fp8sim names itself inside a directory it owns (a run's ``run.json``, a trace's
chunks, a demo report's files) is fp8sim's: it is created and replaced without following links
(``O_NOFOLLOW``, every directory below the owned one entered with ``O_NOFOLLOW`` too), so a
symbolic link planted there can never make fp8sim write into the file it points to. Such a link
is refused in one line (``links="refuse"``, the default), or, for plot names, replaced by the new
file with a line on stderr (``links="replace"``). Only a path the user named (``--json FILE``) is
followed (``links="follow"``): the user chose where it points.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import sys
from pathlib import Path

__all__ = ["atomic_write", "append_line", "remove_own_file", "save_figure", "owned_dir", "WriteError", "LINK_MODES"]

#: what :func:`atomic_write` does with a symbolic link where it writes
LINK_MODES = ("refuse", "replace", "follow")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class WriteError(OSError):
    """A write that failed, said with the file's name (``str``: ``cannot write PATH: REASON``)."""

    def __init__(self, path, exc: OSError) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def _named(path, exc: OSError) -> WriteError:
    return exc if isinstance(exc, WriteError) else WriteError(path, exc)


def _refused(path, why: str, code: int = errno.ELOOP) -> WriteError:
    """The refusal to write ``path`` (a link or a special file where fp8sim's own file goes)."""
    return WriteError(path, OSError(code, why))


def _own_entry(given, mode: int | None, readlink, links: str = "refuse") -> int | None:
    """The mode of what is at fp8sim's own file ``given`` (``mode``: its lstat mode, None when
    absent), if fp8sim may replace it: a regular file, or nothing (None; also for a link that
    ``links="replace"`` replaces). :class:`WriteError` for a link (``readlink()`` says where it
    points) or a special file; IsADirectoryError for a directory."""
    if mode is None:
        return None
    if stat.S_ISLNK(mode):
        if links == "refuse":
            raise _refused(given, f"a symbolic link (to {readlink()}) where fp8sim writes its own file; "
                                  "refused, nothing written through it (remove the link)")  # fmt: skip
        return None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(given))
    if not stat.S_ISREG(mode):
        raise _refused(given, f"{_kind(mode)} where fp8sim writes its own file; refused", errno.EINVAL)
    return mode


def _kind(mode: int) -> str:
    from fp8sim.input_files import file_kind

    return file_kind(mode)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _remove_stale_temps(dir_fd: int, name: str) -> None:
    """Remove the temporary files of writes of ``name`` (in the directory ``dir_fd``) whose
    process no longer runs (killed mid-write: SIGKILL, OOM); a live writer's is kept."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.(\d+)-[A-Za-z0-9_]+\.tmp$")
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for entry in names:
        m = pattern.match(entry)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            try:
                os.unlink(entry, dir_fd=dir_fd)
            except OSError:
                pass


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it back at once
    os.umask(mask)
    return mask


def _open_owned_dir(root: Path, parts: tuple[str, ...], given) -> int:
    """An fd of ``root/parts...``: ``root`` made if missing (the caller's directory: a link to a
    directory is taken, as the user named it), each of ``parts`` made and entered without
    following a link. A link, or something other than a directory, in ``parts``: refused."""
    if os.path.islink(root) and not os.path.exists(root):
        raise _refused(given, f"{root} is a symbolic link to nothing ({os.readlink(root)})")
    os.makedirs(root, exist_ok=True)
    fd = os.open(root, _DIR_FLAGS)
    where = root
    try:
        for part in parts:
            where = where / part
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                sub = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else _kind(st.st_mode)
                raise _refused(given, f"{where} is {what} where fp8sim keeps its own directory; "
                                      "refused (nothing is written through it)", exc.errno) from None  # fmt: skip
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def owned_dir(root: str | os.PathLike, rel: str | os.PathLike) -> Path:
    """Make ``root/rel`` (``rel`` a relative path) and return it: ``root`` as the user named it,
    every directory of ``rel`` made and checked without following links (a link there raises
    :class:`WriteError` naming it: fp8sim never writes into a directory a link points to)."""
    root, rel = Path(root), Path(rel)
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"owned_dir: {rel} is not a path below {root}")
    try:
        os.close(_open_owned_dir(root, rel.parts, root / rel))
    except OSError as exc:
        raise _named(root / rel, exc) from None
    return root / rel


def atomic_write(path: str | os.PathLike, write, links: str = "refuse", *,
                 root: str | os.PathLike | None = None) -> None:  # fmt: skip
    """Write through ``write(fileobj)`` so that ``path`` holds either its old content or the whole
    new one, never a part.

    ``path`` is written to a temporary file in its directory, fsynced and renamed over it. What
    a symbolic link at ``path`` means (see the module docstring): ``links="refuse"`` (fp8sim's own
    file: refused, :class:`WriteError`), ``"replace"`` (the link itself replaced by the new file,
    said on stderr), ``"follow"`` (a path the user named: the file it points to is replaced and
    the link stays a link; an existing path that is no regular file -- a device such as
    ``/dev/null``, a FIFO -- is then written in place, since a rename would put a regular file
    where the node was). Without ``"follow"``, anything but a regular file at ``path`` is
    refused. ``root``: the directory the caller owns (default ``path``'s directory); the
    directories between it and ``path`` are made and entered without following links. A
    replaced file keeps its permissions; a new one gets ``0o666 & ~umask``, as ``open`` gives.
    """
    if links not in LINK_MODES:
        raise ValueError(f"links must be one of {', '.join(LINK_MODES)}, got {links!r}")
    given = path  # errors name the path as the caller gave it
    if links == "follow":
        _write_followed(Path(os.path.realpath(path)), write, given)
        return
    path = Path(os.path.abspath(path))
    base = path.parent if root is None else Path(os.path.abspath(root))
    try:
        parts = path.parent.relative_to(base).parts
    except ValueError:
        raise ValueError(f"atomic_write: {path} is not inside {base}") from None
    try:
        dir_fd = _open_owned_dir(base, parts, given)
    except OSError as exc:
        raise _named(given, exc) from None
    try:
        _write_in(dir_fd, path.name, write, given, links)
    finally:
        os.close(dir_fd)


def _write_in(dir_fd: int, name: str, write, given, links: str) -> None:
    """:func:`atomic_write` of the entry ``name`` of the directory ``dir_fd``, no link followed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _named(given, exc) from None
    readlink = lambda: os.readlink(name, dir_fd=dir_fd)  # noqa: E731
    replaced = readlink() if st is not None and stat.S_ISLNK(st.st_mode) else None
    mode = _own_entry(given, st.st_mode if st is not None else None, readlink, links)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        while True:
            tmp = f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
                break
            except FileExistsError:
                continue
    except OSError as exc:
        raise _named(given, exc) from None
    try:
        # the temporary file is 0600: give the file the old one's permissions, or open()'s
        os.fchmod(fd, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # a rename never follows a link
    except BaseException as exc:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _named(given, exc) from None
        raise
    if replaced is not None:
        print(f"fp8sim: {given} was a symbolic link (to {replaced}); replaced by fp8sim's file, "
              f"{replaced} untouched", file=sys.stderr)  # fmt: skip
    _remove_stale_temps(dir_fd, name)


def _write_followed(path: Path, write, given) -> None:
    """:func:`atomic_write` with ``links="follow"``: ``path`` is the link's resolved target."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    if mode is not None and not stat.S_ISREG(mode):  # /dev/null, a FIFO: in place
        try:
            with open(path, "wb") as f:
                write(f)
        except OSError as exc:
            raise _named(given, exc) from None
        return
    try:
        dir_fd = _open_owned_dir(path.parent, (), given)
    except OSError as exc:
        raise _named(given, exc) from None
    try:
        _write_in(dir_fd, path.name, write, given, "refuse")
    finally:
        os.close(dir_fd)


def _own_file_mode(path) -> int | None:
    """lstat mode of fp8sim's own file ``path`` (None: absent); :class:`WriteError` for a link or
    anything but a regular file there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return _own_entry(path, mode, lambda: os.readlink(path))


def remove_own_file(path: str | os.PathLike) -> None:
    """Remove fp8sim's own file ``path`` if it is there; a link or anything but a regular file
    there is refused (:class:`WriteError`), never removed."""
    if _own_file_mode(path) is not None:
        os.unlink(path)


def _open_for_append(path, flags: int = os.O_WRONLY | os.O_APPEND | os.O_CREAT) -> int:
    """``open``'s opener for :func:`append_line`: no link followed, never blocks on a FIFO."""
    return os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` (its newline included) to ``path`` whole or not at all: a failed write (a
    full disk) cuts the file back to its old length and raises :class:`WriteError`. (A process
    killed mid-write may leave part of a last line with no newline: readers drop such a line.)
    ``path`` is fp8sim's own file: a symbolic link or anything but a regular file there is
    refused, never written through."""
    data = line.encode()
    try:
        _own_file_mode(path)
        with open(path, "ab", opener=lambda p, _flags: _open_for_append(p)) as f:
            st = os.fstat(f.fileno())
            _own_entry(path, st.st_mode, lambda: "?")  # swapped for a FIFO since the lstat: refused
            os.set_blocking(f.fileno(), True)
            size = st.st_size
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
        if exc.errno == errno.ELOOP and not isinstance(exc, WriteError):  # a link made since the lstat
            exc = _refused(path, "a symbolic link where fp8sim writes its own file; refused, nothing written "
                                 "through it (remove the link)")  # fmt: skip
        raise _named(path, exc) from None


def save_figure(fig, path, **kw) -> None:
    """A matplotlib figure as a PNG at ``path`` through :func:`atomic_write` (a failed or
    interrupted save keeps the old file). Plot names are the program's, in a plot directory: a
    symbolic link found there is replaced by the PNG (said on stderr), never followed."""
    atomic_write(Path(path), lambda f: fig.savefig(f, format="png", **kw), links="replace")
