"""A run directory: what it holds, how a run starts in it, and reading and writing its files.

A run directory (``fp8sim train --out``) holds:

* ``config.json``: the run's :class:`~fp8sim.training.config.TrainConfig` fields, and two more
  keys: ``run_id`` (the run's identity, made when it begins: every checkpoint carries it, and a
  checkpoint of another run is refused) and ``options`` (what the command line stores besides the
  config so that ``--resume`` continues the run as it was asked for: ``--record``,
  ``--save-every``, ``--nproc``, ...; see :data:`fp8sim.commands.train.RUN_OPTIONS`);
* ``metrics.jsonl``: one row per step (:func:`read_metrics`);
* ``checkpoint.pt`` (one process) or ``checkpoint/`` (data-parallel ranks);
* ``run.json``: the summary, written when the run has run its last step (:func:`read_summary`).

Every file here is fp8sim's own: written whole or not at all, never through a link
(:mod:`fp8sim.atomic_file`).
"""

from __future__ import annotations

import io
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from fp8sim.atomic_file import atomic_write
from fp8sim.input_files import open_regular, read_json
from fp8sim.training.checkpoint import CHECKPOINT_NAME
from fp8sim.training.config import ConfigError, TrainConfig

__all__ = ["RUN_CONFIG", "read_metrics", "write_metrics", "check_metrics_cover", "write_json", "run_begun",
           "start_mode", "check_summary", "read_summary", "new_run_id", "write_run_config", "read_run_config",
           "read_run_identity", "stored_config", "split_run_config", "say_finished"]  # fmt: skip

#: the run's configuration file
RUN_CONFIG = "config.json"
#: the keys of config.json that are no TrainConfig field
_RUN_KEYS = ("run_id", "options")


def new_run_id() -> str:
    """A new run's identity: 32 random hex digits."""
    return uuid.uuid4().hex


def split_run_config(stored: dict) -> tuple[dict, str | None, dict | None]:
    """(TrainConfig fields, run id, options) of a config.json object (an older run's has neither
    run id nor options: None). ValueError for a run id or options of the wrong type."""
    cfg = {k: v for k, v in stored.items() if k not in _RUN_KEYS}
    run_id, options = stored.get("run_id"), stored.get("options")
    if run_id is not None and not (isinstance(run_id, str) and run_id):
        raise ValueError(f"run_id {json.dumps(run_id)[:40]} is not a string")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"options {json.dumps(options)[:40]} is not an object")
    return cfg, run_id, options


def write_run_config(out: Path, cfg: TrainConfig, run_id: str, options: dict | None) -> None:
    """Write ``out/config.json`` (see the module docstring), whole or not at all."""
    write_json(out / RUN_CONFIG, {**cfg.to_dict(), "run_id": run_id, "options": dict(options or {})})


def stored_config(fields: dict, like: TrainConfig | None = None) -> TrainConfig:
    """The TrainConfig of stored ``fields`` (a config.json's, a checkpoint's). A custom recipe is
    stored as its ``to_dict()``, which cannot be built back into the object: where it is
    ``like``'s recipe, ``like``'s object stands for it (ConfigError otherwise, saying so)."""
    recipe = fields.get("recipe")
    if like is not None and isinstance(recipe, dict) and recipe == like.to_dict()["recipe"]:
        fields = {**fields, "recipe": like.recipe}
    return TrainConfig.from_dict(fields)


def read_run_config(out: Path, like: TrainConfig | None = None) -> tuple[TrainConfig, str | None, dict | None]:
    """(config, run id, options) of ``out/config.json`` (``like``: see :func:`stored_config`).
    FileNotFoundError when absent; ValueError ``"<out>/config.json is not an fp8sim run config
    (...)"`` for anything that is not one (another program's config.json, a damaged or
    hand-edited one with a bad value), or, for a custom recipe's run, the line saying how to
    resume it."""
    path = out / RUN_CONFIG
    fields, run_id, options = read_run_identity(out)
    try:
        cfg = stored_config(fields, like)
    except (ConfigError, TypeError) as exc:
        if isinstance(exc, ConfigError) and exc.field == "recipe" and isinstance(fields.get("recipe"), dict):
            raise ValueError(f"{path}: {exc}") from None  # a custom recipe's run: how to resume it
        raise ValueError(f"{path} is not an fp8sim run config ({exc})") from None
    return cfg, run_id, options


def read_run_identity(out: Path) -> tuple[dict, str | None, dict | None]:
    """(TrainConfig fields as stored, run id, options) of ``out/config.json``, the fields not yet
    checked; errors as :func:`read_run_config`."""
    path = out / RUN_CONFIG
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no run config")
    try:
        stored = read_json(path, 1 << 20, what="run config")
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
        return split_run_config(stored)
    except ValueError as exc:
        why = str(exc)
        if why.startswith(str(path)):
            why = why[len(str(path)):].lstrip(": ")
        raise ValueError(f"{path} is not an fp8sim run config ({why})") from None


def say_finished(out: Path, steps: int) -> None:
    """The line a resumed run that has nothing left to do says (on stderr)."""
    print(f"fp8sim train: {out}: the run is finished ({steps} of {steps} steps); nothing changed "
          f"(--steps M with M > {steps} extends it)", file=sys.stderr)  # fmt: skip


#: metrics row fields that are numbers when present
_METRIC_NUMBERS = ("val_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "overflow", "underflow")


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (FileNotFoundError when absent). A last line cut
    short (no newline: the run was killed while writing it) is left out; any other row that is
    not a JSON object with an int ``step`` and a numeric ``loss`` raises ValueError naming the
    file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    rows = []
    with open_regular(path) as f:  # a FIFO: refused, never opened
        lines = io.TextIOWrapper(f, encoding="utf-8", errors="replace").readlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            if i == len(lines) and not line.endswith("\n"):
                break  # the row a killed run was writing
            raise ValueError(f"{path}:{i}: corrupt metrics row ({exc})") from None
        if not (isinstance(row, dict) and type(row.get("step")) is int and _number(row.get("loss"))):
            raise ValueError(f"{path}:{i}: corrupt metrics row (needs an int step and a numeric loss)")
        if row["step"] < 0:
            raise ValueError(f"{path}:{i}: corrupt metrics row (step {row['step']} < 0)")
        odd = [k for k in _METRIC_NUMBERS if k in row and not _number(row[k])]
        if odd:
            raise ValueError(f"{path}:{i}: corrupt metrics row ({odd[0]} is not a number)")
        rows.append(row)
    return rows



def check_metrics_cover(out: Path, rows: list[dict], step: int, where: Path) -> None:
    """ValueError unless ``rows`` (metrics.jsonl's, up to the checkpoint) hold steps 1..``step``,
    each once: the rows a resumed run keeps must be the run's own, every step of it (a
    checkpoint copied from another run, or metrics.jsonl from another run, would mix two runs)."""
    steps = [r["step"] for r in rows]
    if steps != list(range(1, step + 1)):
        have = f"steps {steps[0]}..{steps[-1]} ({len(steps)} rows)" if steps else "no rows"
        raise ValueError(f"--resume: {out}/metrics.jsonl holds {have} but {where} is a checkpoint after step "
                         f"{step}: they are not of one run; refused (nothing changed)")  # fmt: skip


def _own_entry(out: Path, own: str | os.PathLike | None) -> str | None:
    """The entry of ``out`` that holds ``own`` (the run's ``--record`` directory), if it lies
    below ``out`` (real paths)."""
    if own is None:
        return None
    o, d = os.path.realpath(own), os.path.realpath(out)
    if not o.startswith(d.rstrip(os.sep) + os.sep):
        return None
    return os.path.relpath(o, d).split(os.sep)[0]


def _only_empty_directories(path: Path) -> bool:
    """Whether ``path`` is a directory (not a link) holding nothing but empty directories."""
    if path.is_symlink() or not path.is_dir():
        return False
    return all(_only_empty_directories(p) for p in path.iterdir())


def run_begun(out: Path) -> bool:
    """Whether a run has begun in ``out``: its config.json (or metrics.jsonl) is there."""
    return (out / "metrics.jsonl").is_file() or (out / RUN_CONFIG).is_file()


def start_mode(out: Path, resume: bool, *, data_parallel: bool, config: TrainConfig | None = None,
               own: str | os.PathLike | None = None) -> str:
    """How a run in ``out`` starts: ``"fresh"``, ``"resume"`` (from its checkpoint) or
    ``"restart"`` (``--resume`` of a run killed before its first checkpoint: nothing to resume,
    so it starts again from step 0; said on stderr). A run has begun in ``out`` once its
    config.json is written. Raises for an ``out`` that is a file, a fresh start into a
    directory that is not empty (a run's or anybody's files: a run would overwrite them), a
    resume with no run at all, a checkpoint of the other kind (single-process vs data-parallel:
    resuming it the wrong way would start over and lose it), and a restart whose config.json is
    not ``config`` (another run's, or not a run's) or whose run finished (run.json)."""
    from fp8sim.training.dist_checkpoint import latest_checkpoint

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    begun = run_begun(out)
    if not resume:
        if begun:
            raise ValueError(f"{out} already holds a run; resume it (--resume) or choose another output directory")
        entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        mine = _own_entry(out, own)
        if mine in entries and _only_empty_directories(out / mine):
            entries.remove(mine)  # this run's trace directory inside --out, just made (and held)
        if entries:
            raise ValueError(f"--out {out}: exists and is not empty ({len(entries)} entries, e.g. "
                             f"{entries[0]!r}); a new run goes into a new or empty directory")  # fmt: skip
        return "fresh"
    single, info = (out / CHECKPOINT_NAME).is_file(), latest_checkpoint(out)
    if data_parallel and info is None and single:
        raise ValueError(f"--resume: {out} holds a single-process checkpoint; resume it without --nproc "
                         "(and with a single-process recipe)")  # fmt: skip
    if not data_parallel and not single and info is not None:
        raise ValueError(f"--resume: {out} was checkpointed by {info['world']} data-parallel rank(s); "
                         f"resume it with --nproc {info['world']}")  # fmt: skip
    if (info is not None) if data_parallel else single:
        return "resume"
    if not begun:
        raise FileNotFoundError(f"--resume: {out} holds no run to resume (no checkpoint, no config.json)")
    _check_restart(out, config)
    print(f"fp8sim train: {out}: no checkpoint yet; starting again from step 0", file=sys.stderr)
    return "restart"


def _check_restart(out: Path, config: TrainConfig | None) -> None:
    """A restart overwrites ``out``'s metrics and config: only for the same run (or the same run
    extended: :meth:`TrainConfig.continues`), unfinished."""
    if (out / "run.json").is_file():
        raise ValueError(f"--resume: {out} holds a finished run (run.json) whose checkpoint is gone: "
                         "nothing to resume, and starting it again would overwrite it")  # fmt: skip
    if config is None:
        return
    try:
        old = read_run_config(out, like=config)[0]
    except FileNotFoundError:
        return  # metrics.jsonl alone: a run killed before it wrote its config
    except ValueError as exc:
        raise ValueError(f"--resume: {exc}") from None
    if not config.continues(old):
        diff = sorted(k for k, v in config.to_dict().items() if old.to_dict().get(k) != v)
        raise ValueError(f"--resume: {out} holds a run of another config (differs in {diff})")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: run.json fields and what each must be when present: a number, a count (int >= 0), an object
#: of numbers, or an object
_SUMMARY_FIELDS = {
    "final_loss": "number", "final_val_loss": "number", "median_step_time_s": "number",
    "wall_s": "number", "overflow": "count", "underflow": "count", "steps_done": "count",
    "parameters": "count", "nproc": "count", "memory_bytes_per_param": "numbers",
    "comm_bytes_per_step": "numbers", "config": "object", "recipe": "object",
}  # fmt: skip
#: the entries a memory / communication figure needs (what the reports show)
_SUMMARY_PARTS = {"memory_bytes_per_param": ("weights", "grads", "optimizer", "total"),
                  "comm_bytes_per_step": ("wgrad_fp8", "scales", "grads_other", "weights")}  # fmt: skip
#: entries that are numbers when present
_SUMMARY_OPTIONAL = {"memory_bytes_per_param": ("master", "fp8lm"),
                     "comm_bytes_per_step": ("wgrad_fp8_vs_bf16",)}  # fmt: skip


def check_summary(path: Path, summary: Any, *, finished: bool = False) -> dict:
    """``summary`` (a run.json read back from ``path``) if its fields are what a run writes (see
    :data:`_SUMMARY_FIELDS`; null allowed for numbers), else ValueError ``"<path>: corrupt
    run.json: ..."``. ``finished``: the fields a finished run's summary always has must be there."""

    def bad(what: str) -> None:
        raise ValueError(f"{path}: corrupt run.json: {what}")

    if not isinstance(summary, dict):
        bad(f"a {type(summary).__name__}, not an object")
    if finished:
        missing = [k for k in ("final_loss", "final_val_loss", "overflow", "underflow",
                               "memory_bytes_per_param", "median_step_time_s") if k not in summary]  # fmt: skip
        if missing:
            bad(f"no {', '.join(missing)}")
    for key, kind in _SUMMARY_FIELDS.items():
        v = summary.get(key)
        if v is None:
            continue
        ok = {"number": _number(v), "count": type(v) is int and v >= 0, "object": isinstance(v, dict),
              "numbers": isinstance(v, dict) and all(_number(v.get(p)) for p in _SUMMARY_PARTS.get(key, ()))
              and all(_number(v[p]) for p in _SUMMARY_OPTIONAL.get(key, ()) if v.get(p) is not None),
              }[kind]  # fmt: skip
        if not ok:
            want = {"number": "a number", "count": "an int >= 0", "object": "an object",
                    "numbers": f"an object with the numbers {', '.join(_SUMMARY_PARTS.get(key, ()))}"}[kind]
            bad(f"{key} is {json.dumps(v)[:60]}, not {want}")
    return summary


def read_summary(path: Path) -> dict:
    """A finished run's run.json, checked (:func:`check_summary`)."""
    return check_summary(path, read_json(path, what="run.json"), finished=True)


def write_metrics(out: Path, rows: list[dict]) -> None:
    """Replace ``out/metrics.jsonl`` with ``rows``, whole or not at all (a failed rewrite, a
    full disk, keeps every old row)."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    atomic_write(out / "metrics.jsonl", lambda f: f.write(text.encode()))


def write_json(path: Path, obj: dict) -> None:
    """``obj`` as indented JSON into ``path``, whole or not at all (fp8sim's own file: a link
    there is refused, never written through)."""
    text = json.dumps(obj, indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
