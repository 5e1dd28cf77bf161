"""The simulated FP8 gradient all-reduce over a recorded trace: every variant of
:mod:`fp8sim.allreduce_sim` over the weight gradients a run saved (``fp8sim replay --allreduce
N``), and its report."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fp8sim.allreduce_sim import METHODS, REDUCTIONS, simulate_allreduce
from fp8sim.formats import get_format

__all__ = ["load_rank_gradients", "replay_allreduce", "format_allreduce_report"]

# -- over a recorded trace ------------------------------------------------------------------------


_RANK_NAME = re.compile(r"rank(0|[1-9][0-9]*)")  # what ``fp8sim train --nproc N --record`` writes
_RANK_LIKE = re.compile(r"rank([0-9]+)")  # rank01, rank00: the same numbers, spelled otherwise


def _rank_dirs(path: Path, ranks: int, notes: list[str]) -> list[Path]:
    """``path``'s per-rank traces ``rank0/ .. rank{ranks-1}/`` (empty: no per-rank traces).

    A rank directory is named exactly ``rank<N>``, ``N`` in decimal without leading zeros, as
    ``fp8sim train --record`` names them. Other ``rank*`` directories (``rank1.bak``, ``rank``,
    ``rank01``) are ignored, named in one line appended to ``notes``; a trace spelled with leading zeros
    next to the trace of the same rank (``rank01/`` beside ``rank1/``) is refused, as is a gap in
    ``0 .. ranks-1`` or a rank directory there that is not a trace. Raises ValueError (one line).
    """
    from fp8sim.trace import is_trace

    found: dict[int, Path] = {}
    odd: list[tuple[int, Path]] = []
    ignored: list[str] = []
    for p in sorted(path.glob("rank*")):
        if not p.is_dir():
            continue
        if _RANK_NAME.fullmatch(p.name):
            found[int(p.name[4:])] = p
            continue
        m = _RANK_LIKE.fullmatch(p.name)
        if m and is_trace(p):
            odd.append((int(m.group(1)), p))
        else:
            ignored.append(p.name)
    traces = {r: p for r, p in found.items() if is_trace(p)}
    for r, p in odd:
        if r in traces:
            raise ValueError(f"{path}: {p.name}/ and {traces[r].name}/ both hold traces of rank {r}; "
                             "remove or rename one")  # fmt: skip
        ignored.append(p.name)
    if ignored:
        notes.append(f"ignored {', '.join(n + '/' for n in sorted(ignored))} under {path}: not rank "
                     "directories (rank0/ rank1/ ..., as fp8sim train --record names them)")  # fmt: skip
    if not traces:
        return []
    missing = [r for r in range(ranks) if r not in traces]
    if missing:
        have = sorted(traces)
        shown = ", ".join(f"rank{r}/" for r in have[:8]) + (" ..." if len(have) > 8 else "")
        absent = [f"rank{r}/" for r in missing if r not in found]
        bad = [found[r].name + "/" for r in missing if r in found]
        why = "; ".join(f"{what} {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                        for what, names in (("missing", absent), ("not an fp8sim trace:", bad)) if names)
        also = f"; ignored {', '.join(n + '/' for n in sorted(ignored))}" if ignored else ""
        raise ValueError(f"{path}: holds traces of {len(traces)} ranks, --allreduce asks for {ranks}, which needs "
                         f"rank0/ .. rank{ranks - 1}/: {why} (found {shown}{also})")  # fmt: skip
    return [traces[r] for r in range(ranks)]


def load_rank_gradients(
    path: str | os.PathLike, ranks: int, *, notes: list[str] | None = None
) -> tuple[str, list[tuple[int, str, list[torch.Tensor]]], list[tuple[int, str]]]:
    """Per-rank weight gradients from a trace, as ``(source, [(step, name, [g_0 .. g_{N-1}])])``.

    * a directory of per-rank traces ``rank0/ rank1/ ...`` (``fp8sim train --nproc N --record``):
      the local weight gradients every rank saved at the same step (``source = "ranks"``);
    * a single trace: no per-rank data exists, so ``ranks`` consecutive saved steps of the same
      tensor stand in for the ranks of one step (``source = "steps-as-ranks"``, a proxy: the
      gradients of neighbouring steps, not of one step's ranks).

    Only tensors of role ``weight_grad`` with saved full tensors are used. Rank directories are
    named exactly ``rank<N>`` (no leading zeros) and ``rank0 .. rank{ranks-1}`` must all be
    traces (more ranks are allowed: the first ``ranks`` are used); other ``rank*`` directories
    are ignored with a line appended to ``notes`` (see ``_rank_dirs``).
    """
    from fp8sim.trace import TraceReader, is_trace

    if not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"--allreduce: need at least 2 ranks, got {ranks!r}")
    path = Path(path)
    notes = [] if notes is None else notes
    subs = _rank_dirs(path, ranks, notes) if path.is_dir() else []
    out: list[tuple[int, str, list[torch.Tensor]]] = []
    if subs:
        readers = [TraceReader(p) for p in subs]
        wgrad = {t.name for t in readers[0].tensors if t.role == "weight_grad"}
        common = set(readers[0].saved_tensors())
        union = set(common)
        for r in readers[1:]:
            common &= set(r.saved_tensors())
            union |= set(r.saved_tensors())
        skipped = sorted(e for e in union - common if e[1] in wgrad)  # saved by some ranks only
        for step, name in sorted(common):
            if name in wgrad:
                out.append((step, name, [r.load_tensor(step, name).float() for r in readers]))
        source = "ranks"
    elif is_trace(path):
        reader = TraceReader(path)
        wgrad = {t.name for t in reader.tensors if t.role == "weight_grad"}
        by_name: dict[str, list[int]] = {}
        for step, name in reader.saved_tensors():
            if name in wgrad:
                by_name.setdefault(name, []).append(step)
        for name, steps in sorted(by_name.items()):
            for i in range(0, len(steps) - ranks + 1, ranks):
                group = steps[i : i + ranks]
                out.append((group[0], name, [reader.load_tensor(s, name).float() for s in group]))
        out.sort(key=lambda e: (e[0], e[1]))
        source, skipped = "steps-as-ranks", []
    else:
        raise ValueError(f"{path}: not an fp8sim trace nor a directory of rank0/ rank1/ ... traces"
                         + (f"; {notes[-1]}" if notes else ""))
    if not out:
        raise ValueError(
            f"{path}: no saved weight gradients for {ranks} ranks (record with --save-every K; a single "
            f"trace needs {ranks} saved steps per tensor)"
        )
    return source, out, skipped


def replay_allreduce(
    path: str | os.PathLike,
    ranks: int,
    *,
    methods: Sequence[str] = METHODS,
    reductions: Sequence[str] = REDUCTIONS,
    fmt: str = "e4m3",
    autoscale: str = "autoscale",
) -> dict:
    """Every (method, reduction) over the trace's saved weight gradients, ``ranks`` ranks.

    Returns ``{"source", "ranks", "format", "records": n, "rows": [...], "incomplete": [[step,
    name], ...] (saved by some ranks only: left out)}``; one row per
    (method, reduction) with totals over all (step, tensor) records: ``overflow_events``
    (records with any saturated sum), ``overflow_sum`` / ``overflow_in`` (elements),
    ``underflow_share`` (of nonzero inputs), ``underflow_out``, ``rel_error_mean`` /
    ``rel_error_max``, ``snr_db_mean``, ``nan_records`` (records whose error is undefined: a NaN
    gradient or sum), and for autoscale the final ``mu`` per tensor. A NaN record makes the
    error figures NaN (mean, max and SNR alike); otherwise ``snr_db_mean`` is the mean over the
    records of finite SNR (``inf``: every record exact; ``-inf``: some error over a zero
    reference). ``notes``: lines about ``rank*`` directories left out.
    ``autoscale``: the policy spec of the autoscale rows (one fresh policy per row).
    """
    from fp8sim.policies import parse_policy

    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown all-reduce method {m!r}; valid: {', '.join(METHODS)}")
    notes: list[str] = []
    source, records, skipped = load_rank_gradients(path, ranks, notes=notes)
    rows = []
    for method in methods:
        for reduce in reductions:
            policy = parse_policy(autoscale) if method == "autoscale" else None
            acc = {"overflow_events": 0, "overflow_sum": 0, "overflow_in": 0, "underflow_in": 0, "nonzero_in": 0,
                   "underflow_out": 0, "numel": 0}
            errs, snrs = [], []
            for step, name, grads in records:
                _, st = simulate_allreduce(grads, method=method, reduce=reduce, fmt=fmt, policy=policy, name=name)
                acc["overflow_events"] += int(st.overflow_sum > 0)
                for key in ("overflow_sum", "overflow_in", "underflow_in", "nonzero_in", "underflow_out", "numel"):
                    acc[key] += getattr(st, key)
                errs.append(st.rel_error)
                snrs.append(st.snr_db)
            row = {"method": method, "reduce": reduce, **acc,
                   "underflow_share": acc["underflow_in"] / acc["nonzero_in"] if acc["nonzero_in"] else 0.0,
                   "rel_error_mean": float(np.mean(errs)), "rel_error_max": float(np.max(errs)),
                   "snr_db_mean": _mean_snr(snrs), "nan_records": sum(math.isnan(e) for e in errs)}
            if policy is not None:
                row["mu"] = {name: policy.mu(name) for name in sorted({r[1] for r in records})}
            rows.append(row)
    return {"source": source, "ranks": ranks, "format": get_format(fmt).name, "records": len(records),
            "steps": sorted({r[0] for r in records}), "rows": rows,
            "incomplete": [[step, name] for step, name in skipped], "notes": notes}


def _mean_snr(snrs: Sequence[float]) -> float:
    """Mean SNR of a row: NaN if any record's is NaN (as its error mean is), ``-inf`` if any
    record's error is over a zero reference, else the mean of the finite ones (``inf`` if all
    records are exact)."""
    if any(math.isnan(s) for s in snrs):
        return math.nan
    if any(s == -math.inf for s in snrs):
        return -math.inf
    finite = [s for s in snrs if math.isfinite(s)]
    return float(np.mean(finite)) if finite else math.inf


def format_allreduce_report(result: dict) -> str:
    """The replay as aligned text (stdout of ``fp8sim replay --allreduce N``)."""
    src = {"ranks": "per-rank traces", "steps-as-ranks": "consecutive saved steps standing in for ranks (proxy)"}
    lines = [
        f"FP8 all-reduce over {result['ranks']} ranks, {result['format']}, {result['records']} (step, tensor) records "
        f"from {src.get(result['source'], result['source'])}",
        "error vs the float32 average of the unquantized gradients",
        "",
        f"{'method':10}{'reduce':7}{'ovf events':>11}{'ovf elems':>11}{'underflow':>11}{'rel err':>10}{'max':>10}{'SNR dB':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['method']:10}{r['reduce']:7}{r['overflow_events']:>11d}{r['overflow_sum']:>11d}"
            f"{100 * r['underflow_share']:>10.3f}%{r['rel_error_mean']:>10.2e}{r['rel_error_max']:>10.2e}"
            f"{r['snr_db_mean']:>8.1f}"
        )
    notes = list(result.get("notes") or [])
    gone = result.get("incomplete") or []
    if gone:
        shown = ", ".join(f"{n} @ {s}" for s, n in gone[:5]) + (" ..." if len(gone) > 5 else "")
        notes.append(f"{len(gone)} (step, tensor) pairs saved by only some ranks left out: {shown}")
    nan = max((r.get("nan_records", 0) for r in result["rows"]), default=0)
    if nan:
        notes.append(f"{nan} (step, tensor) records hold NaN (gradients or sums): their error is undefined, "
                     "so rel err and SNR read nan")
    if notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)
