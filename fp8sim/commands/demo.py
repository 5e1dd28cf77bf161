"""``fp8sim demo``: the main job, end to end, in about a minute on a 2-core CPU.

1. trains the byte-level GPT on the default corpus (the Python standard library's sources) with
   ``bf16`` and with an FP8 recipe (``te-delayed`` by default) on the ``torch`` backend, both
   recorded (the bf16 run through :func:`fp8sim.training.record`'s hooks, with the hypothetical
   te-delayed casts), and the same FP8 recipe once more on the ``emulator`` backend (its first
   :data:`EMULATOR_STEPS` steps: the backends are compared over the steps both ran);
2. checks the two backends: identical FP8 codes for every cast of step 1, loss curves within
   1e-3 relative;
3. analyzes the FP8 trace (:func:`fp8sim.analysis.analyze`), replays scaling policies over it
   (:func:`fp8sim.analysis.replay`), and compares the runs (``fp8sim compare``);
4. writes a report folder: ``summary.md`` (how to read it, targets measured, tables; see
   :mod:`fp8sim.commands.demo_report`), PNG plots, the runs and the traces.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fp8sim.commands.demo_report import write_report
from fp8sim.atomic_file import atomic_write, owned_dir

__all__ = ["register", "run_demo", "run"]

#: scaling policies replayed over the FP8 trace
REPLAY_POLICIES = (
    "delayed:history=16,margin=0,algo=max",
    "delayed:history=16,margin=1,algo=max",
    "current",
    "msamp",
    "static:scale=1",
)

#: the demo's sizes: (model, batch size, steps). "default" fits a minute on a quiet 2-core CPU
#: (a batch of 8 x 64 bytes; CPU bfloat16 matmuls, the bf16 run's, are several times slower
#: than float32 ones without bf16 matrix units); "full" is the model GPTConfig describes.
SIZES = {
    "quick": (dict(block_size=32, n_layer=1, n_head=2, n_embd=32), 4, 12),
    "default": (dict(block_size=64, n_layer=2, n_head=4, n_embd=64), 8, 200),
    "full": ({}, 16, 300),
}
#: steps of the emulator-backend run (the whole run when fewer): the backends agree step by step
EMULATOR_STEPS = 50
#: the list of the files a demo report holds (:mod:`fp8sim.owned_tree`): a rerun removes exactly
#: those, and refuses a folder holding anything else
REPORT_LIST = ".fp8sim-demo"
REPORT_SCHEMA = "fp8sim-demo-report"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train bf16 and FP8 on CPU, record, analyze, replay, compare; write a report folder",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--out", default="demo-report",
                   help="report folder (default %(default)s); a previous demo report there is replaced, "
                        "a folder of other files refused")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per run (default {SIZES['default'][2]}; with --full {SIZES['full'][2]})")
    p.add_argument("--recipe", default="te-delayed", help="the FP8 recipe (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of init and batches (default %(default)s)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a tiny model and 12 steps: a smoke test (seconds)")
    size.add_argument("--full", action="store_true",
                      help="the full-size model (context 128, batch 16, 300 steps): several minutes on 2 cores")
    p.add_argument("--json", action="store_true", help="print the measured figures as JSON")
    p.set_defaults(func=run)


def _msg(text: str) -> None:
    print(f"fp8sim demo: {text}", file=sys.stderr)


def run_demo(
    out: str | os.PathLike,
    *,
    steps: int | None = None,
    recipe: str = "te-delayed",
    seed: int = 0,
    size: str = "default",
    progress: bool | None = None,
) -> dict:
    """Run the demo into ``out``; returns the measured figures (also in ``summary.json``).

    ``size``: ``"quick"``, ``"default"`` or ``"full"`` (:data:`SIZES`); ``steps`` overrides its
    step count. ``out`` must be new, empty, or a previous demo report, which is replaced: the
    files the demo listed in :data:`REPORT_LIST` when it wrote them are removed, and a report
    holding anything else anywhere inside is refused (:mod:`fp8sim.owned_tree`). One process at
    a time writes ``out``: another one there is refused. ``progress``: as :meth:`Trainer.run`.
    Bad arguments raise :class:`~fp8sim.errors.ArgumentError` naming them."""
    from fp8sim.errors import ArgumentError
    from fp8sim.output_dir import output_dir
    from fp8sim.owned_tree import begin_list, list_files
    from fp8sim.training.config import ConfigError, TrainConfig
    from fp8sim.training.model import GPTConfig
    from fp8sim.recipes import get_recipe

    if not get_recipe(recipe).is_fp8:  # an unknown name: get_recipe's error, naming the known ones
        raise ArgumentError.about("recipe", f" must be an FP8 recipe, got {recipe!r}")
    if size not in SIZES:
        raise ArgumentError.about("size", f" must be one of {', '.join(SIZES)}, got {size!r}")
    model_kw, batch_size, default_steps = SIZES[size]
    steps = default_steps if steps is None else steps
    quick = size == "quick"
    if not quick and type(steps) is int and steps < 10:
        raise ArgumentError.about("steps", f" must be >= 10, got {steps}")
    model = GPTConfig(**model_kw)
    try:  # every value checked before the previous report is touched
        base = dict(steps=steps, seed=seed, model=model, eval_every=max(10, steps // 6), eval_batches=4,
                    checkpoint_every=max(10, steps // 3), batch_size=batch_size)
        TrainConfig(recipe=recipe, **base)
    except ConfigError as exc:
        raise ArgumentError.about(exc.field, f" {exc.rule}") from None
    except TypeError:  # steps // 6 of a string
        raise ArgumentError.about("steps", f" must be an integer, got {steps!r}") from None
    with output_dir(out, "--out") as out:
        _clear_previous_report(out)
        begin_list(out, REPORT_LIST, REPORT_SCHEMA)
        try:
            fig = _demo(out, recipe, base, quick, progress)
        except BaseException:  # what this run wrote so far, listed too: a rerun removes exactly that
            try:
                list_files(out, REPORT_LIST, REPORT_SCHEMA)
            except OSError:  # a full disk, say: the list stays incomplete, and a rerun refuses
                pass  # rather than guess (the first error is the one said)
            raise
        list_files(out, REPORT_LIST, REPORT_SCHEMA)
        return fig


def _demo(out: Path, recipe: str, base: dict, quick: bool, progress: bool | None) -> dict:
    """The demo's work into ``out`` (ready and held: see :func:`run_demo`)."""
    import torch

    from fp8sim.analysis.api import analyze
    from fp8sim.analysis.replay_api import replay
    from fp8sim.analysis.plots import plot_heatmap, plot_policy_summary
    from fp8sim.training import record
    from fp8sim.training.compare import compare_runs, plot_loss_curves
    from fp8sim.training.data import load_corpus
    from fp8sim.training.trainer import TrainConfig, Trainer

    t0 = time.perf_counter()
    model, steps = base["model"], base["steps"]
    corpus = load_corpus(max_bytes=(1 << 20) if quick else None)
    _msg(f"corpus {corpus.source}: {corpus.num_bytes:,} bytes from {corpus.num_files} files -> {out}")

    # the report's directories are made here without following links (never written through one)
    runs = {"bf16": owned_dir(out, "runs/bf16"), "fp8_torch": owned_dir(out, f"runs/{recipe}-torch"),
            "fp8_emulator": owned_dir(out, f"runs/{recipe}-emulator")}
    traces = {"bf16": owned_dir(out, "traces/bf16"), "fp8_torch": owned_dir(out, f"traces/{recipe}-torch")}
    step1_codes: dict[str, dict] = {}
    timings = {}
    for key, rec_name, backend in (("bf16", "bf16", "emulator"), ("fp8_torch", recipe, "torch"),
                                   ("fp8_emulator", recipe, "emulator")):
        cfg = TrainConfig(recipe=rec_name, backend=backend, **base)
        # the emulator run: the same config (learning-rate schedule included), its first steps
        stop = EMULATOR_STEPS if key == "fp8_emulator" and steps > EMULATOR_STEPS else None
        factory = None
        if key in traces:
            def factory(m, _t=traces[key], _c=cfg):  # noqa: E306
                # statistics and histograms only, no full tensors: analyzing saved tensors would
                # compile the statistics kernels (about 30 s on a first run, measured) for little
                # the trace's histograms do not already say (verdict, replay: exact counts)
                return record(m, _t, chunk_steps=_c.checkpoint_every, save_every=0,
                              config={"run": _c.to_dict()})
        trainer = Trainer(cfg, runs[key], corpus=corpus, recorder_factory=factory)
        if trainer.fp8 is not None:
            seen = step1_codes.setdefault(key, {})

            def capture(name, role, x, cast, scale, op, _seen=seen, _st=trainer.fp8):
                if _st.step == 1:
                    _seen[name] = (op.codes.clone(), op.scale_inv.clone())

            trainer.fp8.taps.append(capture)
        _msg(f"training {rec_name} on {backend} for {stop or steps} steps" + (f" of {steps}" if stop else ""))
        ts = time.perf_counter()
        trainer.run(progress=progress, stop_after=stop)
        timings[key] = time.perf_counter() - ts

    # -- emulator vs torch ------------------------------------------------------------------
    a, b = step1_codes["fp8_torch"], step1_codes["fp8_emulator"]
    same = [n for n in a if n in b and torch.equal(a[n][0], b[n][0]) and torch.equal(a[n][1], b[n][1])]
    backends = compare_runs(runs["fp8_torch"], runs["fp8_emulator"])
    vs_bf16 = compare_runs(runs["bf16"], runs["fp8_torch"])

    # -- analyze, replay, compare -----------------------------------------------------------
    plots = owned_dir(out, "plots")
    _msg("analyzing the FP8 trace")
    analysis = analyze(str(traces["fp8_torch"]))
    analysis.to_json(out / "analyze.json")
    _msg(f"analysis: {analysis.summary_line()}")
    summary = analysis.traces[0]
    for key in ("underflow", "overflow"):  # one heatmap each: the trace as recorded
        st, mat = summary.grid(key)
        plot_heatmap(plots / f"{key}_recorded.png", f"{recipe} trace: recorded {key} share (%)",
                     summary.row_labels(), st, mat)  # fmt: skip
    _msg("replaying scaling policies over the FP8 trace")
    replayed = replay(str(traces["fp8_torch"]), list(REPLAY_POLICIES))
    summaries = [p.to_dict() for p in replayed.policies]
    plot_policy_summary(plots / "policies.png", summaries)
    replayed_bf16 = replay(str(traces["bf16"]), list(REPLAY_POLICIES[:3]))
    loss_png = plot_loss_curves([runs["bf16"], runs["fp8_torch"], runs["fp8_emulator"]], plots / "loss_curves.png",
                                title=f"bf16 vs {recipe} (torch and emulator backends)")

    # -- figures and report ------------------------------------------------------------------
    fig = {
        "steps": steps,
        "model": model.to_dict(),
        "batch": [base["batch_size"], model.block_size],
        "corpus_bytes": corpus.num_bytes,
        "wall_s": round(time.perf_counter() - t0, 1),
        "train_s": {k: round(v, 1) for k, v in timings.items()},
        "fp8_vs_bf16": {
            "final_loss_bf16": vs_bf16["final_loss"]["a"],
            "final_loss_fp8": vs_bf16["final_loss"]["b"],
            "final_loss_rel": vs_bf16["final_loss"]["rel"],
            "smoothed_rel": vs_bf16["final_loss_smoothed"]["rel"],
            "val_loss_rel": vs_bf16["val_loss"]["rel"],
            "within_2pct": abs(vs_bf16["final_loss"]["rel"]) <= 0.02,
        },
        "emulator_vs_torch": {
            "step1_casts": len(a),
            "step1_identical": len(same),
            "codes_identical_step1": len(same) == len(a) == len(b) and len(a) > 0,
            "max_rel_loss_diff": backends["max_abs_rel_loss_diff"],
            "within_1e-3": (backends["max_abs_rel_loss_diff"] or 0.0) <= 1e-3,
        },
        "memory_bytes_per_param": vs_bf16["memory_bytes_per_param"],
        "events": vs_bf16["events"],
        "analysis": analysis.counts | {"what_if_rows": analysis.what_if_rows},
        # the run's overflowing values, counted three ways: they are the same casts
        "overflow_counted_by": {
            "compare": vs_bf16["events"]["b"]["overflow_total"],
            "replay_recorded": int(replayed.policies[0].overflow),
            "analyze_trace": sum(t.overflow for t in summary.tensors if not t.what_if),
        },
        "replay": summaries,
    }
    summary_json = json.dumps(fig, indent=2, default=str) + "\n"
    atomic_write(out / "summary.json", lambda f: f.write(summary_json.encode()))
    write_report(out, recipe, fig, vs_bf16, backends, analysis, replayed, replayed_bf16, loss_png)
    _msg(f"wrote {out / 'summary.md'} ({fig['wall_s']} s)")
    return fig


def _clear_previous_report(out: Path) -> None:
    """Make ``out`` (a directory) ready for a report: empty, or a previous demo report, whose own
    files are removed. Anything else is refused, and nothing is removed then."""
    from fp8sim.owned_tree import clear_listed, has_list

    entries = sorted(os.listdir(out))
    if not entries:
        return
    if not has_list(out, REPORT_LIST):
        raise ValueError(f"--out {out}: exists and is not an empty directory or a demo report (it holds "
                         f"{entries[0]!r}); the demo writes its report into a new one")  # fmt: skip
    clear_listed(out, REPORT_LIST, REPORT_SCHEMA, "--out")
    _msg(f"replaced the previous report in {out}")


def run(args: argparse.Namespace) -> int:
    from fp8sim.errors import spelled_as

    size = "quick" if args.quick else "full" if args.full else "default"
    with spelled_as({"steps": "--steps", "recipe": "--recipe", "seed": "--seed"}):
        fig = run_demo(args.out, steps=args.steps, recipe=args.recipe, seed=args.seed, size=size,
                       progress=None)  # a bar on a terminal, else lines (stdout keeps the JSON)
    if args.json:
        print(json.dumps(fig, indent=2, default=str))
    else:
        t, e = fig["fp8_vs_bf16"], fig["emulator_vs_torch"]
        print(f"report          {Path(args.out) / 'summary.md'}")
        print(f"final loss      bf16 {t['final_loss_bf16']:.4f}  {args.recipe} {t['final_loss_fp8']:.4f}  "
              f"({t['final_loss_rel']:+.2%})")
        print(f"backends        step-1 codes identical: {e['step1_identical']}/{e['step1_casts']}; "
              f"max rel loss diff {e['max_rel_loss_diff']:.2e}")
    return 0
