"""A run's record directory (``record/rank0``, ``record/rank1``, ...) as one trace: ``analyze``
and ``replay`` merge its rank traces (:func:`fp8sim.trace.merge.merge_rank_traces`) into a
temporary trace, removed when they are done, and show the run directory's path for it."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

from fp8sim.trace.merge import merge_rank_traces, rank_trace_dirs

__all__ = ["merged_runs"]


@contextmanager
def merged_runs(inputs: Any, on_error: Any = None) -> Iterator[tuple[Any, dict[str, str], list[dict]]]:
    """``(inputs, shown, notes)``: ``inputs`` (one input or a list) with every run record
    directory replaced by the path of its merged trace; ``shown`` maps each such path back to
    the directory given; ``notes`` says what was merged. The merged traces exist inside the
    ``with`` block only. A run that cannot be merged raises ValueError, or, with
    ``on_error(path, exc)``, is handed to it and left out."""
    single = not isinstance(inputs, (list, tuple))
    given = [inputs] if single else list(inputs)
    runs = [(k, x) for k, x in enumerate(given)
            if isinstance(x, (str, os.PathLike)) and rank_trace_dirs(x) is not None]  # fmt: skip
    if not runs:
        yield inputs, {}, []
        return
    with tempfile.TemporaryDirectory(prefix="fp8sim-merged-") as tmp:
        shown, notes = {}, []
        dropped = []
        for j, (k, x) in enumerate(runs):
            ranks = len(rank_trace_dirs(x))
            try:
                merged = str(merge_rank_traces(x, os.path.join(tmp, f"run{j}")))
            except ValueError as exc:
                if on_error is None:
                    raise
                on_error(os.fspath(x), exc)
                dropped.append(k)
                continue
            shown[merged] = os.fspath(x)
            given[k] = merged
            notes.append({"file": os.fspath(x), "name": None,
                          "note": f"merged {ranks} rank traces (rank0..rank{ranks - 1}): partitioned tensors "
                                  "summed, replicated ones (weights) checked equal and taken once"})  # fmt: skip
        given = [x for k, x in enumerate(given) if k not in dropped]
        yield (given[0] if single and given else given), shown, notes
