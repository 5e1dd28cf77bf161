"""Cut a trace back to a step: what a resumed run does before it records again.

A run resumes from its last checkpoint, so the steps after it are run -- and recorded -- again.
The trace may already hold some of them (a chunk flushed when the run was interrupted, full
tensors saved): :func:`truncate_trace` removes every record and saved tensor of a later step, so
the re-recorded steps replace them instead of colliding. A chunk that straddles the step is
rewritten with its earlier rows (new file first, then the old one is removed: an interruption
leaves both, and readers then take the shorter one -- see
:func:`fp8sim.trace.layout.list_chunks` -- until the next truncation removes the other). Used by
:meth:`fp8sim.trace.TraceWriter.truncate_after`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fp8sim.input_files import open_regular
from fp8sim.atomic_file import atomic_write
from fp8sim.trace.block_columns import is_block_column, keep_block_rows
from fp8sim.trace.layout import (
    CHUNK_DIR,
    CHUNK_RE,
    TENSOR_DIR,
    TENSOR_RE,
    chunk_file_name,
    list_chunks,
)

__all__ = ["truncate_trace"]


def _keep_rows(cols: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The chunk's columns for the rows where ``keep`` is True (histograms re-packed)."""
    off = cols["hist_offsets"]
    rows = np.flatnonzero(keep)
    whole = ("hist_offsets", "hist_bins", "hist_counts", "trace_id")  # trace_id: the chunk's, kept as is
    out = {k: v[keep] for k, v in cols.items() if k not in whole and not is_block_column(k)}
    out.update(keep_block_rows(cols, keep))
    if "trace_id" in cols:
        out["trace_id"] = cols["trace_id"]
    pieces = [slice(int(off[i]), int(off[i + 1])) for i in rows]
    sizes = np.array([s.stop - s.start for s in pieces], dtype=np.int64)
    out["hist_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out["hist_bins"] = np.concatenate([cols["hist_bins"][s] for s in pieces] + [cols["hist_bins"][:0]])
    out["hist_counts"] = np.concatenate([cols["hist_counts"][s] for s in pieces] + [cols["hist_counts"][:0]])
    return out


def truncate_trace(path: str | os.PathLike, step: int) -> tuple[int, int | None]:
    """Remove every record and saved tensor of a step after ``step`` from the trace at ``path``.

    Returns ``(next chunk sequence number, last step still stored or None)``. Only the trace's
    own files are removed: a ``chunks`` or ``tensors`` that is a symbolic link is refused (the
    files of the directory it points to are not the trace's).
    """
    path = Path(path)
    step = int(step)
    for sub in (CHUNK_DIR, TENSOR_DIR):
        if (path / sub).is_symlink():
            raise ValueError(f"{path / sub}: a symbolic link where the trace keeps its own directory; "
                             "refused (nothing is removed or written through it)")  # fmt: skip
    listed = {c[3] for c in list_chunks(path)}
    if (path / CHUNK_DIR).is_dir():  # the longer twin a previous interrupted truncation left
        for f in (path / CHUNK_DIR).iterdir():
            if CHUNK_RE.match(f.name) and f not in listed:
                f.unlink()
    # from the last chunk down: an interruption leaves a prefix of the chunks, never a gap
    for seq, first, last, f in reversed(list_chunks(path)):
        if first > step:
            f.unlink()
        elif last > step:
            with open_regular(f) as fh, np.load(fh, allow_pickle=False) as z:  # a FIFO: refused
                cols = {k: z[k] for k in z.files}
            kept = _keep_rows(cols, cols["step"] <= step)
            new_last = int(kept["step"].max()) if kept["step"].size else first
            name = chunk_file_name(seq, first, new_last)
            atomic_write(path / CHUNK_DIR / name, lambda fh: np.savez_compressed(fh, **kept), root=path)
            if name != f.name:
                f.unlink()
    tdir = path / TENSOR_DIR
    if tdir.is_dir():
        for f in tdir.iterdir():
            m = TENSOR_RE.match(f.name)
            if m and int(m.group(1)) > step:
                f.unlink()
    chunks = list_chunks(path)
    return (chunks[-1][0] + 1 if chunks else 0), max((c[2] for c in chunks), default=None)
