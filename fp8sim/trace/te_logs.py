"""Transformer Engine's debug logs: the statistics that TE 2.x's debug API (``nvdlfw_inspect``
with the ``LogTensorStats`` / ``LogFp8TensorStats`` features) writes, read as numbers with their
precision.

The log: one file per rank, ``nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-R.log``
(optionally ``nvdlfw_inspect_<timestamp>_globalrank-R.log``), one line per statistic, written by
nvdlfw-inspect's ``MetricLogger.log_scalar``::

    2026-03-01 12:00:00,123 - INFO - <layer>_<tensor>_<stat> \\t\\t\\t\\t iteration=000012 \\t\\t\\t\\t value=0.0123

``<tensor>`` is one of TE's tensor names (:data:`TE_TENSORS`: ``activation``, ``weight``,
``gradient``, ``output``, ``wgrad``, ``dgrad``); ``<stat>`` a plain statistic (``min``, ``max``,
``mean``, ``std``, ``l1_norm``, ``l2_norm``, ``cur_amax``, ``dynamic_range``, ...) or a recipe's
(``<recipe>_underflows%``, ``<recipe>_underflows_num`` -- FP8 codes equal to 0, true zeros
included --, ``<recipe>_scale_inv_min`` / ``_max``, ``<recipe>_mse``, and
``fp8_delayed_scaling_overflows%`` / ``_num``), each optionally ``_columnwise``.

Two rules of the format decide how the numbers are read:

* **4 decimals**: a value ``v`` stands for the interval ``[v - 0.00005, v + 0.00005]``
  (:attr:`TeStat.lo` / :attr:`TeStat.hi`); ``0.0000`` means "below the log's precision", not 0.
* **one reduction group is already combined**: TE gathers a statistic over its reduction group
  before logging, and every rank of the group logs the same combined value. So rank files are
  never summed: where every rank logged the same value it is taken once; where ranks differ
  (``skip_reduction``, or groups that are not the whole world) each rank's value is kept
  (:attr:`TeStat.per_rank`) and the statistic is marked ``ranks_differ``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fp8sim.input_files import open_regular

__all__ = ["TE_TENSORS", "TE_RECIPES", "TeStat", "TeDebugLog", "read_te_logs", "te_log_files", "split_name"]

#: the tensor names TE's debug API logs
TE_TENSORS = ("activation", "weight", "gradient", "output", "wgrad", "dgrad")
#: the recipe prefixes of LogFp8TensorStats' statistics
TE_RECIPES = ("fp8_delayed_scaling", "fp8_current_scaling", "fp8_block_scaling", "mxfp8", "nvfp4")
#: half a unit in the last place of a logged value (``{:.4f}``)
HALF_ULP = 0.00005
_LINE = re.compile(r" - (?P<level>[A-Z]+) - (?P<name>\S+)\s+iteration=(?P<it>\d+)\s+value=(?P<value>\S+)\s*$")
_FILE = re.compile(r"^nvdlfw_inspect(?:_\d{8}_\d{6})?_globalrank-(\d+)\.log$")
_RECIPE_STAT = re.compile(r"^(?:(?P<recipe>" + "|".join(TE_RECIPES) + r")_)?(?P<stat>underflows%|underflows_num|"
                          r"scale_inv_min|scale_inv_max|mse|total_square_error|overflows%|overflows_num)"
                          r"(?P<col>_columnwise)?$")  # fmt: skip


def split_name(name: str) -> tuple[str, str, str] | None:
    """``(layer, tensor, stat)`` of a logged name ``<layer>_<tensor>_<stat>``, or None when no
    TE tensor name separates a layer from a statistic."""
    best = None  # the rightmost tensor name with a layer before it and a statistic after it
    for tensor in TE_TENSORS:
        key = f"_{tensor}_"
        i = name.rfind(key)
        if i > 0 and name[i + len(key):] and (best is None or i > best[0]):
            best = (i, tensor)
    if best is None:
        return None
    i, tensor = best
    return name[:i], tensor, name[i + len(tensor) + 2:]


@dataclass
class TeStat:
    """One statistic of one tensor at one iteration: ``value`` as logged (over every rank that
    logged the same; with ``ranks_differ``, rank 0's or the first rank's), its precision
    interval ``lo``..``hi``, ``per_rank`` values, and the ranks that logged it."""

    layer: str
    tensor: str
    stat: str
    iteration: int
    value: float
    ranks: tuple[int, ...]
    per_rank: dict[int, float] = field(default_factory=dict)

    @property
    def ranks_differ(self) -> bool:
        return len(set(self.per_rank.values())) > 1

    @property
    def lo(self) -> float:
        """The smallest value the logged text can stand for (>= 0 for a share or count)."""
        low = self.value - HALF_ULP
        return max(0.0, low) if self.nonnegative else low

    @property
    def hi(self) -> float:
        return self.value + HALF_ULP

    @property
    def nonnegative(self) -> bool:
        m = _RECIPE_STAT.match(self.stat)
        return bool(m) or self.stat in ("numel", "cur_amax", "l1_norm", "l2_norm", "std", "variance")

    @property
    def below_precision(self) -> bool:
        """``0.0000`` logged: the value is below 0.00005, not necessarily 0."""
        return self.value == 0.0


@dataclass
class TeDebugLog:
    """The statistics of one run's TE debug logs (see the module docstring): ``stats`` keyed by
    (layer, tensor, stat, iteration); ``files`` read, by rank; ``skipped`` lines that are not
    statistics (count)."""

    path: str
    files: dict[int, str]
    stats: dict[tuple[str, str, str, int], TeStat]
    skipped: int = 0

    def tensors(self) -> list[tuple[str, str]]:
        """(layer, tensor) pairs, in first-logged order."""
        return list(dict.fromkeys((k[0], k[1]) for k in self.stats))

    def series(self, layer: str, tensor: str, stat: str) -> list[TeStat]:
        """One statistic of one tensor over the iterations, ascending."""
        out = [s for (l, t, st, _), s in self.stats.items() if (l, t, st) == (layer, tensor, stat)]
        return sorted(out, key=lambda s: s.iteration)

    def stat_names(self, layer: str, tensor: str) -> list[str]:
        return list(dict.fromkeys(k[2] for k in self.stats if k[:2] == (layer, tensor)))


def te_log_files(path: str | os.PathLike) -> dict[int, Path]:
    """The per-rank statistics logs under ``path`` (the log root, its
    ``nvdlfw_inspect_statistics_logs`` folder, or one log file), by rank; empty if none."""
    p = Path(path)
    if p.is_file():
        m = _FILE.match(p.name)
        return {int(m.group(1)): p} if m else {}
    if (p / "nvdlfw_inspect_statistics_logs").is_dir():
        p = p / "nvdlfw_inspect_statistics_logs"
    if not p.is_dir():
        return {}
    out: dict[int, Path] = {}
    for f in sorted(p.iterdir()):
        m = _FILE.match(f.name)
        if m:
            rank = int(m.group(1))
            if rank in out:
                raise ValueError(f"{p}: two statistics logs of rank {rank} ({out[rank].name}, {f.name}): "
                                 "give the folder of one run")  # fmt: skip
            out[rank] = f
    return out


def read_te_logs(path: str | os.PathLike) -> TeDebugLog:
    """Read the TE debug statistics logs under ``path`` (see :func:`te_log_files`); ValueError
    naming the path when there are none or a line names a statistic twice in one file."""
    files = te_log_files(path)
    if not files:
        raise ValueError(f"{path}: no Transformer Engine debug statistics logs "
                         "(nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-N.log)")  # fmt: skip
    per_rank: dict[tuple[str, str, str, int], dict[int, float]] = {}
    skipped = 0
    for rank, f in sorted(files.items()):
        seen: set = set()
        with open_regular(f) as fh:
            for raw in fh:
                m = _LINE.search(raw.decode("utf-8", errors="replace"))
                parts = split_name(m.group("name")) if m else None
                if parts is None:
                    skipped += 1
                    continue
                try:
                    value = float(m.group("value"))
                except ValueError:
                    skipped += 1
                    continue
                key = (*parts, int(m.group("it")))
                if key in seen:
                    raise ValueError(f"{f}: {m.group('name')} at iteration {key[3]} logged twice")
                seen.add(key)
                per_rank.setdefault(key, {})[rank] = value
    stats = {}
    for key, vals in per_rank.items():
        first = min(vals)
        stats[key] = TeStat(*key, vals[first], tuple(sorted(vals)), dict(sorted(vals.items())))
    return TeDebugLog(str(path), {r: str(f) for r, f in files.items()}, stats, skipped)
