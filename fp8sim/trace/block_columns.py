"""How a chunk stores the block statistics of its records (:mod:`fp8sim.trace.block_stats`):
optional columns, present in a chunk when one of its records has them.

Per record (``blk_kind`` 0: none; else :data:`~fp8sim.trace.block_stats.KINDS`): the scalar
columns :data:`SCALARS`, the scale-code histogram as a sparse ragged triple
(``blk_code_offsets`` into ``blk_codes`` / ``blk_code_counts``), and, for MX casts, the
block-relative |x| histogram (``blk_rel_offsets`` into ``blk_rel_bins`` / ``blk_rel_counts``; its
``numel`` and zero count in ``blk_rel_numel`` / ``blk_rel_zero``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fp8sim.trace.block_stats import KINDS, BlockStats
from fp8sim.trace.statistics import HistogramCounts

__all__ = ["SCALARS", "RAGGED", "block_columns", "block_record", "keep_block_rows", "check_block_columns",
           "is_block_column"]

#: scalar columns: name -> (BlockStats attribute or rel field, dtype)
SCALARS = {
    "blk_kind": np.int8, "blk_blocks": np.int64, "blk_scale_min": np.float64, "blk_scale_max": np.float64,
    "blk_scale_std": np.float64, "blk_clipped": np.int64, "blk_scale_underflow": np.int64,
    "blk_scale_saturated": np.int64, "blk_nan_blocks": np.int64, "blk_rel_unsafe": np.int64,
    "blk_rel_numel": np.int64, "blk_rel_zero": np.int64,
}  # fmt: skip
#: ragged columns: (offsets, values, counts)
RAGGED = (("blk_code_offsets", "blk_codes", "blk_code_counts"), ("blk_rel_offsets", "blk_rel_bins", "blk_rel_counts"))
_KIND_NAMES = {v: k for k, v in KINDS.items()}


def _scalars(b: BlockStats | None) -> list:
    if b is None:
        return [0] + [0] * (len(SCALARS) - 1)
    rel = b.rel
    return [KINDS[b.kind], b.blocks, b.scale_min, b.scale_max, b.scale_std, b.clipped, b.scale_underflow,
            b.scale_saturated, b.nan_blocks, b.rel_unsafe, rel.numel if rel else 0, rel.zero if rel else 0]


def block_columns(blocks: list[BlockStats | None]) -> dict[str, np.ndarray]:
    """The block columns of a chunk's records (``blocks``: one entry per record, in order);
    empty when no record has block statistics."""
    if all(b is None for b in blocks):
        return {}
    vals = [_scalars(b) for b in blocks]
    cols = {c: np.array([v[i] for v in vals], dtype=dt) for i, (c, dt) in enumerate(SCALARS.items())}
    parts = (
        [(b.codes, b.counts) if b is not None else (np.zeros(0, np.uint8), np.zeros(0, np.int64)) for b in blocks],
        [(b.rel.bins, b.rel.counts) if b is not None and b.rel is not None
         else (np.zeros(0, np.uint32), np.zeros(0, np.int64)) for b in blocks],
    )  # fmt: skip
    for (off, key, cnt), items in zip(RAGGED, parts):
        sizes = np.array([k.size for k, _ in items], dtype=np.int64)
        cols[off] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        cols[key] = np.concatenate([k for k, _ in items]).astype(np.int64)
        cols[cnt] = np.concatenate([c for _, c in items]).astype(np.int64)
    return cols


def block_record(cols: dict[str, np.ndarray], i: int) -> BlockStats | None:
    """The block statistics of row ``i`` of a chunk, or None."""
    if "blk_kind" not in cols or int(cols["blk_kind"][i]) == 0:
        return None
    g = {c: cols[c][i] for c in SCALARS}

    def ragged(n: int) -> tuple[np.ndarray, np.ndarray]:
        off, key, cnt = RAGGED[n]
        a, b = int(cols[off][i]), int(cols[off][i + 1])
        return cols[key][a:b], cols[cnt][a:b]

    codes, counts = ragged(0)
    bins, rcounts = ragged(1)
    rel = None
    if int(g["blk_rel_numel"]) or bins.size:
        rel = HistogramCounts(bins.astype(np.uint32), rcounts, int(g["blk_rel_numel"]), int(g["blk_rel_zero"]), 0, 0,
                              0, 0, 0.0)  # fmt: skip
    return BlockStats(_KIND_NAMES[int(g["blk_kind"])], int(g["blk_blocks"]), codes.astype(np.uint8), counts,
                      float(g["blk_scale_min"]), float(g["blk_scale_max"]), float(g["blk_scale_std"]),
                      int(g["blk_clipped"]), int(g["blk_scale_underflow"]), int(g["blk_scale_saturated"]),
                      int(g["blk_nan_blocks"]), rel, int(g["blk_rel_unsafe"]))  # fmt: skip


def keep_block_rows(cols: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The block columns of the rows where ``keep`` is True (ragged columns re-packed); empty
    when the chunk has none."""
    if "blk_kind" not in cols:
        return {}
    out = {c: cols[c][keep] for c in SCALARS}
    rows = np.flatnonzero(keep)
    for off, key, cnt in RAGGED:
        o = cols[off]
        pieces = [slice(int(o[i]), int(o[i + 1])) for i in rows]
        sizes = np.array([p.stop - p.start for p in pieces], dtype=np.int64)
        out[off] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        out[key] = np.concatenate([cols[key][p] for p in pieces] + [cols[key][:0]])
        out[cnt] = np.concatenate([cols[cnt][p] for p in pieces] + [cols[cnt][:0]])
    return out


def is_block_column(name: str) -> bool:
    return name.startswith("blk_")


def check_block_columns(path: Path, cols: dict[str, Any]) -> None:
    """ValueError ``"<path>: corrupt trace chunk: ..."`` unless a chunk's block columns (if any)
    are all there, one-dimensional, as long as the records, with offsets in order and range."""
    if not any(is_block_column(c) for c in cols):
        return
    n = cols["step"].size
    missing = [c for c in (*SCALARS, *(c for r in RAGGED for c in r)) if c not in cols]
    if missing:
        raise ValueError(f"{path}: corrupt trace chunk: lacks block columns {missing}")
    for c in SCALARS:
        if cols[c].ndim != 1 or cols[c].size != n:
            raise ValueError(f"{path}: corrupt trace chunk: block column {c} has the wrong shape")
    for off, key, cnt in RAGGED:
        o = cols[off]
        if (o.ndim != 1 or o.size != n + 1 or (o.size and int(o[0]) != 0) or (np.diff(o) < 0).any()
                or int(o[-1]) != cols[key].size or cols[key].size != cols[cnt].size):
            raise ValueError(f"{path}: corrupt trace chunk: block column {off} out of order or range")
    if (cols["blk_kind"] < 0).any() or (cols["blk_kind"] > max(KINDS.values())).any():
        raise ValueError(f"{path}: corrupt trace chunk: unknown block kind")
