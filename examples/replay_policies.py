"""Replay scaling policies over a trace from Python: which policy would have overflowed, and where.

    python examples/replay_policies.py [--steps 40] [--spike 25] [--out DIR]

1. writes a small trace with :class:`fp8sim.trace.TraceWriter`, as your own training loop can:
   an E4M3 activation ``act`` (standard normal values, 16x larger at step ``--spike``, as in a
   loss spike) and an E5M2 gradient ``grad`` (values around 1e-6), each recorded with the scale
   a Transformer Engine delayed-scaling run would have used (history 16);
2. replays it with :func:`fp8sim.analysis.replay` under delayed scaling (history 16, with and
   without a margin), just-in-time ``current`` scaling and MS-AMP's, with the rule
   ``fail_on="overflow>0"``;
3. prints the side-by-side table, the first crossing of the rule per policy, and the worst
   records.

What it shows: delayed scaling scales a step with the amaxes of earlier steps, so the spike
overflows (an overflow event) even with a margin of 2 binades (4x), and with no margin an amax
a few percent above the history's overflows too; ``current`` scales each step with its own amax
and never overflows. Delayed scaling's first step has no history (scale 1): the gradient's
values, far below E5M2's smallest subnormal, all underflow there (the worst underflow column).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from fp8sim.analysis import replay
from fp8sim.policies import parse_policy
from fp8sim.trace import TraceWriter

#: the policies replayed (``fp8sim policies`` lists every one and its parameters)
POLICIES = ["delayed:history=16", "delayed:history=16,margin=2", "current", "msamp"]


def write_trace(path: Path, steps: int, spike: int) -> None:
    """A trace of ``steps`` steps; the run's scales from delayed scaling (history 16)."""
    rng = np.random.default_rng(0)
    run = parse_policy("delayed:history=16")
    with TraceWriter(path, {"model": "toy", "recipe": "delayed:history=16"}) as tw:
        tw.add_tensor("act", "activation", "e4m3", (64, 256))
        tw.add_tensor("grad", "grad_output", "e5m2", (64, 256))
        for step in range(steps):
            growth = 16.0 if step == spike else 1.0
            for name, fmt, x in (
                ("act", "e4m3", rng.standard_normal((64, 256)) * growth),
                ("grad", "e5m2", rng.standard_normal((64, 256)) * 1e-6),
            ):
                x = x.astype(np.float32)
                scale = run.scale_for(name, fmt)  # what the run multiplied by before its cast
                tw.record(step, name, x, scale=scale)
                run.observe(name, float(np.abs(x).max()), fmt)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--spike", type=int, default=25, help="the step whose values jump 16x")
    ap.add_argument("--out", type=Path, help="the trace directory (default: a temporary one)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        trace = args.out or Path(tmp) / "trace"
        write_trace(trace, args.steps, args.spike)

        result = replay(trace, POLICIES, fail_on="overflow>0")
        print(result.table())
        width = max(len(p.policy) for p in result.policies)

        print("\nfirst crossing of overflow>0 per policy:")
        for p in result.policies:
            first = next((c for c in result.crossings if c.policy == p.policy), None)
            said = f"{first.tensor} at step {first.step}" if first else "none"
            print(f"  {p.policy:{width}}  {said}")

        print("\nworst records (overflow share, then underflow share):")
        for r in result.worst(3):
            lo, hi = r.overflow
            count = str(lo) if lo == hi else f"{lo}..{hi}"
            print(f"  {r.policy:{width}}  {r.tensor} step {r.step}: {count} values overflow "
                  f"(scale {r.scale:.4g}{', an overflow event' if r.event else ''})")


if __name__ == "__main__":
    main()
