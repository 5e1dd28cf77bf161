"""The demo's ``summary.md``: how to read it, the targets measured, then the tables of
``fp8sim compare``, ``fp8sim replay`` and ``fp8sim analyze`` with the plots beside them.

Every file the report names is one the demo wrote (``plots/*.png``, ``runs/``, ``traces/``,
``analyze.json``, ``summary.json``); :func:`named_files` lists them, and the demo's test checks
each exists.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fp8sim.atomic_file import atomic_write

__all__ = ["write_report", "how_to_read", "named_files"]


def how_to_read(recipe: str) -> list[str]:
    """The report's "How to read this" section (lines of markdown)."""
    from fp8sim.analysis.status import Thresholds

    th = Thresholds()
    return [
        "## How to read this",
        "",
        f"- **bf16 is the reference.** Both runs train the same model from the same initialisation on "
        f"the same batches; only the precision of the linear layers' matrix products differs. bf16 "
        f"is what such models are usually trained in, so \"{recipe} is fine\" means \"{recipe} reaches "
        "the loss bf16 reaches\".",
        f"- **Statuses** (the `status` column, the summary line). Each FP8 cast is judged by the share "
        f"of its values that overflow (clipped to the format's largest value: the casts saturate) and "
        f"that underflow (nonzero values that become 0). `critical`: overflow >= {th.overflow_critical:g}% "
        f"or underflow >= {th.underflow_critical:g}% of the values; `warning`: overflow >= "
        f"{th.overflow_warning:g}% or underflow >= {th.underflow_warning:g}%, or NaN/inf; `ok` otherwise "
        f"-- a handful of saturated values is `ok`. A traced tensor is `critical` when at least "
        f"{th.steps_critical:g}% of its steps are critical casts, `warning` when any step is a warning "
        "or worse. The first steps of a delayed-scaling run cast at scale 1 before any amax is known "
        "(the *warm-up*, often 90% underflow at step 1): they are shown apart and not judged. The "
        "thresholds come from injecting overflow and underflow into this model's casts and "
        "measuring the loss (docs/analysis.md, \"What the statuses mean\").",
        "- **Verdict words** (one line per layer and role): `ok` -- FP8 as recorded is fine; `needs "
        "margin N` -- the recorded scales overflowed at steps that matter, and N binades of headroom "
        "(scale / 2^N) remove it; `needs finer scaling` -- per-tensor scaling loses too many small "
        "values, per-row, per-block or MX scaling would keep them (`(estimate)`: judged from "
        "histograms, without saved tensors); `keep in higher precision` -- no FP8 scaling keeps "
        "this tensor.",
        f"- **What-if rows.** The trace also records the weight gradients, cast to E5M2 with "
        f"{recipe}'s policy, although {recipe} (like Transformer Engine) keeps weight gradients in "
        "high precision: they say what an FP8 weight gradient (FP8-LM) would face. They are listed "
        "apart, labelled `what-if`, and count in no summary, verdict or `--fail-on` unless asked "
        "for (`--what-if`).",
        "- **Counts agree.** `fp8sim compare`, `replay`'s `recorded` row and `analyze`'s trace table "
        "count the same casts (those the run performed), so their overflow totals are equal.",
        "",
    ]


def _code(text: str) -> list[str]:
    return ["```", text.rstrip(), "```", ""]


def write_report(out: Path, recipe: str, fig: dict, vs_bf16: dict, backends: dict, analysis: Any,
                 replayed: Any, replayed_bf16: Any, loss_png: Path) -> None:  # fmt: skip
    """Write ``out/summary.md`` (atomically) from the demo's figures and results."""
    from fp8sim.training.compare import format_comparison

    e, t = fig["emulator_vs_torch"], fig["fp8_vs_bf16"]
    ok = lambda b: "yes" if b else "**no**"  # noqa: E731
    m = fig["model"]
    counted = fig["overflow_counted_by"]
    lines = [
        f"# fp8sim demo: bf16 vs {recipe}",
        "",
        f"Byte-level GPT ({m['n_layer']} layers, {m['n_embd']} wide, context {m['block_size']}), "
        f"batch {fig['batch'][0]}x{fig['batch'][1]} bytes, {fig['steps']} steps, corpus "
        f"{fig['corpus_bytes']:,} bytes of Python standard-library source. Wall time {fig['wall_s']} s "
        f"(training: " + ", ".join(f"{k} {v} s" for k, v in fig["train_s"].items()) + ").",
        "",
        f"**Result:** {recipe} ends at {t['final_loss_rel']:+.2%} training loss (validation "
        f"{t['val_loss_rel']:+.2%}) against bf16; its FP8 casts: {analysis.summary_line()}.",
        "",
        *how_to_read(recipe),
        "## Targets (measured)",
        "",
        "| target | measured | met |",
        "| --- | --- | --- |",
        f"| {recipe} final training loss within 2% of bf16 | {t['final_loss_fp8']:.4f} vs {t['final_loss_bf16']:.4f} "
        f"({t['final_loss_rel']:+.2%}; last-10-step mean {t['smoothed_rel']:+.2%}, val {t['val_loss_rel']:+.2%}) "
        f"| {ok(t['within_2pct'])} |",
        f"| emulator vs torch backend: identical FP8 codes at step 1 | {e['step1_identical']} of {e['step1_casts']} casts "
        f"identical (codes and scale_inv) | {ok(e['codes_identical_step1'])} |",
        f"| emulator vs torch backend: loss curves within 1e-3 relative | max {e['max_rel_loss_diff']:.2e} over "
        f"{backends['common_steps']} steps | {ok(e['within_1e-3'])} |",
        "",
        f"![loss curves]({Path(loss_png).relative_to(out).as_posix()})",
        "",
        f"## bf16 vs {recipe} (`fp8sim compare`)",
        "",
        *_code(format_comparison(vs_bf16)),
        "Memory is measured from the live tensors at the end of each run: every recipe here keeps "
        "float32 master weights, gradients and AdamW moments (16 bytes per parameter); the FP8 "
        "recipes save uint8 activations for the backward pass, which this count does not include. "
        f"`overflow_total` counts the values the run's casts clipped: {counted['compare']:,} here, as "
        f"`replay`'s `recorded` row ({counted['replay_recorded']:,}) and the sum of `analyze`'s trace "
        f"table ({counted['analyze_trace']:,}) count them.",
        "",
        f"## Per-tensor statistics of the {recipe} trace (`fp8sim analyze`)",
        "",
        f"Summary: {analysis.summary_line()}.",
        "",
        *_code(analysis.table(top=40)),
        "![underflow share per tensor and step, as recorded](plots/underflow_recorded.png)",
        "",
        "![overflow share per tensor and step, as recorded](plots/overflow_recorded.png)",
        "",
        f"## Scaling policies replayed over the {recipe} trace (`fp8sim replay`)",
        "",
        "`recorded` is what the run did; every other row is what that policy would have done on the "
        "same tensors (exact counts for power-of-two scales, else a bracket). The replay covers the "
        "casts the run performed" + (f": it {replayed.what_if_note()}" if replayed.what_if_records else "") + ".",
        "",
        *_code(replayed.table()),
        "![policies](plots/policies.png)",
        "",
        f"The bf16 run recorded the same tensors through `fp8sim.training.record` (hooks on its "
        f"linear layers: nothing is cast; the casts are those {recipe} would make):",
        "",
        *_code(replayed_bf16.table()),
        "Files: " + _run_files(out) + "; `traces/` (the recorded traces: `fp8sim analyze traces/...`, "
        "`fp8sim replay traces/...`), `analyze.json` (the analysis as JSON), `summary.json` (the figures "
        "above), `plots/`.",
        "",
    ]
    text = "\n".join(lines)
    atomic_write(out / "summary.md", lambda f: f.write(text.encode()))


def _run_files(out: Path) -> str:
    """What each run folder holds, as it is (a run stopped early has no run.json, and no
    checkpoint before its first checkpoint step)."""
    order = ("config.json", "metrics.jsonl", "run.json", "checkpoint.pt")
    parts = []
    for run in sorted((out / "runs").iterdir()):
        held = [n for n in order if (run / n).is_file()]
        parts.append(f"`runs/{run.name}/` ({', '.join(held)})")
    return ", ".join(parts)


def named_files(markdown: str) -> list[str]:
    """The report-relative paths a ``summary.md`` names: its images and the ``runs/...``,
    ``traces/...``, ``plots/...`` and ``*.json`` names in backticks."""
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    quoted = re.findall(r"`((?:runs|traces|plots)/[^`\s]*|[a-z_]+\.json)`", markdown)
    for folder, held in re.findall(r"`(runs/[^`\s]+/)` \(([^)]*)\)", markdown):  # a run's files
        quoted += [folder + name.strip() for name in held.split(",")]
    return sorted(set(images) | {q.rstrip("/") for q in quoted if not q.endswith("...")})
