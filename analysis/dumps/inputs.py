"""Which of the paths an ``analyze`` command reached are analyzed: each file once, and regular
files only (a FIFO, socket or device with a dump's name is refused by name, never opened)."""

from __future__ import annotations

import os
import stat

from fp8sim.input_files import file_kind

__all__ = ["each_file_once", "require_regular_file"]


def require_regular_file(path: str) -> None:
    """ValueError ``"<path>: a named pipe (FIFO), not a regular file ..."`` unless ``path``
    (through symbolic links) is a regular file. It is only stat'ed: a FIFO is never opened
    (opening one blocks until a writer comes; a device may never end)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: {file_kind(mode)}, not a regular file or a directory; dumps are read "
                         "from regular files only")  # fmt: skip


def each_file_once(paths: list[str]) -> tuple[list[str], list[dict]]:
    """The paths with each file or trace once (its first spelling), however often it was reached
    (given twice, through a symbolic or hard link, or inside a given directory as well), and
    without the files inside a trace that is analyzed (the trace takes its saved tensors), with
    a note for each left out: a file analyzed twice would count every figure twice, and a
    shard given twice would keep its companion scale as a tensor of its own in the second copy."""
    def key(p: str):
        try:
            st = os.stat(p)
            return (st.st_dev, st.st_ino)
        except OSError:
            return os.path.realpath(p)

    first: dict = {}
    kept, left_out = [], []
    for p in paths:
        k = key(p)
        if k in first:
            left_out.append({"file": p, "name": "",
                             "note": f"the same file as {first[k]}: analyzed once"})  # fmt: skip
        else:
            first[k] = p
            kept.append(p)
    traces = [(os.path.realpath(t) + os.sep, t) for t in kept if os.path.isdir(t)]
    out = []
    for p in kept:
        real = os.path.realpath(p)
        inside = next((t for root, t in traces if real.startswith(root)), None)
        if inside is None:
            out.append(p)
        else:
            left_out.append({"file": p, "name": "",
                             "note": f"inside the trace {inside}: analyzed with it"})  # fmt: skip
    return out, left_out
