"""FP8 gradient all-reduce, simulated in one process: the variants FP8-LM compares.

Every rank ``r`` holds a float32 gradient ``g_r`` of the same tensor. All variants share one
per-tensor multiplier ``k`` on every rank (FP8-LM: the minimum of the ranks' scales, i.e. the
scale of the global amax), encode ``codes_r = encode(float32(g_r) * k)`` (E4M3, round to
nearest even, saturating), add the decoded codes, re-encode the sum, and decode the average as
``decode(sum_codes) / (k * N)``. They differ in ``k`` (``s = fmt.max / max_r amax(g_r)``):

* ``pre``       -- pre-scaling, ``k = s / N``: every rank divides by N first; small values
  underflow (FP8-LM section 2.1);
* ``post``      -- post-scaling, ``k = s``: the sum is divided by N afterwards; large sums
  overflow (saturate at ``fmt.max``);
* ``msamp``     -- MS-AMP's fixed pre-scale, ``k = 2**floor(log2 s) / sqrt(N)`` (msamp/nn/
  distributed.py: power-of-two scaling factor times ``1 / sqrt(world_size)``);
* ``autoscale`` -- FP8-LM's automatic scaling, ``k = mu * s`` with ``mu`` from an
  :class:`fp8sim.policies.AutoScale` policy that observes the share of sums that hit ``fmt.max``
  (halves ``mu`` above 0.001%, regrows it towards 2 otherwise), one state per tensor, step by step.

and in how the sum is formed:

* ``exact`` -- reduce-scatter: decoded codes summed in float32 (exact: E4M3 values are
  multiples of ``2**-9`` below ``2**9``, so up to 64 of them add exactly) and encoded once;
* ``ring``  -- an N-hop ring whose every hop re-rounds the partial sum to FP8, as an all-reduce
  over FP8 buffers does; chunk ``j`` (of N equal chunks) starts at rank ``(j + 1) % N``.

The global amax is what an all-reduce of the ranks' amaxes (``all_reduce(MAX)`` of CUDA float32
tensors) gives: each rank's own amax propagates NaN (``torch.amax``, :func:`fp8sim.scaling.
compute_amax`), and the MAX across ranks skips NaN amaxes like NCCL's float MAX (``fmaxf``): a rank
holding a NaN does not decide ``k``, the global amax is NaN only when every rank's amax is NaN
(then ``scale_from_amax`` gives scale 1). The result does not depend on which rank holds the NaN.

Errors are measured against the float32 average of the unquantized gradients (summed in float64,
rounded once). ``replay_allreduce`` runs every variant over the gradients saved in a trace
(``fp8sim replay --allreduce N``).
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from fp8sim.formats import FloatFormat, get_format

__all__ = [
    "METHODS",
    "REDUCTIONS",
    "AllReduceStats",
    "decode_codes",
    "encode_values",
    "sum_codes",
    "ring_sum_codes",
    "simulate_allreduce",
    "error_figures",
    "global_amax",
    "load_rank_gradients",
    "replay_allreduce",
    "format_allreduce_report",
    "stats_dict",
]

METHODS = ("pre", "post", "msamp", "autoscale")
REDUCTIONS = ("exact", "ring")


@functools.lru_cache(maxsize=None)
def _table(fmt: FloatFormat) -> torch.Tensor:
    from fp8sim.emulator import decode_table

    return torch.from_numpy(decode_table(fmt, np.float32).copy())


def decode_codes(codes: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
    """Exact float32 values of uint8 ``codes`` (table lookup)."""
    fmt = get_format(fmt)
    return _table(fmt).to(codes.device)[codes.long()]


def encode_values(x: torch.Tensor, fmt: FloatFormat | str, backend: Any = None) -> torch.Tensor:
    """``encode(float32(x))``: round to nearest even, saturating, through ``backend`` (default:
    the emulator)."""
    from fp8sim import backends

    be = backends.get("emulator") if backend is None else backend
    return be.quantize(x.to(torch.float32), get_format(fmt), 1.0)[0]


def _at_max(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    mag = codes & (fmt.sign_mask - 1) if fmt.signed else codes
    return mag == fmt.max_code


def _overflows(y: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Where the float32 value ``y`` rounds above ``fmt.max`` (round to nearest even)."""
    from fp8sim.trace import cast_thresholds

    thr = cast_thresholds(fmt, "rne")
    a = y.abs()
    over = a > thr.overflow_at
    if thr.overflow_tie:
        over |= a == thr.overflow_at
    return over


def sum_codes(
    chunks: Sequence[torch.Tensor], fmt: FloatFormat | str, backend: Any = None
) -> tuple[torch.Tensor, int]:
    """One rounding: ``encode(sum_r decode(chunks[r]))``, the float32 sum taken in rank order
    (exact for up to 64 E4M3 terms). Returns the codes and how many sums rounded above
    ``fmt.max`` (saturated)."""
    fmt = get_format(fmt)
    acc = decode_codes(chunks[0], fmt).clone()
    for c in chunks[1:]:
        acc += decode_codes(c, fmt)
    return encode_values(acc, fmt, backend), int(_overflows(acc, fmt).sum())


def ring_sum_codes(
    chunks: Sequence[torch.Tensor], fmt: FloatFormat | str, backend: Any = None
) -> tuple[torch.Tensor, int]:
    """N - 1 roundings: an FP8 ring reduce (chunk ``j`` starts at rank ``(j + 1) % N``).
    Returns the codes and how many elements saturated at some hop."""
    fmt = get_format(fmt)
    n = len(chunks)
    flat = [c.reshape(-1) for c in chunks]
    numel = flat[0].numel()
    out = torch.empty(numel, dtype=torch.uint8, device=flat[0].device)
    hit = torch.zeros(numel, dtype=torch.bool, device=flat[0].device)
    bounds = [numel * j // n for j in range(n + 1)]
    for j in range(n):
        sl = slice(bounds[j], bounds[j + 1])
        order = [(j + 1 + h) % n for h in range(n)]
        acc = flat[order[0]][sl]
        for r in order[1:]:
            partial = decode_codes(acc, fmt) + decode_codes(flat[r][sl], fmt)  # exact in float32
            hit[sl] |= _overflows(partial, fmt)
            acc = encode_values(partial, fmt, backend)
        out[sl] = acc
    return out.view(chunks[0].shape), int(hit.sum())


@dataclass
class AllReduceStats:
    """One all-reduce of one tensor.

    ``overflow_in``: elements (over all ranks) whose ``|g_r * k|`` rounds above ``fmt.max``;
    ``overflow_sum``: result elements that saturated in the sum (any hop, for the ring);
    ``underflow_in``: nonzero inputs encoded to zero; ``nonzero_in``: nonzero inputs;
    ``underflow_out``: elements whose float32 average is nonzero but the result is zero;
    ``rel_error``: ``||avg - ref||_2 / ||ref||_2``; ``snr_db``: ``20 log10(||ref|| / ||avg - ref||)``
    (:func:`error_figures`: no error gives ``(0, inf)``, an error over a zero reference ``(inf,
    -inf)``, and a NaN anywhere -- a NaN gradient, a NaN sum -- ``(nan, nan)``: undefined, never
    an SNR of ``inf`` next to a NaN error);
    ``k``: the multiplier used; ``mu``: AutoScale's factor (1 for the other methods).
    """

    method: str
    reduce: str
    ranks: int
    numel: int
    overflow_in: int
    overflow_sum: int
    underflow_in: int
    nonzero_in: int
    underflow_out: int
    rel_error: float
    snr_db: float
    k: float
    mu: float = 1.0

    @property
    def underflow_share(self) -> float:
        return self.underflow_in / self.nonzero_in if self.nonzero_in else 0.0


def error_figures(err: float, nref: float) -> tuple[float, float]:
    """``(rel_error, snr_db)`` of an error norm ``err`` against a reference norm ``nref``.

    NaN in either gives ``(nan, nan)`` (undefined); ``err == 0`` gives ``(0, inf)``; an error over
    a zero reference, or an infinite error, ``(inf, -inf)``; otherwise ``err / nref`` and
    ``20 log10(nref / err)``. The two figures never disagree (no ``inf`` SNR beside a NaN or
    infinite error)."""
    err, nref = float(err), float(nref)
    if math.isnan(err) or math.isnan(nref) or (math.isinf(err) and math.isinf(nref)):
        return math.nan, math.nan
    if err == 0:
        return 0.0, math.inf
    if nref == 0 or math.isinf(err):
        return math.inf, -math.inf
    if math.isinf(nref):
        return 0.0, math.inf
    return err / nref, 20 * math.log10(nref / err)


def global_amax(grads: Sequence[torch.Tensor]) -> float:
    """The all-reduced amax of per-rank gradients, independent of the ranks' order.

    Each rank's amax is ``max |g_r|`` with NaN propagating (``torch.amax``; 0 for an empty
    tensor); the MAX across ranks skips NaN amaxes, as ``all_reduce(MAX)`` of CUDA float32
    amaxes does (NCCL reduces floats with ``fmaxf``). NaN only when every rank's amax is NaN;
    ``inf`` when some rank holds an inf."""
    local = [float(g.abs().amax()) if g.numel() else 0.0 for g in grads]
    known = [a for a in local if not math.isnan(a)]
    return max(known) if known else math.nan


def _multiplier(method: str, amax: float, n: int, fmt: FloatFormat, policy: Any, name: str) -> tuple[float, float]:
    """(the cast's multiplier, AutoScale's mu) of ``method``, decided by a quantizer: ``pre``
    ``fmax / amax`` divided by N, ``post`` ``fmax / amax``, ``msamp`` its power of two divided by
    sqrt(N), ``autoscale`` ``mu * fmax / amax`` (``policy``'s state)."""
    from fp8sim.quantizer import Quantizer
    from fp8sim.recipes import CastConfig
    from fp8sim.scaling_config import CurrentScalingConfig

    if method not in METHODS:
        raise ValueError(f"unknown all-reduce method {method!r}; valid: {', '.join(METHODS)}")
    if method == "autoscale":
        q = Quantizer(CastConfig(fmt, policy.config), policy=policy)
        return q.scale_for(name, amax), policy.mu(name)
    divisor = {"pre": n, "post": 1, "msamp": math.sqrt(n)}[method]
    q = Quantizer(CastConfig(fmt, CurrentScalingConfig(pow2=method == "msamp")), scale_divisor=divisor)
    return q.scale_for(name, amax), 1.0


def simulate_allreduce(
    grads: Sequence[torch.Tensor],
    *,
    method: str = "autoscale",
    reduce: str = "exact",
    fmt: FloatFormat | str = "e4m3",
    policy: Any = None,
    name: str = "grad",
    backend: Any = None,
) -> tuple[torch.Tensor, AllReduceStats]:
    """Average ``grads`` (one float tensor per rank, same shape) through FP8; returns the float32
    average and its statistics. ``policy``: the AutoScale policy for ``method="autoscale"``
    (default: a fresh ``autoscale``), observed after the sum (its state advances one step)."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduce!r}; valid: {', '.join(REDUCTIONS)}")
    if not grads or any(g.shape != grads[0].shape for g in grads):
        raise ValueError("simulate_allreduce: need one gradient per rank, all of the same shape")
    fmt = get_format(fmt)
    n = len(grads)
    gs = [g.detach().to(torch.float32).cpu() for g in grads]
    amax = global_amax(gs)  # order-independent: a NaN rank does not decide k (module docstring)
    if method == "autoscale" and policy is None:
        from fp8sim.policies import parse_policy

        policy = parse_policy("autoscale")
    k, mu = _multiplier(method, amax, n, fmt, policy, name)
    k32 = torch.tensor(k, dtype=torch.float32)
    codes, over_in, under_in, nonzero = [], 0, 0, 0
    for g in gs:
        y = g * k32  # float32 product, rounded once
        c = encode_values(y, fmt, backend)
        over_in += int(_overflows(y, fmt).sum())
        nz = g != 0
        nonzero += int(nz.sum())
        under_in += int((nz & (decode_codes(c, fmt) == 0)).sum())
        codes.append(c)
    if reduce == "exact":
        out, over_sum = sum_codes(codes, fmt, backend)
    else:
        out, over_sum = ring_sum_codes(codes, fmt, backend)
    avg = decode_codes(out, fmt) / (k32 * n)
    ref = (torch.stack([g.double() for g in gs]).sum(0) / n).float()
    rel_error, snr_db = error_figures(float((avg.double() - ref.double()).norm()), float(ref.double().norm()))
    under_out = int(((ref != 0) & (avg == 0)).sum())
    if method == "autoscale":
        policy.observe(name, amax, fmt, numel=out.numel(), n_at_max=int(_at_max(out, fmt).sum()))
    stats = AllReduceStats(
        method=method, reduce=reduce, ranks=n, numel=out.numel(), overflow_in=over_in, overflow_sum=over_sum,
        underflow_in=under_in, nonzero_in=nonzero, underflow_out=under_out,
        rel_error=rel_error, snr_db=snr_db, k=k, mu=mu,
    )
    return avg, stats


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


def stats_dict(st: AllReduceStats) -> dict:
    """JSON-ready form of :class:`AllReduceStats`."""
    return {**asdict(st), "underflow_share": st.underflow_share}
