"""The on-disk layout of a trace: file names, the chunk columns, and listing what is stored.

A trace is a directory::

    trace.json                                  schema, run config, tensor catalogue
    chunks/chunk-000000-s00000000-00000049.npz  per-step scalars + histograms, whole steps only
    tensors/00000100-00003.safetensors          optional full tensor (step 100, tensor #3)

``trace.json``: ``{"schema": "fp8sim-trace", "version": 1, "trace_id": "<32 hex digits>",
"config": {...run config...},
"rounding": "rne", "chunk_steps": N, "hist": {"mantissa_bits": k, "exponent_min": -150,
"exponent_max": 128}, "formats": [names], "tensors": [{"name", "role", "format", "shape",
"what_if"}]}``. Roles: :data:`ROLES`. ``what_if`` (true or false; absent in traces written before
it, :func:`fp8sim.trace.reader.is_what_if`): the run did not perform this cast, and the records
say what it would have done.

Each chunk holds one row per (step, tensor) record, columnar (see :data:`SCALAR_COLUMNS`):
``step, tensor`` (catalogue index), ``format`` (index into ``formats``), ``numel, zero, nan, inf,
amax, scale, overflow, underflow``, plus a sparse histogram per row (``hist_offsets`` into
``hist_bins`` / ``hist_counts``), and ``trace_id``: its trace's id (a string), so a chunk copied
in from another trace is refused (traces of older versions have no id, nor have their chunks).

Scale convention: ``scale`` is the multiplier applied before the cast, as in
``fp8sim.scaling``: ``codes = encode(float32(float32(x) * float32(scale)))`` -- the input taken
to float32, the product rounded once to float32, as a GPU kernel does. ``overflow`` counts
finite values whose scaled magnitude rounds above ``fmt.max`` (whatever the saturation rule then
does with them); ``underflow`` counts nonzero values that round to zero. Both follow the trace's
``rounding`` (``rne`` by default; ``rna`` and ``rtz`` are also understood) unless the recorder
passed measured counts.

The histogram of |x| and why its counts are exact: see :mod:`fp8sim.trace.histogram`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from fp8sim.input_files import open_regular

__all__ = [
    "SCHEMA",
    "VERSION",
    "ROLES",
    "SCALAR_COLUMNS",
    "COLUMN_DTYPES",
    "TRACE_JSON",
    "CHUNK_DIR",
    "TENSOR_DIR",
    "CHUNK_RE",
    "TENSOR_RE",
    "chunk_file_name",
    "tensor_file_name",
    "list_chunks",
    "is_trace",
    "MAX_TRACE_JSON_BYTES",
]

SCHEMA = "fp8sim-trace"
VERSION = 1
#: what a tensor is for; the analysis groups and colours by it
ROLES = ("activation", "weight", "grad_output", "weight_grad", "optimizer_state")
#: per-record columns of a chunk (besides the histogram arrays)
SCALAR_COLUMNS = (
    "step", "tensor", "format", "numel", "zero", "nan", "inf",
    "amax", "scale", "overflow", "underflow",
)  # fmt: skip
#: the numpy dtype of each of :data:`SCALAR_COLUMNS`, in the same order
COLUMN_DTYPES = (
    np.int64, np.int32, np.int16, np.int64, np.int64, np.int64, np.int64,
    np.float64, np.float64, np.int64, np.int64,
)  # fmt: skip

TRACE_JSON = "trace.json"
#: most bytes of a trace.json read (the catalogue of a model of thousands of tensors is MiBs): a
#: longer one is refused as damaged, never read whole into memory
MAX_TRACE_JSON_BYTES = 64 << 20
CHUNK_DIR = "chunks"
TENSOR_DIR = "tensors"
#: a chunk file's name: groups (sequence number, first step, last step)
CHUNK_RE = re.compile(r"^chunk-(\d{6})-s(\d+)-(\d+)\.npz$")
#: a saved tensor's file name: groups (step, catalogue index)
TENSOR_RE = re.compile(r"^(\d{8})-(\d{5})\.safetensors$")


def chunk_file_name(seq: int, first_step: int, last_step: int) -> str:
    """The name of chunk ``seq`` holding steps ``first_step..last_step`` (:data:`CHUNK_RE`)."""
    return f"chunk-{seq:06d}-s{first_step:08d}-{last_step:08d}.npz"


def tensor_file_name(step: int, index: int) -> str:
    """The name of the saved tensor of catalogue entry ``index`` at ``step`` (:data:`TENSOR_RE`)."""
    return f"{int(step):08d}-{index:05d}.safetensors"


def list_chunks(path: Path) -> list[tuple[int, int, int, Path]]:
    """(seq, first_step, last_step, path) of every complete chunk file, by seq. Two files of one
    seq exist only when a truncation (:mod:`fp8sim.trace.truncate`) was interrupted between
    writing the shortened chunk and removing the old one: the shorter one counts."""
    best: dict[int, tuple[int, int, int, Path]] = {}
    d = path / CHUNK_DIR
    if d.is_dir():
        for f in d.iterdir():
            m = CHUNK_RE.match(f.name)
            if m:
                c = (int(m.group(1)), int(m.group(2)), int(m.group(3)), f)
                if c[0] not in best or c[2] < best[c[0]][2]:
                    best[c[0]] = c
    return sorted(best.values())


def is_trace(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a trace directory: its trace.json is a JSON object of this schema
    (a trace.json of something else, a profiler's say, is not). Raises ValueError for a
    trace.json that names this schema but does not parse: a damaged trace, which must not pass
    for a folder of other files."""
    p = Path(path) / TRACE_JSON
    if not p.is_file():  # a regular file (through links): a FIFO named trace.json is no trace
        return False
    try:
        with open_regular(p) as f:
            raw = f.read(MAX_TRACE_JSON_BYTES + 1)
    except (OSError, ValueError):
        return False
    text = raw.decode("utf-8", errors="replace")
    if len(raw) > MAX_TRACE_JSON_BYTES:
        if SCHEMA in text[:4096]:
            raise ValueError(f"{p}: corrupt trace.json (more than {MAX_TRACE_JSON_BYTES} bytes, "
                             f"the most a trace.json is read to; names the {SCHEMA} schema)")  # fmt: skip
        return False
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:
        if SCHEMA in text:
            why = ": nested too deeply" if isinstance(exc, RecursionError) else ""
            raise ValueError(f"{p}: corrupt trace.json (names the {SCHEMA} schema but is not "
                             f"valid JSON{why})") from None  # fmt: skip
        return False
    return isinstance(meta, dict) and meta.get("schema") == SCHEMA
