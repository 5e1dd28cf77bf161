"""Reading a trace: :class:`TraceReader`, and the records it returns (the layout it reads:
:mod:`fp8sim.trace.layout`; what it checks: :mod:`fp8sim.trace.checks`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fp8sim.input_files import open_regular, read_json, require_regular_file
from fp8sim.trace import layout
from fp8sim.trace.block_columns import block_record, check_block_columns
from fp8sim.trace.checks import (
    check_catalogue,
    check_chunk_columns,
    check_chunk_identity,
    check_chunk_sequence,
    check_chunk_values,
    check_count_totals,
)
from fp8sim.trace.histogram import AbsHistogram, num_bins
from fp8sim.trace.layout import (
    CHUNK_RE,
    COLUMN_DTYPES,
    SCALAR_COLUMNS,
    SCHEMA,
    TENSOR_DIR,
    TENSOR_RE,
    TRACE_JSON,
    VERSION,
    list_chunks,
    tensor_file_name,
)

__all__ = ["TraceReader", "TensorInfo", "TraceRecord"]


@dataclass(frozen=True)
class TensorInfo:
    """One catalogue entry: ``name``, ``role`` (:data:`fp8sim.trace.layout.ROLES`), ``format``
    name, ``shape``, ``index`` (its position in the catalogue), ``what_if`` (the run did not
    perform this cast: its records say what the cast would have done; see :func:`is_what_if`)."""

    name: str
    role: str
    format: str
    shape: tuple[int, ...]
    index: int = -1
    what_if: bool = False


@dataclass
class TraceRecord:
    """One tensor at one step, as read back (scale: multiplier before the cast)."""

    step: int
    name: str
    format: str
    numel: int
    zero: int
    nan: int
    inf: int
    amax: float
    scale: float
    overflow: int
    underflow: int
    hist: AbsHistogram
    #: the cast's block statistics (:class:`fp8sim.trace.block_stats.BlockStats`), if block-scaled
    blocks: Any = None


def _list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise TypeError(f"{what} is a {type(v).__name__}, not a list")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{what}: {type(v).__name__} {v!r:.40}, not a string")
    return v


def is_what_if(entry: dict, config: Any) -> bool:
    """Whether catalogue ``entry`` is a cast the run did not perform: its ``what_if`` flag, or,
    in a trace written before the flag, a weight gradient that fp8sim's recorder logged with the
    output gradient's cast (format and policy), as it did for every recipe that keeps weight
    gradients in high precision."""
    if "what_if" in entry:
        if not isinstance(entry["what_if"], bool):
            raise TypeError(f"what_if {entry['what_if']!r:.40} is not true or false")
        return entry["what_if"]
    if entry.get("role") != "weight_grad" or not isinstance(config, dict):
        return False
    casts = config.get("casts") if config.get("source") == "fp8sim.training.recorder" else None
    if not isinstance(casts, dict) or not all(isinstance(casts.get(r), dict) for r in ("weight_grad", "grad_output")):
        return False
    wg, go = casts["weight_grad"], casts["grad_output"]
    return (wg.get("format"), wg.get("policy")) == (go.get("format"), go.get("policy"))


def _tensor_info(t: Any, i: int, config: Any = None) -> TensorInfo:
    """Catalogue entry ``i`` of trace.json, its fields checked (TypeError/ValueError otherwise)."""
    if not isinstance(t, dict):
        raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not an object")
    shape = _list(t["shape"], f"tensors[{i}].shape")
    if not all(type(n) is int and 0 <= n < 2**63 for n in shape):
        raise ValueError(f"tensors[{i}].shape {shape!r:.60} is not a list of non-negative ints")
    return TensorInfo(_str(t["name"], f"tensors[{i}].name"), _str(t["role"], f"tensors[{i}].role"),
                      _str(t["format"], f"tensors[{i}].format"), tuple(shape), i,
                      is_what_if(t, config))  # fmt: skip


class TraceReader:
    """Read a trace directory. Chunks are loaded lazily, one at a time.

    Attributes: ``config`` (run config), ``tensors`` (list of :class:`TensorInfo`),
    ``rounding``, ``hist_mantissa_bits``, ``meta`` (the whole trace.json).
    Bad or unreadable files raise ValueError naming the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.refresh()

    def refresh(self) -> None:
        """Re-scan: pick up chunks written since the reader was opened."""
        # chunks first, then trace.json: the writer updates trace.json before a chunk, so every
        # chunk listed here is named by the catalogue read below
        self._chunks = list_chunks(self.path)
        check_chunk_sequence(self.path, self._chunks)
        meta_path = self.path / TRACE_JSON
        try:
            meta = read_json(meta_path, layout.MAX_TRACE_JSON_BYTES, what="trace.json")
        except FileNotFoundError:
            raise ValueError(f"{self.path}: not an fp8sim trace (no trace.json)") from None
        except OSError as exc:
            raise ValueError(f"{meta_path}: unreadable trace.json ({exc.strerror or exc})") from None
        if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
            raise ValueError(f"{meta_path}: not an fp8sim trace (schema != {SCHEMA!r})")
        if meta.get("version") != VERSION:
            raise ValueError(f"{meta_path}: trace version {meta.get('version')}, expected {VERSION}")
        try:
            config = meta.get("config", {})
            rounding = meta.get("rounding", "rne")
            hist_bits = meta["hist"]["mantissa_bits"]
            if isinstance(hist_bits, bool) or not isinstance(hist_bits, int):
                raise TypeError(f"hist.mantissa_bits {hist_bits!r} is not an int")
            if not 0 <= hist_bits <= 10:  # what a writer takes (histogram.check_mantissa_bits)
                raise ValueError(f"hist.mantissa_bits {hist_bits} is outside 0..10")
            formats = [_str(f, "formats") for f in _list(meta.get("formats", []), "formats")]
            tensors = [_tensor_info(t, i, config) for i, t in enumerate(_list(meta.get("tensors", []), "tensors"))]
            check_catalogue(rounding, formats, tensors)
        except Exception as exc:  # missing keys, wrong types: one line naming the file
            raise ValueError(f"{meta_path}: corrupt trace.json: {type(exc).__name__}: {exc}") from None
        self.meta = meta
        self.trace_id = meta.get("trace_id")  # None: a trace of an older fp8sim
        if self.trace_id is not None and not isinstance(self.trace_id, str):
            raise ValueError(f"{meta_path}: corrupt trace.json: trace_id {self.trace_id!r:.40} is not a string")
        self.config = config
        self.rounding = rounding
        self.hist_mantissa_bits = hist_bits
        self.formats = formats
        self.tensors = tensors
        self._by_name = {t.name: t for t in self.tensors}
        self._cache: tuple[Path, dict[str, np.ndarray]] | None = None

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"{self.path}: no tensor {name!r} in the trace") from None

    @property
    def chunk_files(self) -> list[Path]:
        return [c[3] for c in self._chunks]

    def _load_chunk(self, path: Path) -> dict[str, np.ndarray]:
        if self._cache is not None and self._cache[0] == path:
            return self._cache[1]
        try:
            with open_regular(path) as f, np.load(f, allow_pickle=False) as z:  # a FIFO: refused
                cols = {k: z[k] for k in z.files}
        except ValueError as exc:
            if str(exc).startswith(str(path)):  # not a regular file: said as it is
                raise
            raise ValueError(f"{path}: corrupt trace chunk ({type(exc).__name__}: {exc})") from None
        except Exception as exc:  # zipfile/OSError: a corrupt chunk
            raise ValueError(f"{path}: corrupt trace chunk ({type(exc).__name__}: {exc})") from None
        check_chunk_identity(path, cols, self.path, self.trace_id)  # this trace's, not a copy's
        check_chunk_columns(path, cols)  # every column there, 1-D, of its kind, lengths agree
        check_block_columns(path, cols)
        if cols["tensor"].size and int(cols["tensor"].max()) >= len(self.tensors):
            self.refresh()  # written after we read trace.json
            if int(cols["tensor"].max()) >= len(self.tensors):
                raise ValueError(f"{path}: chunk names a tensor missing from trace.json")
        if cols["tensor"].size and int(cols["tensor"].min()) < 0:
            raise ValueError(f"{path}: corrupt trace chunk: negative tensor index")
        if cols["format"].size and (
            int(cols["format"].min()) < 0 or int(cols["format"].max()) >= len(self.formats)
        ):
            raise ValueError(
                f"{path}: corrupt trace chunk: format index outside 0..{len(self.formats) - 1}"
            )
        off = cols["hist_offsets"]
        nb = cols["hist_bins"].size
        if (
            off.size == 0 or int(off[0]) < 0 or int(off[-1]) > nb
            or cols["hist_counts"].size != nb or (np.diff(off) < 0).any()
        ):  # fmt: skip
            raise ValueError(f"{path}: corrupt trace chunk: histogram offsets out of order or range")
        m = CHUNK_RE.match(path.name)
        check_chunk_values(path, cols, int(m.group(2)), int(m.group(3)),
                           num_bins(self.hist_mantissa_bits))  # fmt: skip
        self._cache = (path, cols)
        return cols

    def steps(self) -> np.ndarray:
        """Sorted distinct steps recorded."""
        parts = [np.unique(self._load_chunk(p)["step"]) for p in self.chunk_files]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def scalars(self, name: str | None = None) -> dict[str, np.ndarray]:
        """Per-record scalar columns (:data:`SCALAR_COLUMNS`) over all chunks, in record order;
        only ``name``'s records if given. ``tensor`` is the catalogue index, ``format`` an
        index into ``self.formats``. Each tensor's counts add up to at most
        :data:`~fp8sim.trace.checks.MAX_TOTAL` (else ValueError: a damaged trace), so every sum
        of them a caller forms in int64 is exact."""
        tid = self.tensor(name).index if name is not None else None
        out: dict[str, list[np.ndarray]] = {c: [] for c in SCALAR_COLUMNS}
        for p in self.chunk_files:
            cols = self._load_chunk(p)
            sel = slice(None) if tid is None else cols["tensor"] == tid
            for c in SCALAR_COLUMNS:
                out[c].append(cols[c][sel])
        cols = {
            c: (np.concatenate(v) if v else np.zeros(0, dt))
            for (c, v), dt in zip(out.items(), COLUMN_DTYPES)
        }
        check_count_totals(self.path, cols["tensor"], cols, [t.name for t in self.tensors])
        return cols

    def _record(self, cols: dict[str, np.ndarray], i: int) -> TraceRecord:
        off = cols["hist_offsets"]
        a, b = int(off[i]), int(off[i + 1])
        zero, nan, inf = int(cols["zero"][i]), int(cols["nan"][i]), int(cols["inf"][i])
        hist = AbsHistogram(
            cols["hist_bins"][a:b], cols["hist_counts"][a:b], self.hist_mantissa_bits,
            zero=zero, nan=nan, inf=inf,
        )  # fmt: skip
        return TraceRecord(
            step=int(cols["step"][i]), name=self.tensors[int(cols["tensor"][i])].name,
            format=self.formats[int(cols["format"][i])], numel=int(cols["numel"][i]),
            zero=zero, nan=nan, inf=inf, amax=float(cols["amax"][i]),
            scale=float(cols["scale"][i]), overflow=int(cols["overflow"][i]),
            underflow=int(cols["underflow"][i]), hist=hist, blocks=block_record(cols, i),
        )  # fmt: skip

    def records(self, name: str | None = None) -> Iterator[TraceRecord]:
        """Every record with its histogram, in write order (steps ascending); chunk by chunk."""
        tid = self.tensor(name).index if name is not None else None
        for p in self.chunk_files:
            cols = self._load_chunk(p)
            idx = range(cols["step"].size) if tid is None else np.flatnonzero(cols["tensor"] == tid)
            for i in idx:
                yield self._record(cols, int(i))

    def record(self, step: int, name: str) -> TraceRecord:
        """The record of ``name`` at ``step``."""
        tid = self.tensor(name).index
        for _, first, last, p in self._chunks:
            if first <= step <= last:
                cols = self._load_chunk(p)
                idx = np.flatnonzero((cols["step"] == step) & (cols["tensor"] == tid))
                if idx.size:
                    return self._record(cols, int(idx[0]))
        raise ValueError(f"{self.path}: no record of {name!r} at step {step}")

    def histogram(self, step: int, name: str) -> AbsHistogram:
        """The |x| histogram of ``name`` at ``step``."""
        return self.record(step, name).hist

    def saved_tensors(self) -> list[tuple[int, str]]:
        """(step, name) of every full tensor saved, sorted."""
        d = self.path / TENSOR_DIR
        out = []
        if d.is_dir():
            for f in d.iterdir():
                m = TENSOR_RE.match(f.name)
                if m and int(m.group(2)) < len(self.tensors):
                    out.append((int(m.group(1)), self.tensors[int(m.group(2))].name))
        return sorted(out)

    def tensor_file(self, step: int, name: str) -> Path:
        """Path of a saved tensor's safetensors file."""
        p = self.path / TENSOR_DIR / tensor_file_name(step, self.tensor(name).index)
        if not os.path.lexists(p):
            raise ValueError(f"{self.path}: no saved tensor {name!r} at step {step}")
        try:
            require_regular_file(p)  # a FIFO: refused by name, never opened
        except FileNotFoundError:  # a broken link
            raise ValueError(f"{p}: a link to nothing (saved tensor {name!r} at step {step})") from None
        return p

    def load_tensor(self, step: int, name: str) -> Any:
        """A saved tensor as a CPU torch tensor (its recorded dtype)."""
        from safetensors.torch import load_file

        p = self.tensor_file(step, name)
        try:
            return load_file(str(p))[name]
        except Exception as exc:
            raise ValueError(f"{p}: unreadable saved tensor ({exc})") from None
