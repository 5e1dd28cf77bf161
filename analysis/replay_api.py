"""``replay``: scaling policies over a recorded trace (:func:`fp8sim.analysis.replay`; the
columns: :mod:`fp8sim.analysis.policy_replay`; the result: :mod:`fp8sim.analysis.replay_result`).

Bad arguments raise :class:`~fp8sim.errors.ArgumentError` naming the parameter; a path that is
no trace raises ``ValueError`` naming it.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from fp8sim.analysis.replay_result import ReplayResult, replay_result
from fp8sim.errors import ArgumentError, expect_bool, expect_names, expect_str

__all__ = ["replay"]


def _replay_failures(replays: list, rules: list) -> list[tuple]:
    """(rule, policy, tensor, step) of every replayed record that crosses a rule: earliest step
    first, then policy order, then recording order. A record whose counts are a bracket (a
    non-power-of-two scale) crosses only when its whole bracket does: the lower bound is compared
    for ``>``/``>=``, the upper for ``<``/``<=``. Shares with a zero denominator never cross."""
    found = []
    for pi, rp in enumerate(replays):
        c = rp.cols
        events: dict[int, int] = {}
        for i in range(c["step"].size):
            tid = int(c["tensor"][i])
            events[tid] = events.get(tid, 0) + int(c["event"][i])
            fin, nz = int(c["finite"][i]), int(c["nonzero"][i])
            bound = {}
            for b in ("lo", "hi"):
                ov, un = int(c[f"overflow_{b}"][i]), int(c[f"underflow_{b}"][i])
                bound[b] = {"overflow": ov, "overflow_pct": 100.0 * ov / fin if fin else None,
                            "underflow": un, "underflow_pct": 100.0 * un / nz if nz else None,
                            "events": events[tid]}  # fmt: skip
            for rule in rules:
                if rule.crossed(bound["lo" if rule.op in (">", ">=") else "hi"]):
                    found.append((int(c["step"][i]), pi, i, rule, rp.policy, rp.names[tid]))
    found.sort(key=lambda f: f[:3])  # stable: rules keep their order within a record
    return [(rule, policy, tensor, step) for step, _, _, rule, policy, tensor in found]


def _performed_only(replays: list, what_if_ids: set[int], what_if_total: int) -> list:
    """The replays without the records of the tensors in ``what_if_ids`` (casts the run did not
    perform; ``what_if_total`` records in the trace). Policies keep their state per tensor, so
    the other records' figures are those of a replay without them. ``skipped`` (records a
    block-scaled policy had no saved tensor for) loses the what-if ones too."""
    import numpy as np

    from fp8sim.analysis.policy_replay import PolicyReplay

    out = []
    for rp in replays:
        hypo = np.isin(rp.cols["tensor"], sorted(what_if_ids))
        cols = {k: v[~hypo] for k, v in rp.cols.items()}
        skipped = rp.skipped - (what_if_total - int(hypo.sum()))
        out.append(PolicyReplay(rp.policy, rp.names, cols, skipped))
    return out


def replay(
    trace: Any,
    policies: str | Sequence[str],
    *,
    include_recorded: bool = True,
    what_if: bool = False,
    fail_on: str | None = None,
    progress: bool = False,
) -> ReplayResult:
    """What each scaling policy would have done over the recorded ``trace`` (a trace directory
    or a :class:`fp8sim.trace.TraceReader`), step by step: the scale per tensor and step,
    overflow events, overflow / underflow counts (exact for power-of-two scales, else a bracket);
    see :mod:`fp8sim.analysis.policy_replay`.

    ``policies``: specs such as ``"delayed:history=16,margin=1"``, ``"current:pow2"``,
    ``"msamp"``, ``"autoscale"``, ``"static:scale=1"`` (one string is one spec; ``fp8sim
    policies`` lists them); the same policy spelled twice is replayed once.
    ``include_recorded``: the trace's own scales first, as the policy ``recorded``.
    ``what_if``: replay the casts the trace records but its run did not perform too (``what_if``
    tensors: weight gradients under ``te-*`` recipes); left out by default, so that
    ``recorded`` counts what the run did (the figures ``fp8sim compare`` shows). ``fail_on``:
    rules such as ``"overflow>0,underflow>1%,events>2"`` checked per policy x tensor x step
    (``result.crossings``). ``progress``: a bar on stderr.
    """
    from fp8sim.analysis.report import REPLAY_FAIL_METRICS, parse_fail_on
    from fp8sim.analysis.run_traces import merged_runs
    from fp8sim.trace import TraceReader, is_trace

    expect_names(policies, "policies")
    expect_bool(include_recorded, "include_recorded")
    expect_bool(what_if, "what_if")
    expect_str(fail_on, "fail_on", optional=True)
    expect_bool(progress, "progress")
    try:
        rules = parse_fail_on(fail_on, REPLAY_FAIL_METRICS) if fail_on is not None else []
    except ValueError as exc:
        raise ArgumentError.renamed(exc, "--fail-on", "fail_on") from None
    specs = [policies] if isinstance(policies, str) else list(policies)
    if not specs:
        raise ArgumentError.about("policies", ": give one policy spec or more (e.g. 'current')")
    if isinstance(trace, TraceReader):
        return _replay_reader(trace, str(trace.path), specs, include_recorded, what_if, rules, progress)
    shown = os.fspath(trace)
    if not os.path.exists(shown):
        raise ValueError(f"{shown}: no such directory")
    with merged_runs(shown) as (path, _, _):
        if not os.path.isdir(path) or not is_trace(path):
            raise ValueError(f"{shown}: not an fp8sim trace directory (no trace.json of the "
                             "fp8sim-trace schema, nor rank0/, rank1/, ... traces of a run)")  # fmt: skip
        return _replay_reader(TraceReader(path), shown, specs, include_recorded, what_if, rules, progress)


def _replay_reader(reader, shown: str, specs: list, include_recorded: bool, what_if: bool, rules: list,
                   progress: bool) -> ReplayResult:  # fmt: skip
    """:func:`replay` over an open trace (``shown``: the path given for it)."""
    import numpy as np

    from fp8sim.analysis.policy_replay import replay_policies
    from fp8sim.scaling_config import parse_scaling, scaling_spec

    sc = reader.scalars()
    live = sc["numel"] > 0  # an idle MoE expert's empty record is not replayed (nothing was cast)
    n_records = int(live.sum())
    # one per policy, however often it is spelled (replay_policies replays it once)
    n_pol = len({scaling_spec(*parse_scaling(p)) for p in specs}) + (1 if include_recorded else 0)
    from fp8sim.analysis.api import progress_bar

    bar = progress_bar(n_records * n_pol, progress, "rec")
    try:
        replays = replay_policies(reader, specs, include_recorded=include_recorded,
                                  progress=bar.update)  # fmt: skip
    finally:
        bar.close()
    hypo = {t.index for t in reader.tensors if t.what_if}
    left_out = 0
    if hypo and not what_if:
        tensor_col = sc["tensor"][live]
        left_out = int(np.isin(tensor_col, sorted(hypo)).sum())
        replays = _performed_only(replays, hypo, left_out)
        n_records -= left_out
    crossed = _replay_failures(replays, rules) if rules else []
    return replay_result(shown, reader.rounding, replays, rules, crossed, n_records,
                         what_if_tensors=tuple(t.name for t in reader.tensors if t.what_if),
                         what_if=what_if, what_if_records=left_out)  # fmt: skip
