"""Which of the paths an ``analyze`` command reached are analyzed: each file once."""

from __future__ import annotations

import os

__all__ = ["each_file_once"]


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
