"""PNG plots (matplotlib, Agg backend: no display needed).

* :func:`plot_log2_histogram`: a tensor's log2|x| histogram against each format's representable
  window ``[min_subnormal, max] / scale`` (the window moves with the scale).
* :func:`plot_heatmap`: a tensor x step matrix (underflow or overflow share of a trace or replay).
* :func:`plot_policy_summary`: events and worst underflow per policy.

File names are made safe (``safe_name``) and numbered so tensors with similar names never collide.
A run's plot directory is a :class:`PlotDir`: it lists the PNGs it wrote in
``fp8sim-plots.json`` and removes those of the previous run there that it did not write again.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from typing import Sequence

import numpy as np

from fp8sim.atomic_file import atomic_write, save_figure

__all__ = ["PlotDir", "plot_log2_histogram", "plot_heatmap", "plot_policy_summary", "safe_name",
           "color_limit", "wrap_name", "integer_ticks"]

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str, index: int | None = None, limit: int = 80) -> str:
    s = _SAFE.sub("_", name).strip("._") or "tensor"
    s = s[:limit]
    return f"{index:04d}_{s}" if index is not None else s


def _label(text: str) -> str:
    """A tensor name or title as figure text: control characters escaped as the table writes
    them (no raw terminal escape in matplotlib's missing-glyph warnings), ``$`` taken literally
    (matplotlib would read ``$...$`` as mathtext, and refuse a malformed one)."""
    from fp8sim.analysis.report import escape_cell

    return escape_cell(text).replace("$", r"\$")


def wrap_name(name: str, width: int = 48) -> str:
    """A whole tensor or policy name as figure text, broken into lines of at most ``width``
    characters after ``.``, ``,``, ``:`` or ``_`` where possible: never cut or abbreviated."""
    text = _label(name)
    if len(text) <= width:
        return text
    parts = re.split(r"(?<=[.,:_/])", text)
    lines, cur = [], ""
    for part in parts:
        while len(part) > width:  # a run with no break point: split it hard
            if cur:
                lines.append(cur)
                cur = ""
            lines.append(part[:width])
            part = part[width:]
        if len(cur) + len(part) > width:
            lines.append(cur)
            cur = part
        else:
            cur += part
    if cur:
        lines.append(cur)
    return "\n".join(lines)


def color_limit(matrix: np.ndarray, quantile: float = 0.99) -> tuple[float, int]:
    """(top of the colour scale, number of cells above it) for a heatmap of shares.

    The top is the ``quantile`` of the finite values, so that a few extreme cells (a warm-up
    step where 93% of the values underflow) do not turn every other cell black; cells above it
    show in the top colour and are counted in the colour bar's label. All cells at or below
    it: the top is the maximum (nothing clipped)."""
    vals = np.asarray(matrix, dtype=float)
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return 1.0, 0
    top = float(np.max(vals))
    q = float(np.quantile(vals, quantile))
    if q <= 0 or q >= top:
        return (top if top > 0 else 1.0), 0
    return q, int(np.count_nonzero(vals > q))


class PlotDir:
    """The ``--plot`` directory of one run (made if missing).

    ``fp8sim-plots.json`` lists the PNGs of the directory's last run. Each PNG goes to
    :meth:`path`, which adds its name to that list before the PNG is written; :meth:`finish`
    then leaves only this run's names in the list and deletes the PNGs of earlier runs that
    this run did not write again, so the directory never mixes two runs' plots (a run stopped
    before :meth:`finish` leaves both runs' names listed: the next run clears them). Nothing else
    is ever deleted: only bare ``.png`` names of that directory that the list holds (not one
    this run wrote in another letter case, not a directory; an entry that cannot be removed is
    left); an unreadable list deletes nothing. From its making to :meth:`finish` the directory
    is held (:func:`fp8sim.output_dir.output_dir`): a second process plotting there is refused.
    """

    MANIFEST = "fp8sim-plots.json"

    def __init__(self, directory: str, option: str = "--plot"):
        from fp8sim.output_dir import output_dir

        self._held = contextlib.ExitStack()  # the directory's lock, until finish()
        self._held.enter_context(output_dir(directory, option))
        try:  # writable? asked before any work (a probe file, gone at once)
            tempfile.TemporaryFile(dir=directory).close()
        except OSError as exc:
            raise ValueError(f"{option} {directory}: not writable ({exc.strerror or exc})") from None
        self.dir = directory
        self._written: list[str] = []
        self._before = self._listed()

    def _listed(self) -> list[str]:
        try:
            from fp8sim.input_files import open_regular

            with open_regular(os.path.join(self.dir, self.MANIFEST)) as f:  # a FIFO: refused
                doc = json.loads(f.read(1 << 24))
        except (OSError, ValueError, RecursionError):
            return []
        if not isinstance(doc, dict) or doc.get("schema") != "fp8sim-plots":
            return []
        names = doc.get("png")
        if not isinstance(names, list):
            return []
        return [n for n in names if isinstance(n, str) and _plain_png(n)]

    def _write_list(self, names: list[str]) -> None:
        doc = {"schema": "fp8sim-plots", "png": sorted(set(names))}
        atomic_write(os.path.join(self.dir, self.MANIFEST),
                     lambda f: f.write(json.dumps(doc, indent=1).encode()),
                     links="replace")  # fmt: skip

    def path(self, name: str) -> str:
        """Where the PNG ``name`` (a bare file name ending in .png) goes; listed first."""
        if not _plain_png(name):
            raise ValueError(f"plot name {name!r}: expected a bare file name ending in .png")
        if name not in self._written:
            self._written.append(name)
            self._write_list(self._before + self._written)
        return os.path.join(self.dir, name)

    def __del__(self) -> None:
        held = getattr(self, "_held", None)
        if held is not None:
            held.close()

    def finish(self) -> None:
        """List only this run's PNGs, then delete the earlier runs' that it did not write; the
        directory is let go."""
        try:
            self._clear_earlier()
        finally:
            self._held.close()

    def _clear_earlier(self) -> None:
        self._write_list(self._written)
        mine = {n.casefold() for n in self._written}
        for name in sorted(set(self._before)):
            if name.casefold() in mine:
                continue
            p = os.path.join(self.dir, name)
            if os.path.isdir(p) and not os.path.islink(p):
                continue
            try:
                os.unlink(p)  # a link: the link only
            except OSError:
                pass  # gone already, or not ours to remove (permissions): left as it is


def _plain_png(name: str) -> bool:
    return (name.endswith(".png") and os.path.basename(name) == name and "\\" not in name
            and "\0" not in name and name != ".png")  # fmt: skip


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def integer_ticks(axis) -> None:
    """Ticks at whole numbers only (steps, counts, binades): never 2.5 or 7.5."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def plot_log2_histogram(
    path: str | os.PathLike,
    title: str,
    exponents: np.ndarray,
    counts: np.ndarray,
    windows: Sequence[tuple[str, float, float]],
) -> str:
    """Counts per binade ``floor(log2|x|)`` (top), and below it one bar per (label, lo, hi)
    window: the |x| range a format covers under its scale, ``[min_subnormal, max] / scale``.
    Values left of a window underflow (or lose precision as subnormals), right of it overflow.
    Returns the file path."""
    plt = _plt()
    n_w = max(1, len(windows))
    fig, (ax, aw) = plt.subplots(
        2, 1, figsize=(8, 3.2 + 0.28 * n_w), dpi=100, sharex=True,
        gridspec_kw={"height_ratios": [3, 0.35 * n_w + 0.3]},
    )  # fmt: skip
    try:
        nz = counts > 0
        lo_e, hi_e = (-10.0, 10.0)
        if nz.any():
            e, c = exponents[nz], counts[nz]
            ax.bar(e + 0.5, c, width=1.0, color="0.35")
            lo_e, hi_e = float(e.min()), float(e.max() + 1)
            ax.set_yscale("log")
        colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
        for i, (label, lo, hi) in enumerate(windows):
            if lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi):
                a, b = math.log2(lo), math.log2(hi)
                col = colors[i % len(colors)]
                aw.barh(i, b - a, left=a, height=0.6, color=col, alpha=0.6)
                aw.text(b + 0.3, i, label, va="center", fontsize=7)
                ax.axvline(b, color=col, lw=0.8, ls="--")
                lo_e, hi_e = min(lo_e, a), max(hi_e, b)
        aw.set_ylim(-0.6, n_w - 0.4)
        aw.invert_yaxis()
        aw.set_yticks([])
        aw.set_xlim(lo_e - 1, hi_e + 12)  # room for the labels
        aw.set_xlabel("log2 |x|   (bars: |x| range each format x scaling represents)")
        integer_ticks(aw.xaxis)
        ax.set_ylabel("values per binade")
        ax.set_title(_label(title), fontsize=9)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return str(path)


def plot_heatmap(
    path: str | os.PathLike,
    title: str,
    names: Sequence[str],
    steps: np.ndarray,
    matrix: np.ndarray,
    *,
    label: str = "share (%)",
) -> str:
    """Tensors (rows) x steps (columns) heatmap of ``matrix`` (NaN: no record). Returns path."""
    plt = _plt()
    labels = [wrap_name(n) for n in names]
    rows = sum(t.count("\n") + 1 for t in labels)
    h = min(40.0, 1.5 + 0.12 * max(1, rows) + 0.1 * max(1, len(names)))
    fig, ax = plt.subplots(figsize=(10, h), dpi=100)
    try:
        raw = np.asarray(matrix, dtype=float)
        top, above = color_limit(raw)
        data = np.ma.masked_invalid(raw)
        ext = [float(steps[0]) - 0.5, float(steps[-1]) + 0.5, len(names) - 0.5, -0.5] if len(steps) else None
        im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="magma", extent=ext,
                       vmin=0.0, vmax=top)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.set_xlabel("step")
        integer_ticks(ax.xaxis)
        if above:  # said where it is read: under the title
            note = (f"colour scale clipped at {top:.3g}: {above} cell(s) above it, up to "
                    f"{float(np.nanmax(raw)):.3g}, show in the top colour")
            ax.set_title(f"{_label(title)}\n{note}", fontsize=9)
            fig.colorbar(im, ax=ax, label=f"{label} (clipped)", extend="max")
        else:
            ax.set_title(_label(title), fontsize=9)
            fig.colorbar(im, ax=ax, label=label)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return str(path)


def plot_policy_summary(path: str | os.PathLike, summaries: Sequence[dict]) -> str:
    """Per policy: overflow events and worst / median underflow share. Returns path."""
    plt = _plt()
    labels = [wrap_name(s["policy"], 40) for s in summaries]  # whole names: margin=0 vs 1 differ
    rows = sum(t.count("\n") + 1 for t in labels)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.22 * max(rows, 2)), dpi=100,
                                 sharey=True)
    try:
        y = np.arange(len(labels))
        a1.barh(y, [s.get("events", 0) for s in summaries], color="tab:red")
        a1.set_title("overflow events (amax beyond max)", fontsize=9)
        integer_ticks(a1.xaxis)
        a2.barh(y - 0.2, [s.get("median_underflow_pct", 0) for s in summaries], 0.4, label="median")
        a2.barh(y + 0.2, [s.get("worst_underflow_pct", 0) for s in summaries], 0.4, label="worst")
        a2.set_title("underflow share (%)", fontsize=9)
        a2.legend(fontsize=7)
        a1.set_yticks(y)
        a1.set_yticklabels(labels, fontsize=7)
        a1.invert_yaxis()
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return str(path)
