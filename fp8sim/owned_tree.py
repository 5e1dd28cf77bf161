"""A directory that fp8sim fills whole (a demo report folder): the list of the files it wrote,
and removing exactly those before it writes again.

The list is a JSON file at the top of the folder (``{"schema": ..., "complete": true, "files":
{path: sha256}, "dirs": [path, ...]}``, paths relative, ``/``-separated). :func:`begin_list`
writes an empty one (``complete`` false) before the work starts and :func:`list_files` the whole
one when it ends (whether it finished or failed; a process killed outright leaves the empty one).
:func:`clear_listed` is the rerun: it walks the whole folder first, without following links, and
refuses in one line -- deleting nothing -- if anything there is not on the list as it was
written: a file or directory of somebody else's anywhere inside, a file that changed since (its
SHA-256 differs), a symbolic link, a FIFO. Only then does it delete the listed files and
directories, and the list.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from fp8sim.atomic_file import atomic_write
from fp8sim.input_files import read_json

__all__ = ["begin_list", "list_files", "clear_listed", "has_list"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", opener=lambda p, fl: os.open(p, fl | getattr(os, "O_NOFOLLOW", 0))) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _walk(root: Path, skip: str):
    """(relative path, lstat mode) of every entry under ``root`` but ``skip`` (at the top),
    directories after their contents; links are listed, never entered."""
    for top, dirs, files in os.walk(root, topdown=False, followlinks=False):
        for name in files + dirs:
            rel = Path(top, name).relative_to(root)
            if rel.as_posix() != skip:
                yield rel.as_posix(), os.lstat(Path(top, name)).st_mode


def has_list(root: str | os.PathLike, name: str) -> bool:
    """Whether ``root`` holds an entry named ``name`` (a list, or something in its place)."""
    return os.path.lexists(Path(root) / name)


def _write(root: Path, name: str, doc: dict) -> None:
    text = json.dumps(doc, indent=1) + "\n"
    atomic_write(root / name, lambda f: f.write(text.encode()))


def begin_list(root: str | os.PathLike, name: str, schema: str) -> None:
    """Write the empty list ``root/name`` (``root`` made if missing): the work begins."""
    _write(Path(root), name, {"schema": schema, "complete": False, "files": {}, "dirs": []})


def list_files(root: str | os.PathLike, name: str, schema: str) -> None:
    """Write the list ``root/name``: every regular file under ``root`` with its SHA-256, and
    every directory (links and other entries are never listed: they are not fp8sim's)."""
    root = Path(root)
    entries = list(_walk(root, name))
    files = {rel: _sha256(root / rel) for rel, mode in entries if stat.S_ISREG(mode)}
    dirs = sorted(rel for rel, mode in entries if stat.S_ISDIR(mode))
    _write(root, name, {"schema": schema, "complete": True, "files": dict(sorted(files.items())), "dirs": dirs})


def clear_listed(root: str | os.PathLike, name: str, schema: str, option: str) -> None:
    """Remove what the list ``root/name`` names, and the list, if ``root`` holds nothing else
    (see the module docstring); else ValueError naming ``option``, ``root`` and the first entry
    that is not fp8sim's, with nothing removed."""
    root = Path(root)
    where = f"{option} {root}"
    try:
        doc = read_json(root / name, what="list of files")
    except (OSError, ValueError):  # not JSON, no regular file, unreadable
        doc = None
    ok = isinstance(doc, dict) and doc.get("schema") == schema
    files, dirs = (doc.get("files"), doc.get("dirs")) if ok else (None, None)
    if not (isinstance(files, dict) and isinstance(dirs, list)):
        raise ValueError(f"{where}: {name} is not a list of files of this fp8sim (an older report, or a damaged "
                         "one); fp8sim deletes only what it wrote: remove the folder yourself, or choose "
                         "another (nothing was deleted)")  # fmt: skip
    entries = list(_walk(root, name))
    for rel, mode in entries:
        if stat.S_ISDIR(mode) and rel in dirs or stat.S_ISREG(mode) and rel in files:
            pass
        elif doc.get("complete") is not True:
            raise ValueError(f"{where}: the run that wrote it was stopped before it listed its files (it holds "
                             f"{rel!r}), so fp8sim cannot tell them from yours; remove the folder yourself, or "
                             "choose another (nothing was deleted)")  # fmt: skip
        else:
            what = {stat.S_IFLNK: "a symbolic link", stat.S_IFREG: "a file", stat.S_IFDIR: "a directory"}.get(
                stat.S_IFMT(mode), "an entry")  # fmt: skip
            raise ValueError(f"{where}: holds {rel!r}, {what} fp8sim did not write; move it away, or choose "
                             "another folder (nothing was deleted)")  # fmt: skip
        if stat.S_ISREG(mode) and _sha256(root / rel) != files[rel]:
            raise ValueError(f"{where}: {rel!r} changed since fp8sim wrote it; move it away, or choose "
                             "another folder (nothing was deleted)")  # fmt: skip
    for rel, mode in entries:  # contents before their directory
        path = root / rel
        if stat.S_ISDIR(mode):
            try:
                path.rmdir()
            except OSError:  # filled meanwhile by somebody else: kept
                pass
        else:
            path.unlink(missing_ok=True)
    (root / name).unlink(missing_ok=True)
