"""One trace per run: merge the per-rank traces of a multi-rank run (``record/rank0``,
``record/rank1``, ...) by each tensor's placement.

* **partitioned** (each rank holds a different part of the tensor: activations and output
  gradients of a data-parallel run, the per-rank weight gradients before their reduction):
  counts (``numel``, ``zero``, ``nan``, ``inf``, ``overflow``, ``underflow``) and histogram bins
  summed, ``amax`` the largest (NaN if a rank's is NaN) -- exactly the statistics of the
  concatenated tensors; a saved full tensor is the ranks' tensors concatenated along dim 0, the
  catalogue shape's first dimension the sum;
* **replicated** (every rank holds the same tensor: weights under data parallelism, statistics
  already reduced over the ranks): its statistics checked equal on every rank (histogram, counts
  of zero/NaN/inf, amax; a difference is an error naming the tensor, step and rank) and taken
  once, with rank 0's scale and the overflow/underflow of rank 0's cast. An empty record (an
  idle MoE expert on that rank: nothing cast) is left out of the check, and the first rank
  that cast the tensor gives the record.

The placement is the catalogue entry's ``placement`` where a recorder wrote one, else by role:
``weight`` replicated, every other role partitioned. Scales stay per rank: the merged record's
``scale`` is that of the rank holding the largest amax (the cast that decides an overflow event),
and every rank's scale is kept in ``rank_scales.npz`` (:func:`read_rank_scales`).

Where the hooks for sharded recording go: a recorder that reduces a sharded tensor's statistics
over its group writes the same record on each rank with ``placement: "replicated"``; one that
records shards with their mesh coordinates writes ``placement: "partitioned"``.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from fp8sim.trace.reader import TraceReader, TraceRecord
from fp8sim.trace.statistics import HistogramCounts
from fp8sim.trace.writer import TraceWriter

__all__ = ["PLACEMENTS", "rank_trace_dirs", "merge_rank_traces", "read_rank_scales", "placement_of"]

PLACEMENTS = ("partitioned", "replicated")
RANK_SCALES = "rank_scales.npz"
_RANK_DIR = re.compile(r"^rank(\d+)$")


def rank_trace_dirs(path: str | os.PathLike) -> list[Path] | None:
    """The rank traces of a run's record directory, by rank (``rank0``, ``rank1``, ...), or None
    when ``path`` is not one (a trace itself, or a folder without ``rankN`` traces). Ranks must
    run 0..N-1 without a gap (ValueError otherwise: a lost rank would bias every sum)."""
    p = Path(path)
    if not p.is_dir() or (p / "trace.json").exists():  # a trace (or a damaged one) itself
        return None
    found = {}
    for d in p.iterdir():
        m = _RANK_DIR.match(d.name)
        if m and d.is_dir() and (d / "trace.json").is_file():  # a damaged one: refused when read
            found[int(m.group(1))] = d
    if not found:
        return None
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ValueError(f"{p}: rank traces {', '.join(f'rank{r}' for r in missing)} missing "
                         f"(found {', '.join(f'rank{r}' for r in sorted(found))})")  # fmt: skip
    return [found[r] for r in sorted(found)]


def placement_of(reader: TraceReader, name: str) -> str:
    """A tensor's placement: its catalogue entry's ``placement``, else by role (see the module
    docstring)."""
    t = reader.tensor(name)
    declared = reader.meta["tensors"][t.index].get("placement")
    if declared is not None:
        if declared not in PLACEMENTS:
            raise ValueError(f"{reader.path}: tensor {name!r} has placement {declared!r}, "
                             f"not one of {', '.join(PLACEMENTS)}")  # fmt: skip
        return declared
    return "replicated" if t.role == "weight" else "partitioned"


def _by_step(reader: TraceReader) -> dict[tuple[int, str], list[TraceRecord]]:
    out: dict[tuple[int, str], list[TraceRecord]] = {}
    for rec in reader.records():
        out.setdefault((rec.step, rec.name), []).append(rec)
    return out


def _merged_counts(recs: list[TraceRecord]) -> tuple[HistogramCounts, float, float]:
    """(summed statistics, amax, scale of the rank holding the largest amax)."""
    bins = np.concatenate([r.hist.bins for r in recs]).astype(np.int64)
    counts = np.concatenate([r.hist.counts for r in recs])
    ids, inv = np.unique(bins, return_inverse=True)
    summed = np.zeros(ids.size, np.int64)
    np.add.at(summed, inv.reshape(-1), counts)
    amaxes = [r.amax for r in recs]
    amax = math.nan if any(math.isnan(a) for a in amaxes) else max(amaxes)
    top = max(range(len(recs)), key=lambda i: (not math.isnan(amaxes[i]), amaxes[i] if not math.isnan(amaxes[i]) else 0))
    hc = HistogramCounts(ids.astype(np.uint32), summed, sum(r.numel for r in recs), sum(r.zero for r in recs),
                         sum(r.nan for r in recs), sum(r.inf for r in recs), sum(r.overflow for r in recs),
                         sum(r.underflow for r in recs), 0.0)  # fmt: skip
    return hc, amax, recs[top].scale


def _same_tensor(a: TraceRecord, b: TraceRecord) -> bool:
    """Whether two records are of the same tensor: everything but the scale and the counts of
    the cast it made (ranks may cast a replicated tensor with their own scales)."""
    fields = ("numel", "zero", "nan", "inf", "format")
    same_amax = a.amax == b.amax or (math.isnan(a.amax) and math.isnan(b.amax))
    return (same_amax and all(getattr(a, f) == getattr(b, f) for f in fields)
            and np.array_equal(a.hist.bins, b.hist.bins) and np.array_equal(a.hist.counts, b.hist.counts))


def _check_alike(readers: list[TraceReader], dirs: list[Path]) -> None:
    r0 = readers[0]
    for d, r in zip(dirs[1:], readers[1:]):
        if (r.rounding, r.hist_mantissa_bits) != (r0.rounding, r0.hist_mantissa_bits):
            raise ValueError(f"{d}: rounding / histogram width differ from {dirs[0]}'s")
        ours = {(t.name, t.role, t.format) for t in r.tensors}
        theirs = {(t.name, t.role, t.format) for t in r0.tensors}
        if ours != theirs:
            diff = sorted(n for n, _, _ in ours ^ theirs)
            raise ValueError(f"{d}: its tensors differ from {dirs[0]}'s ({', '.join(diff[:4])})")


def merge_rank_traces(run_dir: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Write the merged trace of the rank traces in ``run_dir`` (see the module docstring) to
    the new directory ``dest`` (refused if anything, a link included, is there; its folder
    must exist); returns ``dest``. The merged trace is built next to ``dest`` and moved into
    place whole: ``dest`` is claimed first (an empty directory made there), so a ``dest`` made
    meanwhile by another process is never replaced, and an interrupted merge leaves nothing.

    Raises ValueError when ``run_dir`` holds no rank traces, when ``dest`` exists, lies inside
    one of the rank traces or is named like one (``run_dir/rankN``: the run would gain a rank),
    when the ranks disagree on what they recorded (tensors, steps, records per step, formats) or
    a replicated tensor differs between ranks."""
    dirs = rank_trace_dirs(run_dir)
    if dirs is None:
        raise ValueError(f"{run_dir}: no rank traces (rank0/, rank1/, ... each an fp8sim trace)")
    dest = Path(dest)
    _check_dest(Path(run_dir), dest)
    readers = [TraceReader(d) for d in dirs]
    _check_alike(readers, dirs)
    r0 = readers[0]
    recs = [_by_step(r) for r in readers]
    for d, rr in zip(dirs[1:], recs[1:]):
        if set(rr) != set(recs[0]):
            diff = sorted(set(rr) ^ set(recs[0]))[0]
            raise ValueError(f"{d}: records differ from {dirs[0]}'s (tensor {diff[1]!r} at step {diff[0]} "
                             "is in one of them only)")  # fmt: skip
    place = {t.name: placement_of(r0, t.name) for t in r0.tensors}
    config = {k: v for k, v in r0.config.items() if k not in ("rank", "world")}
    config["merged"] = {"from": str(run_dir), "ranks": len(dirs)}
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        w = TraceWriter(tmp / "trace", config, overwrite=True, chunk_steps=int(r0.meta["chunk_steps"]),
                        hist_mantissa_bits=r0.hist_mantissa_bits, rounding=r0.rounding)  # fmt: skip
        for t in r0.tensors:
            shape = list(t.shape)
            if place[t.name] == "partitioned" and shape:
                shape[0] = sum(r.tensor(t.name).shape[0] if r.tensor(t.name).shape else 0 for r in readers)
            w.add_tensor(t.name, t.role, t.format, shape, placement=place[t.name], what_if=t.what_if)
        order = [key for rec in r0.records() for key in [(rec.step, rec.name)]]
        seen: dict[tuple[int, str], int] = {}
        rows_scales, rows_step, rows_tensor = [], [], []
        saved = set(r0.saved_tensors())
        for key in order:
            i = seen.get(key, 0)
            seen[key] = i + 1
            step, name = key
            per_rank = []
            for d, rr in zip(dirs, recs):
                if len(rr[key]) != len(recs[0][key]):
                    raise ValueError(f"{d}: {len(rr[key])} records of {name!r} at step {step}, rank 0 has "
                                     f"{len(recs[0][key])}")  # fmt: skip
                per_rank.append(rr[key][i])
            if place[name] == "replicated":
                # an idle MoE expert's empty record (no token on that rank, nothing cast) says
                # nothing about the replicated tensor: the ranks that cast it are compared
                cast = [(r, rec) for r, rec in enumerate(per_rank) if rec.numel > 0] or [(0, per_rank[0])]
                r0_, a = cast[0]
                for r, rec in cast[1:]:
                    if not _same_tensor(a, rec):
                        raise ValueError(f"{run_dir}: {name!r} at step {step} is replicated but rank {r}'s "
                                         f"statistics differ from rank {r0_}'s (amax {rec.amax} vs "
                                         f"{a.amax}, numel {rec.numel} vs {a.numel})")
                hc = HistogramCounts(a.hist.bins, a.hist.counts, a.numel, a.zero, a.nan, a.inf, a.overflow,
                                     a.underflow, 0.0)  # fmt: skip
                amax, scale = a.amax, a.scale
            else:
                hc, amax, scale = _merged_counts(per_rank)
            w.record_counts(step, name, hc, scale=scale, amax=amax, fmt=per_rank[0].format,
                            overflow=hc.overflow, underflow=hc.underflow)  # fmt: skip
            rows_step.append(step)
            rows_tensor.append(r0.tensor(name).index)
            rows_scales.append([rec.scale for rec in per_rank])
            if i == 0 and key in saved:
                w.save_tensor(step, name, _merged_tensor(readers, dirs, step, name, place[name]))
        w.close()
        np.savez(tmp / "trace" / RANK_SCALES, step=np.asarray(rows_step, np.int64),
                 tensor=np.asarray(rows_tensor, np.int64),
                 scales=np.asarray(rows_scales, np.float64).reshape(len(rows_step), len(dirs)))  # fmt: skip
        try:
            os.mkdir(dest)  # the claim: fails if dest appeared meanwhile
        except FileExistsError:
            raise ValueError(f"{dest}: exists; the merged trace goes to a new directory") from None
        try:
            os.replace(tmp / "trace", dest)  # over our own empty directory
        except BaseException:
            os.rmdir(dest)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _check_dest(run_dir: Path, dest: Path) -> None:
    """ValueError unless ``dest`` is a new path whose folder exists, outside the rank traces."""
    if os.path.lexists(dest):
        raise ValueError(f"{dest}: exists; the merged trace goes to a new directory")
    parent = dest.parent
    if not parent.is_dir():
        raise ValueError(f"{dest}: its folder {parent} does not exist")
    inside = Path(os.path.realpath(parent)) / dest.name
    run = Path(os.path.realpath(run_dir))
    if inside.is_relative_to(run):
        first = inside.relative_to(run).parts[0]
        if _RANK_DIR.match(first):
            raise ValueError(f"{dest}: inside the run's rank traces (or named like one, {first}); "
                             "the merged trace goes outside them")  # fmt: skip


def _merged_tensor(readers, dirs, step: int, name: str, placement: str):
    import torch

    parts = []
    for d, r in zip(dirs, readers):
        try:
            parts.append(r.load_tensor(step, name))
        except ValueError:
            raise ValueError(f"{d}: no saved {name!r} at step {step}, which rank 0 saved") from None
    if placement == "replicated":
        for d, p in zip(dirs[1:], parts[1:]):
            if not torch.equal(p, parts[0]):
                raise ValueError(f"{d}: saved {name!r} at step {step} is replicated but differs from rank 0's")
        return parts[0]
    return torch.cat([p.reshape(-1) if p.dim() == 0 else p for p in parts], dim=0)


def read_rank_scales(path: str | os.PathLike) -> dict[tuple[int, str], np.ndarray] | None:
    """Every rank's scale per (step, tensor) of a merged trace (first record of each), or None
    for a trace that is not a merge."""
    p = Path(path) / RANK_SCALES
    if not p.is_file():
        return None
    names = [t.name for t in TraceReader(path).tensors]
    with np.load(p, allow_pickle=False) as z:
        out: dict[tuple[int, str], np.ndarray] = {}
        for s, t, sc in zip(z["step"], z["tensor"], z["scales"]):
            out.setdefault((int(s), names[int(t)]), sc)
    return out
