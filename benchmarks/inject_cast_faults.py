"""How much overflow and underflow does training tolerate? Inject them into the demo's FP8 casts.

Trains the model and recipe of ``fp8sim demo`` (byte-level GPT, 2 layers x 64, batch 8 x 64
bytes, 200 steps, ``te-delayed``) once clean and once per injected fault, per seed, and reports
the loss of each faulty run relative to the clean run of the same seed (same initialisation,
same batches). The thresholds of the ``ok`` / ``warning`` / ``critical`` statuses
(docs/analysis.md, "Reading the result") are chosen from this table.

A fault is applied to the codes of every per-tensor cast of one role (``activation``,
``weight`` or ``grad_output``: all 8 FP8 linears of the model), after the backend made them, in
a chosen share of the training steps (never in evaluation):

* ``underflow P``: the smallest share P of the cast's nonzero codes (by magnitude) become zero,
  as values below the format's smallest subnormal do;
* ``saturate P``: the largest share P of the nonzero codes are clipped to the magnitude of the
  largest code left (sign kept), as a saturating cast clips the values above the format's max
  when the scale is too large for the tensor's outliers.

Nothing in fp8sim is edited: the run uses the ``emulator`` backend (or ``--backend torch``, whose
codes are identical) wrapped in :class:`FaultInjectingBackend`, which the FP8 state calls for
every cast; the role of the cast comes from a wrapper around that state's ``cast`` method.

    python benchmarks/inject_cast_faults.py --seeds 0,1,2 --jobs 2 --out faults.jsonl   # the GRID (resumable)
    python benchmarks/inject_cast_faults.py --out faults.jsonl --report        # the table

Needs only fp8sim's base install.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from fp8sim import backends
from fp8sim.training.data import load_corpus
from fp8sim.training.model import GPTConfig
from fp8sim.training.trainer import TrainConfig, Trainer

#: the demo's default size (fp8sim/commands/demo.py SIZES["default"])
MODEL = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
BATCH, STEPS = 8, 200
ROLES = ("activation", "weight", "grad_output")
#: the grid, in the order it is run: (fault, share of values, share of steps, roles, seeds); the
#: runs that bound the thresholds first, more seeds where the effect is near the noise
GRID = (
    ("saturate", 1e-2, 1.0, ROLES, (0, 1, 2)), ("underflow", 0.1, 1.0, ROLES, (0, 1, 2)),
    ("underflow", 1.0, 1.0, ROLES, (0, 1, 2)), ("saturate", 1e-1, 1.0, ROLES, (0, 1, 2)),
    ("saturate", 1e-3, 1.0, ROLES, (0, 1, 2)), ("underflow", 0.5, 1.0, ROLES, (0, 1, 2)),
    ("underflow", 0.25, 1.0, ("grad_output",), (0, 1, 2)), ("saturate", 1e-4, 1.0, ("grad_output",), (0, 1, 2)),
    ("underflow", 1.0, 0.1, ROLES, (0,)), ("saturate", 1e-1, 0.1, ("grad_output",), (0, 1, 2)),
    ("underflow", 0.02, 1.0, ROLES, (0,)), ("saturate", 1e-2, 0.1, ("grad_output",), (0,)),
    ("underflow", 0.5, 0.1, ("grad_output",), (0,)), ("saturate", 1e-4, 1.0, ("activation", "weight"), (0,)),
    ("underflow", 0.005, 1.0, ("activation",), (0,)),
)


class FaultInjectingBackend:
    """A backend that post-processes the codes of another one's per-tensor casts.

    ``fault``: ``"underflow"`` or ``"saturate"`` (the module docstring), ``share`` of the nonzero
    codes of each cast of ``role``, at the training steps where ``step % every == 0``. Every
    other call goes to ``inner`` unchanged. ``role``, ``step`` and ``training`` are set before
    each cast by :func:`install`. ``changed`` / ``seen`` count the codes altered / cast."""

    def __init__(self, inner, fault: str, share: float, role: str, every: int = 1) -> None:
        self.inner, self.fault, self.share, self.target, self.every = inner, fault, share, role, every
        self.role, self.step, self.training = None, 0, False
        self.changed = self.seen = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def quantize_with_amax(self, x, fmt, scale=1.0, **kw):
        codes, scale_inv, amax = self.inner.quantize_with_amax(x, fmt, scale, **kw)
        if self.training and self.role == self.target and self.step % self.every == 0:
            codes = self._inject(codes, fmt)
        return codes, scale_inv, amax

    def quantize(self, x, fmt, scale=1.0, **kw):
        codes, scale_inv, _ = self.quantize_with_amax(x, fmt, scale, **kw)
        return codes, scale_inv

    def _inject(self, codes: torch.Tensor, fmt) -> torch.Tensor:
        flat = codes.reshape(-1).numpy()
        mag = flat & np.uint8(fmt.sign_mask - 1)
        counts = np.bincount(mag, minlength=fmt.sign_mask)  # values per magnitude code
        nonzero = int(flat.size - counts[0])
        k = min(nonzero, int(math.floor(self.share * nonzero + 0.5)))
        self.seen += nonzero
        if k == 0:
            return codes
        out = flat.copy()
        if self.fault == "underflow":  # the k smallest magnitudes (ties: first in memory order) -> +0
            upto = np.cumsum(counts[1:])  # upto[c - 1]: nonzero codes with magnitude <= c
            c = int(np.searchsorted(upto, k)) + 1  # the magnitude that holds the k-th smallest
            flush = (mag > 0) & (mag < c)
            rest = k - (int(upto[c - 2]) if c > 1 else 0)
            flush[np.flatnonzero(mag == c)[:rest]] = True
            out[flush] = 0
            self.changed += k
        else:  # the k largest clipped to the (k+1)-th largest magnitude (0 when k is all of them)
            atleast = np.cumsum(counts[::-1])[::-1]  # atleast[c]: codes with magnitude >= c
            keep = int(np.flatnonzero(atleast[1:] >= k + 1).max()) + 1 if k < nonzero else 0
            clip = mag > keep
            out[clip] = (flat[clip] & np.uint8(fmt.sign_mask)) | np.uint8(keep)
            self.changed += int(clip.sum())
        return torch.from_numpy(out).reshape(codes.shape)


def install(trainer: Trainer, fault: FaultInjectingBackend) -> None:
    """Make ``trainer``'s FP8 state cast through ``fault``, telling it each cast's role and step."""
    state = trainer.fp8
    state.backend = fault
    for q in getattr(state, "quantizers", {}).values():  # each role's quantizer holds the backend too
        q.backend = fault
    cast = state.cast

    def cast_with_role(name, role, x, **kw):
        fault.role, fault.step, fault.training = role, state.step, state.observing
        return cast(name, role, x, **kw)

    state.cast = cast_with_role


def run_one(recipe: str, backend: str, seed: int, fault: tuple | None, role: str | None, corpus) -> dict:
    cfg = TrainConfig(recipe=recipe, backend=backend, steps=STEPS, seed=seed, model=MODEL, batch_size=BATCH,
                      eval_every=0, eval_batches=16, checkpoint_every=0)
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(cfg, tmp, corpus=corpus)
        inj = None
        if fault is not None:
            kind, share, steps_share = fault
            inj = FaultInjectingBackend(t.fp8.backend, kind, share, role, every=round(1 / steps_share))
            install(t, inj)
        t0 = time.perf_counter()
        summary = t.run(progress=False)
        rows = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl"))]
    tail = [r["loss"] for r in rows[-10:]]
    return {"recipe": recipe, "seed": seed, "role": role, "fault": fault and fault[0], "share": fault and fault[1],
            "steps_share": fault and fault[2], "final_loss_smoothed": sum(tail) / len(tail),
            "val_loss": summary["final_val_loss"], "nan": any(not math.isfinite(r["loss"]) for r in rows),
            "changed_share": (inj.changed / inj.seen) if inj and inj.seen else None,
            "wall_s": round(time.perf_counter() - t0, 1)}


def key(r: dict) -> tuple:
    return (r["recipe"], r["seed"], r["role"], r["fault"], r["share"], r["steps_share"])


def run_grid(args) -> None:
    done = set()
    if os.path.exists(args.out):
        done = {key(json.loads(line)) for line in open(args.out) if line.strip()}
    corpus = load_corpus() if args.jobs == 1 else None
    jobs = []
    for seed in args.seeds:
        jobs.append(("bf16", seed, None, None))
        jobs.append((args.recipe, seed, None, None))
    for kind, share, steps_share, roles, seeds in GRID:
        for seed in seeds:
            for role in roles:
                if seed in args.seeds and role in args.roles:
                    jobs.append((args.recipe, seed, (kind, share, steps_share), role))
    jobs = [j for j in jobs if (j[0], j[1], j[3], j[2] and j[2][0], j[2] and j[2][1], j[2] and j[2][2]) not in done]
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for r in pool.imap_unordered(_job, [(j, args.backend, args.out) for j in jobs]):
                print(json.dumps(r), file=sys.stderr, flush=True)
    else:
        _CORPUS.append(corpus)
        for j in jobs:
            print(json.dumps(_job((j, args.backend, args.out))), file=sys.stderr, flush=True)


_CORPUS: list = []


def _job(arg) -> dict:
    """One run of the grid, its line appended to the output file (one write: whole lines)."""
    (recipe, seed, f, role), backend, out = arg
    if not _CORPUS:
        torch.set_num_threads(1)
        _CORPUS.append(load_corpus())
    r = run_one(recipe, backend, seed, f, role, _CORPUS[0])
    with open(out, "a") as fh:
        fh.write(json.dumps(r) + "\n")
    return r


def report(args) -> None:
    rows = list({key(r): r for r in map(json.loads, filter(str.strip, open(args.out)))}.values())  # a run once
    base = {(r["seed"]): r for r in rows if r["recipe"] == args.recipe and r["fault"] is None}
    bf16 = {(r["seed"]): r for r in rows if r["recipe"] == "bf16"}
    seeds = sorted(base)
    print(f"seeds: {len(seeds)} ({', '.join(map(str, seeds))}); loss change relative to the clean {args.recipe} run "
          "of the same seed, mean over seeds [min, max]; val: the final validation loss (16 batches, "
          "no fault injected), train: the mean training loss of the last 10 steps\n")
    for metric in ("val_loss", "final_loss_smoothed"):
        d = [(bf16[s][metric] - base[s][metric]) / base[s][metric] for s in seeds if s in bf16]
        if d:
            print(f"bf16 vs clean {args.recipe} ({metric}): {_cell(d)}")
    print()
    print("| role | fault | share of values | share of steps | seeds | val loss | train loss (last 10) | codes changed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["fault"] is not None and r["seed"] in base:
            groups.setdefault((r["role"], r["fault"], r["share"], r["steps_share"]), []).append(r)
    for (role, fault, share, steps), rs in sorted(groups.items(), key=lambda kv: (ROLES.index(kv[0][0]), kv[0][1],
                                                                                -kv[0][3], kv[0][2])):
        val = [(r["val_loss"] - base[r["seed"]]["val_loss"]) / base[r["seed"]]["val_loss"] for r in rs]
        tr = [(r["final_loss_smoothed"] - base[r["seed"]]["final_loss_smoothed"]) / base[r["seed"]]["final_loss_smoothed"]
              for r in rs]
        ch = [r["changed_share"] for r in rs if r["changed_share"] is not None]
        print(f"| {role} | {fault} | {share:g} | {steps:g} | {len(rs)} | {_cell(val)} | {_cell(tr)} | "
              f"{statistics.mean(ch):.3g} |" + (" NaN loss" if any(r["nan"] for r in rs) else ""))


def _cell(v: list[float]) -> str:
    if not v:
        return "-"
    m = statistics.mean(v)
    return f"{m:+.2%}" if len(v) == 1 else f"{m:+.2%} [{min(v):+.2%}, {max(v):+.2%}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="faults.jsonl", help="JSON lines, one per run; runs already there are skipped")
    p.add_argument("--seeds", default="0", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--roles", default=",".join(ROLES), type=lambda s: s.split(","))
    p.add_argument("--recipe", default="te-delayed")
    p.add_argument("--backend", default="emulator", choices=("emulator", "torch"))
    p.add_argument("--report", action="store_true", help="print the table of the runs in --out")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    backends.get(args.backend)  # a bad name fails before any run
    if args.report:
        report(args)
    else:
        run_grid(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
