"""Compare two training runs: loss curves, final loss delta, memory per parameter, FP8 events.

Reads only the run directories (``metrics.jsonl``, ``run.json``, see
:mod:`fp8sim.training.trainer`); the memory figures are the ones the trainer measured from the
live tensors at the end of the run.
"""

from __future__ import annotations

import os
from pathlib import Path

from fp8sim.input_files import read_json
from fp8sim.nan_aware import max_or_nan, nan_steps

from fp8sim.training.run_dir import check_summary, read_metrics

__all__ = ["load_run", "compare_runs", "plot_loss_curves", "format_comparison"]


def load_run(run_dir: str | os.PathLike) -> dict:
    """``{"dir", "name", "metrics": [rows], "summary": run.json or {}}`` of a run directory."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: metrics.jsonl is empty")
    summary = check_summary(run_dir / "run.json", _read_json(run_dir / "run.json"))  # typed figures
    cfg = summary.get("config") or _read_json(run_dir / "config.json")
    if not isinstance(cfg, dict):
        raise ValueError(f"{run_dir}: corrupt run: its config is not a JSON object")
    name = f"{cfg.get('recipe', '?')}/{cfg.get('backend', '?')}" if cfg else run_dir.name
    return {"dir": str(run_dir), "name": name, "metrics": rows, "summary": summary}


def _read_json(path: Path) -> dict:
    """A JSON object file ({} when absent); ValueError naming it when it is no JSON object, or no
    regular file (a FIFO is never opened), or longer than :data:`fp8sim.input_files.MAX_JSON_BYTES`."""
    if not os.path.lexists(path):
        return {}
    obj = read_json(path, what="JSON file")
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: corrupt: not a JSON object")
    return obj


def _smoothed_final(rows: list[dict], window: int) -> float:
    """Mean training loss over the last ``window`` steps (the per-batch loss is noisy)."""
    tail = [r["loss"] for r in rows[-window:]]
    return sum(tail) / len(tail)


def _events(rows: list[dict]) -> dict:
    over = [r.get("overflow", 0) for r in rows]
    under = [r.get("underflow", 0) for r in rows]
    return {
        "overflow_total": int(sum(over)),
        "underflow_total": int(sum(under)),
        "steps_with_overflow": int(sum(1 for v in over if v)),
        "first_overflow_step": next((r["step"] for r, v in zip(rows, over) if v), None),
        "fp8": any("overflow" in r for r in rows),
    }


def compare_runs(run_a: str | os.PathLike, run_b: str | os.PathLike, *, window: int = 10) -> dict:
    """Numbers comparing run B against run A (A is the reference).

    ``final_loss``: the last step's training loss; ``final_loss_smoothed``: the mean over the
    last ``window`` steps; ``*_delta``: B - A, ``*_rel``: (B - A) / A. ``val_loss``: the last
    evaluation. ``memory``: bytes per parameter (weights, grads, optimizer states, total).
    ``max_abs_rel_loss_diff``: max over common steps of |B - A| / |A| of the training loss (NaN
    when either run has a NaN loss at a common step). ``nan_loss_steps``: per run, the steps whose
    training loss is NaN.
    """
    a, b = load_run(run_a), load_run(run_b)
    out: dict = {"a": a["name"], "b": b["name"], "a_dir": a["dir"], "b_dir": b["dir"]}
    for key, fn in (
        ("final_loss", lambda r: r["metrics"][-1]["loss"]),
        ("final_loss_smoothed", lambda r: _smoothed_final(r["metrics"], window)),
        ("val_loss", lambda r: next((m["val_loss"] for m in reversed(r["metrics"]) if "val_loss" in m), None)),
    ):
        va, vb = fn(a), fn(b)
        out[key] = {"a": va, "b": vb}
        if va is not None and vb is not None:
            out[key]["delta"] = vb - va
            out[key]["rel"] = (vb - va) / va if va else None
    la = {r["step"]: r["loss"] for r in a["metrics"]}
    common = [(r["step"], la[r["step"]], r["loss"]) for r in b["metrics"] if r["step"] in la]
    out["common_steps"] = len(common)
    # steps with a zero reference loss have no relative difference; a NaN loss on either side
    # makes the maximum NaN (Python's max would skip it), and its steps are named
    out["max_abs_rel_loss_diff"] = max_or_nan((abs(y - x) / abs(x) for _, x, y in common if x), default=None)
    out["nan_loss_steps"] = {k: nan_steps((m["step"], m["loss"]) for m in r["metrics"])
                             for k, r in (("a", a), ("b", b))}  # fmt: skip
    out["memory_bytes_per_param"] = {
        "a": a["summary"].get("memory_bytes_per_param"),
        "b": b["summary"].get("memory_bytes_per_param"),
    }
    # distributed runs (fp8sim.training.distributed): mean bytes one rank sent per step
    out["comm_bytes_per_step"] = {
        "a": a["summary"].get("comm_bytes_per_step"),
        "b": b["summary"].get("comm_bytes_per_step"),
    }
    out["events"] = {"a": _events(a["metrics"]), "b": _events(b["metrics"])}
    out["median_step_time_s"] = {
        "a": a["summary"].get("median_step_time_s"),
        "b": b["summary"].get("median_step_time_s"),
    }
    return out


def plot_loss_curves(runs: list[str | os.PathLike], path: str | os.PathLike, *, title: str = "training loss") -> Path:
    """PNG of the training loss (and validation points) of each run against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(runs):
        r = load_run(run)
        rows = r["metrics"]
        color = f"C{i}"
        ax.plot([m["step"] for m in rows], [m["loss"] for m in rows], color=color, lw=1, alpha=0.8, label=r["name"])
        val = [(m["step"], m["val_loss"]) for m in rows if "val_loss" in m]
        if val:
            ax.plot(*zip(*val), "o--", color=color, ms=4, lw=0.8, label=f"{r['name']} (val)")
    ax.set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from fp8sim.atomic_file import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def _fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def _mem(m: dict | None, part: str) -> float | None:
    """A memory figure; runs of the single-process trainer have no separate masters (0) and
    FP8-LM's count (masters + grads + moments) is then their total."""
    if not m:
        return None
    if part == "master":
        return m.get("master", 0.0)
    if part == "fp8lm":
        return m.get("fp8lm", m["total"])
    return m[part]


def _comm_total(d: dict) -> float:
    return sum(v for k, v in d.items() if k in ("wgrad_fp8", "scales", "grads_other", "weights"))


def format_comparison(c: dict) -> str:
    """The comparison as aligned text lines (for stdout and the demo's report)."""
    lines = [f"A: {c['a']}  ({c['a_dir']})", f"B: {c['b']}  ({c['b_dir']})", ""]
    lines.append(f"{'':28}{'A':>12}{'B':>12}{'B-A':>12}{'rel':>10}")
    for key in ("final_loss", "final_loss_smoothed", "val_loss"):
        d = c[key]
        lines.append(
            f"{key:28}{_fmt(d['a']):>12}{_fmt(d['b']):>12}{_fmt(d.get('delta'), '+.4f'):>12}"
            f"{_fmt(d.get('rel'), '+.2%'):>10}"
        )
    lines.append(f"{'max |rel loss diff| (steps)':28}{_fmt(c['max_abs_rel_loss_diff'], '.2e'):>12}  over {c['common_steps']} common steps")
    for run in ("a", "b"):
        steps = c.get("nan_loss_steps", {}).get(run) or []
        if steps:
            more = f" and {len(steps) - 5} more" if len(steps) > 5 else ""
            lines.append(f"{'NaN loss in ' + run.upper():28}{len(steps):>12}  at step(s) "
                         f"{', '.join(map(str, steps[:5]))}{more}")
    ma, mb = c["memory_bytes_per_param"]["a"], c["memory_bytes_per_param"]["b"]
    for part in ("weights", "master", "grads", "optimizer", "total", "fp8lm"):
        lines.append(
            f"{'bytes/param ' + part:28}{_fmt(_mem(ma, part), '.2f'):>12}{_fmt(_mem(mb, part), '.2f'):>12}"
        )
    ca, cb = c.get("comm_bytes_per_step", {}).get("a"), c.get("comm_bytes_per_step", {}).get("b")
    if ca or cb:
        for label, fn in (("comm bytes/step (per rank)", _comm_total), ("  weight grads in FP8", lambda d: d["wgrad_fp8"] + d["scales"]),
                          ("  FP8 / BF16 weight grads", lambda d: d.get("wgrad_fp8_vs_bf16"))):
            lines.append(f"{label:28}{_fmt(ca and fn(ca), '.3g'):>12}{_fmt(cb and fn(cb), '.3g'):>12}")
    ea, eb = c["events"]["a"], c["events"]["b"]
    for key in ("overflow_total", "underflow_total", "steps_with_overflow", "first_overflow_step"):
        va = ea[key] if ea["fp8"] else None
        vb = eb[key] if eb["fp8"] else None
        lines.append(f"{key:28}{_fmt(va, 'd'):>12}{_fmt(vb, 'd'):>12}")
    ta, tb = c["median_step_time_s"]["a"], c["median_step_time_s"]["b"]
    lines.append(f"{'median step time (ms)':28}{_fmt(ta and ta * 1e3, '.1f'):>12}{_fmt(tb and tb * 1e3, '.1f'):>12}")
    return "\n".join(lines)
