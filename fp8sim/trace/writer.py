"""Writing a trace: :class:`TraceWriter` (the layout it writes: :mod:`fp8sim.trace.layout`).

Atomicity: every file is written to a temporary name in the same directory, fsync'ed and moved
into place with ``os.replace``. A chunk contains whole steps only and a step never spans two
chunks, so a reader never sees half a step; ``trace.json`` is updated before a chunk that needs a
new catalogue entry. An interrupted writer loses only steps not yet flushed; a resumed run cuts
the trace back to its checkpoint step (:meth:`TraceWriter.truncate_after`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fp8sim.atomic_file import atomic_write
from fp8sim.formats import FloatFormat, get_format
from fp8sim.trace.histogram import (
    COUNT_ROUNDINGS,
    DEFAULT_HIST_MANTISSA_BITS,
    EXPONENT_MAX,
    EXPONENT_MIN,
    check_mantissa_bits,
)
from fp8sim.trace.block_columns import block_columns
from fp8sim.trace.statistics import HistogramCounts, histogram_and_counts
from fp8sim.trace.layout import (
    CHUNK_DIR,
    CHUNK_RE,
    COLUMN_DTYPES,
    ROLES,
    SCALAR_COLUMNS,
    SCHEMA,
    TENSOR_DIR,
    TENSOR_RE,
    TRACE_JSON,
    VERSION,
    chunk_file_name,
    is_trace,
    list_chunks,
    tensor_file_name,
)
from fp8sim.trace.truncate import truncate_trace

__all__ = ["TraceWriter"]


# ------------------------------------------------------------------------------------------
# writer
# ------------------------------------------------------------------------------------------
class TraceWriter:
    """Record per-step tensor statistics into a trace directory.

    Usage (the training recorder)::

        with TraceWriter("runs/x/trace", config={"model": "gpt-tiny", "recipe": "te"}) as tw:
            tw.add_tensor("h0.attn.qkv.weight", "weight", "e4m3", (384, 128))
            for step in range(n):
                ...
                tw.record(step, "h0.attn.qkv.weight", w, amax=amax, scale=scale)
                if step % 100 == 0:
                    tw.save_tensor(step, "h0.attn.qkv.weight", w)

    Steps must not decrease. A step is complete when a larger step is recorded, or at
    :meth:`flush` / :meth:`close`; recording into a flushed step raises ValueError. Every
    ``chunk_steps`` complete steps are written as one chunk file.

    Args:
        path: trace directory; created. ``mode="w"`` refuses a directory that already holds a
            trace unless ``overwrite=True``; ``mode="a"`` appends to an existing trace (a resumed
            run): new steps must be larger than the last one stored.
        config: JSON-serializable run configuration, stored in trace.json.
        chunk_steps: complete steps per chunk file.
        hist_mantissa_bits: k, mantissa bits kept by the |x| histogram (5: exact for every 8-bit
            format; a format with M mantissa bits needs k >= M + 1).
        rounding: rounding the stored overflow/underflow counts assume (:data:`COUNT_ROUNDINGS`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        config: Mapping[str, Any] | None = None,
        *,
        mode: str = "w",
        overwrite: bool = False,
        chunk_steps: int = 50,
        hist_mantissa_bits: int = DEFAULT_HIST_MANTISSA_BITS,
        rounding: str = "rne",
    ) -> None:
        self.path = Path(path)
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        if not (isinstance(chunk_steps, int) and chunk_steps >= 1):
            raise ValueError(f"chunk_steps must be an int >= 1, got {chunk_steps!r}")
        check_mantissa_bits(hist_mantissa_bits)
        if rounding not in COUNT_ROUNDINGS:
            raise ValueError(f"rounding must be one of {COUNT_ROUNDINGS}, got {rounding!r}")
        self._buf: list[dict[str, Any]] = []
        self._buf_steps: list[int] = []  # distinct steps in the buffer, ascending
        self._last_flushed_step: int | None = None
        self._closed = False
        if mode == "a" and is_trace(self.path):
            from fp8sim.input_files import read_json
            from fp8sim.trace import layout

            meta = read_json(self.path / TRACE_JSON, layout.MAX_TRACE_JSON_BYTES, what="trace.json")
            if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), list):
                raise ValueError(f"{self.path / TRACE_JSON}: corrupt trace.json (not a trace's object)")
            if meta.get("version") != VERSION:
                raise ValueError(f"{self.path}: trace version {meta.get('version')} != {VERSION}")
            self._meta = meta
            chunks = list_chunks(self.path)
            self._seq = chunks[-1][0] + 1 if chunks else 0
            self._last_flushed_step = max((c[2] for c in chunks), default=None)
            if config is not None:
                self._meta.setdefault("resumes", []).append(_json_ready(dict(config)))
        else:
            if (self.path / TRACE_JSON).exists() and not overwrite:
                raise ValueError(
                    f"{self.path} already holds a trace; use mode='a' to append or overwrite=True"
                )
            if overwrite and self.path.exists():  # the old trace's files only, never anything else
                for sub, own in ((CHUNK_DIR, CHUNK_RE), (TENSOR_DIR, TENSOR_RE)):
                    d = self.path / sub
                    for f in d.iterdir() if d.is_dir() and not d.is_symlink() else ():
                        if own.match(f.name) and not f.is_dir():
                            f.unlink()
            self._meta = {
                "schema": SCHEMA,
                "version": VERSION,
                "trace_id": uuid.uuid4().hex,  # every chunk carries it: a copied-in one is refused
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "config": _json_ready(dict(config or {})),
                "rounding": rounding,
                "chunk_steps": chunk_steps,
                "hist": {
                    "mantissa_bits": int(hist_mantissa_bits),
                    "exponent_min": EXPONENT_MIN,
                    "exponent_max": EXPONENT_MAX,
                    "value": "float32(|x|)",
                },
                "formats": [],
                "tensors": [],
            }
            self._seq = 0
        self.chunk_steps = int(self._meta["chunk_steps"]) if mode == "a" else chunk_steps
        self.hist_mantissa_bits = int(self._meta["hist"]["mantissa_bits"])
        self.rounding = self._meta["rounding"]
        self._index = {t["name"]: i for i, t in enumerate(self._meta["tensors"])}
        self._meta_dirty = True
        self._write_meta()

    # -- catalogue ---------------------------------------------------------------------------
    def add_tensor(
        self, name: str, role: str, fmt: str | FloatFormat, shape: Sequence[int], *,
        placement: str | None = None, what_if: bool = False,
    ) -> None:
        """Declare a tensor. Re-declaring it with the same role/format/shape is a no-op.
        ``placement`` (``partitioned`` or ``replicated`` over the ranks of a run; default by role):
        how :mod:`fp8sim.trace.merge` combines the ranks' records. ``what_if``: the run does not
        perform this cast; the record says what it would do (the recorder's weight gradients
        under a recipe that keeps them in high precision)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        if role not in ROLES:
            raise ValueError(f"tensor {name!r}: role must be one of {ROLES}, got {role!r}")
        fmt_name = get_format(fmt).name
        entry = {"name": name, "role": role, "format": fmt_name, "shape": [int(s) for s in shape],
                 "what_if": bool(what_if)}
        if placement is not None:
            if placement not in ("partitioned", "replicated"):
                raise ValueError(f"tensor {name!r}: placement must be partitioned or replicated, got {placement!r}")
            entry["placement"] = placement
        if name in self._index:
            old = self._meta["tensors"][self._index[name]]
            if "what_if" not in old:  # declared by a writer older than the flag
                entry.pop("what_if")
            if old != entry:
                raise ValueError(f"tensor {name!r} already declared as {old}, now {entry}")
            return
        self._index[name] = len(self._meta["tensors"])
        self._meta["tensors"].append(entry)
        self._format_id(fmt_name)
        self._meta_dirty = True

    def _format_id(self, fmt_name: str) -> int:
        fl = self._meta["formats"]
        if fmt_name not in fl:
            fl.append(fmt_name)
            self._meta_dirty = True
        return fl.index(fmt_name)

    def _tensor_id(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(f"tensor {name!r} not declared; call add_tensor first") from None

    # -- recording ---------------------------------------------------------------------------
    def record(
        self,
        step: int,
        name: str,
        x: Any,
        *,
        scale: float,
        amax: float | None = None,
        fmt: str | FloatFormat | None = None,
        overflow: int | None = None,
        underflow: int | None = None,
    ) -> None:
        """Record tensor ``name`` at ``step``: one numba pass over ``x`` (numpy array or torch
        tensor, any float dtype, any device) computes the |x| histogram, zero/NaN/inf counts and
        the overflow/underflow counts of ``encode(float32(float32(x) * float32(scale)))`` in ``fmt``
        (default: the catalogue's) under the trace's rounding.

        ``amax``: the amax the scaling policy saw (default: max finite |x|). ``overflow``,
        ``underflow``: measured counts from the actual cast, stored instead of computed ones
        (use this when the cast used stochastic rounding).
        """
        self._check_open()
        scale_f = self._checked_scale(name, step, scale)
        fmt_obj = get_format(fmt if fmt is not None else self._meta["tensors"][self._tensor_id(name)]["format"])
        r = histogram_and_counts(x, fmt_obj, scale_f, self.rounding, self.hist_mantissa_bits)
        self.record_counts(step, name, r, scale=scale_f, amax=amax, fmt=fmt_obj, overflow=overflow,
                           underflow=underflow)  # fmt: skip

    def record_counts(
        self,
        step: int,
        name: str,
        r: HistogramCounts,
        *,
        scale: float,
        amax: float | None = None,
        fmt: str | FloatFormat | None = None,
        overflow: int | None = None,
        underflow: int | None = None,
        blocks: Any = None,
    ) -> None:
        """:meth:`record` with the statistics already computed (``r``: the
        :func:`fp8sim.trace.statistics.histogram_and_counts` of the tensor under ``scale``, this
        trace's rounding and histogram width), e.g. on the tensor's device. ``blocks``: the
        cast's block statistics (:class:`fp8sim.trace.block_stats.BlockStats`), if block-scaled."""
        self._check_open()
        step = int(step)
        if step < 0:  # chunk file names carry steps as unsigned numbers
            raise ValueError(f"step {step} of {name!r}: steps must be >= 0")
        tid = self._tensor_id(name)
        if self._last_flushed_step is not None and step <= self._last_flushed_step:
            raise ValueError(
                f"step {step} of {name!r}: steps up to {self._last_flushed_step} are already "
                "flushed; steps must increase"
            )
        if self._buf_steps and step < self._buf_steps[-1]:
            raise ValueError(f"step {step} of {name!r} after step {self._buf_steps[-1]}")
        fmt_obj = get_format(fmt if fmt is not None else self._meta["tensors"][tid]["format"])
        scale_f = self._checked_scale(name, step, scale)
        if amax is not None and float(amax) < 0:  # NaN and inf are what a policy may see
            raise ValueError(f"{name!r} step {step}: amax must be >= 0 (or NaN/inf), got {amax}")
        if not self._buf_steps or self._buf_steps[-1] != step:
            self._complete_steps_ready()  # the previous step is now complete
            self._buf_steps.append(step)
        self._buf.append(
            dict(
                step=step, tensor=tid, format=self._format_id(fmt_obj.name), numel=r.numel,
                zero=r.zero, nan=r.nan, inf=r.inf,
                amax=float(r.amax if amax is None else float(amax)), scale=scale_f,
                overflow=r.overflow if overflow is None else int(overflow),
                underflow=r.underflow if underflow is None else int(underflow),
                bins=r.bins, counts=r.counts, blocks=blocks,
            )
        )  # fmt: skip

    @staticmethod
    def _checked_scale(name: str, step: int, scale: Any) -> float:
        """``scale`` as a float32 value, ValueError unless finite and > 0 (replay rebuilds the
        cast from it: a usable scale only)."""
        if not (isinstance(scale, (int, float, np.floating)) or np.ndim(scale) == 0):
            raise TypeError(f"{name!r}: scale must be a scalar (per-tensor scaling)")
        with np.errstate(over="ignore"):
            scale_f = float(np.float32(float(scale)))
        if not (0 < scale_f < np.inf):
            raise ValueError(f"{name!r} step {step}: scale must be finite and > 0 as a float32, "
                             f"got {scale}")  # fmt: skip
        return scale_f

    def _complete_steps_ready(self) -> None:
        # called when a new step starts: every buffered step is complete
        if len(self._buf_steps) >= self.chunk_steps:
            self._write_chunk()

    def save_tensor(self, step: int, name: str, x: Any) -> Path:
        """Store the full tensor as ``tensors/{step:08d}-{index:05d}.safetensors`` (atomic).

        Keeps the dtype (float32, bfloat16, float16, float64). Returns the file path.
        """
        self._check_open()
        import torch
        from safetensors.torch import save

        tid = self._tensor_id(name)
        if type(x).__module__.startswith("torch"):
            t = x.detach().cpu().contiguous()
        else:
            a = np.ascontiguousarray(np.asarray(x))
            if a.dtype.name == "bfloat16":
                t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
            else:
                t = torch.from_numpy(a.copy())
        data = save({name: t}, metadata={"step": str(int(step)), "name": name})
        path = self.path / TENSOR_DIR / tensor_file_name(step, tid)
        atomic_write(path, lambda f: f.write(data), root=self.path)
        return path

    def truncate_after(self, step: int) -> None:
        """Forget every stored record and saved tensor of a step after ``step`` (a resumed run
        records those steps again); see :mod:`fp8sim.trace.truncate`."""
        self._check_open()
        self._buf = [r for r in self._buf if r["step"] <= step]
        self._buf_steps = [s for s in self._buf_steps if s <= step]
        self._seq, self._last_flushed_step = truncate_trace(self.path, step)

    def discard_after(self, step: int) -> None:
        """Forget the buffered (not yet written) records of steps after ``step``: a step cut
        short by an interruption, which a flush would otherwise write as if complete."""
        self._buf = [r for r in self._buf if r["step"] <= step]
        self._buf_steps = [s for s in self._buf_steps if s <= step]

    # -- output ----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every buffered step (all are treated as complete) and trace.json."""
        self._check_open()
        if self._buf:
            self._write_chunk()
        self._write_meta()

    def close(self) -> None:
        """Flush and close; further calls raise ValueError."""
        if self._closed:
            return
        self.flush()
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"trace writer for {self.path} is closed")

    def _write_meta(self) -> None:
        if self._meta_dirty:
            text = json.dumps(self._meta, indent=1)
            atomic_write(self.path / TRACE_JSON, lambda f: f.write(text.encode()))
            self._meta_dirty = False

    def _write_chunk(self) -> None:
        self._write_meta()  # the catalogue first: a reader never sees a chunk it cannot name
        rows = self._buf
        cols: dict[str, np.ndarray] = {}
        for c, dt in zip(SCALAR_COLUMNS, COLUMN_DTYPES):
            cols[c] = np.array([r[c] for r in rows], dtype=dt)
        sizes = np.array([r["bins"].size for r in rows], dtype=np.int64)
        cols["hist_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        cols["hist_bins"] = np.concatenate([r["bins"] for r in rows] + [np.zeros(0, np.uint32)])
        cols["hist_counts"] = np.concatenate([r["counts"] for r in rows] + [np.zeros(0, np.int64)])
        cols.update(block_columns([r.get("blocks") for r in rows]))
        if self._meta.get("trace_id") is not None:  # an older trace appended to has none
            cols["trace_id"] = np.array(self._meta["trace_id"])
        first, last = self._buf_steps[0], self._buf_steps[-1]
        name = chunk_file_name(self._seq, first, last)
        atomic_write(self.path / CHUNK_DIR / name, lambda f: np.savez_compressed(f, **cols), root=self.path)
        self._seq += 1
        self._last_flushed_step = last
        self._buf = []
        self._buf_steps = []


def _json_ready(d: dict) -> dict:
    try:
        json.dumps(d)
    except TypeError as exc:
        raise TypeError(f"trace config must be JSON-serializable: {exc}") from None
    return d
