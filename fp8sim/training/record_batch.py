"""One recorded step's records on their way to the trace (:class:`StepBatch`, used by
:mod:`fp8sim.training.recorder`).

What a record holds when the hooks hand it over: its statistics, computed where the tensor lives
(:mod:`fp8sim.trace.statistics`) -- for a host tensor the host result, for an accelerator's tensor
one small int64 tensor on that device. When the step is complete (:meth:`StepBatch.finish`) the
device results of the whole step are concatenated and copied to the host in one non-blocking
copy (pinned memory, a CUDA event marks its end); the write job (:meth:`StepBatch.write`), run by
the background writer, waits for that event, unpacks the rows and writes them. The training loop
never waits on the copy or the disk. Full tensors saved at the step travel the same way (a host
copy taken when recorded: a weight is updated in place afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fp8sim.formats import FloatFormat
from fp8sim.trace.statistics import HistogramCounts, unpack_statistics

__all__ = ["StepBatch", "seen_amax"]


@dataclass
class _Record:
    name: str
    role: str
    fmt: FloatFormat
    shape: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    scale: float
    stats: HistogramCounts | None  # host statistics, or None: in the batch's device rows
    row: tuple[int, int] | None = None  # (offset, length) of its device statistics in the batch
    #: measured counts replacing the computed ones: ints, or ("device", index into the row)
    overflow: Any = None
    underflow: Any = None
    amax: float | None = None  # the amax the policy saw, where it differs from the statistics'
    saved: torch.Tensor | None = None
    blocks: Any = None  # a block-scaled cast's block statistics (fp8sim.trace.block_stats)


def seen_amax(r: HistogramCounts, dtype: torch.dtype) -> float:
    """The amax a scaling policy sees, ``float(float32(max |x|))``: NaN if ``x`` holds a NaN,
    inf if it holds an inf (``x.float().abs().amax()``), from the statistics' counts."""
    if r.nan:
        return float("nan")
    if r.inf:
        return float("inf")
    with np.errstate(over="ignore"):
        return float(np.float32(r.amax)) if dtype == torch.float64 else r.amax


@dataclass
class StepBatch:
    """The records of one step (see the module docstring). ``declare``: catalogue entries
    (name, role, format name, shape) to add before the records, in order."""

    step: int
    records: list[_Record] = field(default_factory=list)
    #: (name, role, format, shape, what_if) of the tensors first seen this step
    declare: list[tuple[str, str, str, tuple[int, ...], bool]] = field(default_factory=list)
    _parts: list[torch.Tensor] = field(default_factory=list)
    _length: int = 0
    _host: torch.Tensor | None = None
    _event: Any = None

    def add(self, name: str, role: str, fmt: FloatFormat, x: torch.Tensor, scale: float,
            stats: HistogramCounts | torch.Tensor, *, save: bool = False, blocks: Any = None,
            **measured: Any) -> _Record:  # fmt: skip
        """Add ``x``'s record. ``stats``: host statistics, or a
        :func:`~fp8sim.trace.statistics.device_statistics` tensor followed by 0-d int64 device
        tensors of ``measured`` counts (``overflow=``, ``underflow=``: ints or device tensors)."""
        rec = _Record(name, role, fmt, tuple(x.shape), x.numel(), x.dtype, scale, None, blocks=blocks)
        if isinstance(stats, HistogramCounts):
            rec.stats = stats
        else:
            rec.row = (self._length, stats.numel())
            self._add_part(stats)
        for key, v in measured.items():
            if isinstance(v, torch.Tensor):
                setattr(rec, key, ("device", self._length))
                self._add_part(v.reshape(1).to(torch.int64))
            else:
                setattr(rec, key, v)
        if save:
            rec.saved = x.detach().to("cpu", copy=True, non_blocking=x.device.type == "cuda")
        self.records.append(rec)
        return rec

    def _add_part(self, t: torch.Tensor) -> None:
        self._parts.append(t)
        self._length += t.numel()

    def finish(self) -> None:
        """The step is complete: start the copy of its device statistics to the host."""
        if not self._parts:
            return
        rows = torch.cat(self._parts)
        self._parts = []
        if rows.device.type == "cuda":
            self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self._host.copy_(rows, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = rows.cpu()

    def host_stats(self, rec: _Record, k: int) -> HistogramCounts:
        """``rec``'s statistics on the host (waits for the batch's copy)."""
        if rec.stats is None:
            if self._event is not None:
                self._event.synchronize()
            off, n = rec.row
            rec.stats = unpack_statistics(self._host[off:off + n].numpy(), rec.numel, k)
        return rec.stats

    def _measured(self, v: Any) -> int | None:
        if isinstance(v, tuple):
            return int(self._host[v[1]])
        return v

    def write(self, writer: Any) -> None:
        """Write the step into ``writer`` (a :class:`~fp8sim.trace.TraceWriter`); the background
        writer's job."""
        for name, role, fmt, shape, what_if in self.declare:
            writer.add_tensor(name, role, fmt, shape, what_if=what_if)
        k = writer.hist_mantissa_bits
        for rec in self.records:
            r = self.host_stats(rec, k)
            amax = rec.amax if rec.amax is not None else seen_amax(r, rec.dtype)
            writer.record_counts(self.step, rec.name, r, scale=rec.scale, amax=amax, fmt=rec.fmt,
                                 overflow=self._measured(rec.overflow),
                                 underflow=self._measured(rec.underflow), blocks=rec.blocks)  # fmt: skip
            if rec.saved is not None:
                writer.save_tensor(self.step, rec.name, rec.saved)

