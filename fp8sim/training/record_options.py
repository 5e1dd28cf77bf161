"""What :func:`fp8sim.training.record` records, checked: its sampling, role and layer
arguments (:class:`~fp8sim.errors.ArgumentError` naming the argument), and whether a trace it
would append to is this run's."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import torch.nn as nn

from fp8sim.errors import ArgumentError

__all__ = ["RECORDED_ROLES", "LayerFilter", "check_interval", "check_roles", "select_layers", "check_same_run"]

#: the roles a recorder captures, in the order its ``roles`` argument lists them
RECORDED_ROLES = ("activation", "weight", "grad_output", "weight_grad")
#: a layer filter: glob patterns on layer names, or ``f(name, module) -> bool``
LayerFilter = Union[str, Sequence[str], Callable[[str, nn.Module], bool]]


def check_interval(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError.about(name, f" must be an int >= {least}, got {value!r}")
    return value


def check_roles(roles: str | Iterable[str] | None) -> tuple[str, ...]:
    if roles is None:
        return RECORDED_ROLES
    items = [r.strip() for r in roles.split(",")] if isinstance(roles, str) else list(roles)
    bad = [r for r in items if r not in RECORDED_ROLES]
    if bad or not items:
        what = f"unknown role {bad[0]!r}" if bad else "no role given"
        raise ArgumentError.about("roles", f": {what}; valid: {', '.join(RECORDED_ROLES)}")
    return tuple(r for r in RECORDED_ROLES if r in items)


def select_layers(layers: LayerFilter | None, candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The candidates ``layers`` picks; ArgumentError for a pattern that matches no layer."""
    if layers is None:
        return candidates
    if callable(layers):
        picked = [(n, m) for n, m in candidates if layers(n, m)]
        if not picked:
            raise ArgumentError.about("layers", f": the filter picks none of the {len(candidates)} layers")
        return picked
    patterns = [layers] if isinstance(layers, str) else list(layers) if isinstance(layers, (list, tuple)) else None
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise ArgumentError.about("layers", f": glob patterns (str) or a function (name, module) -> bool, "
                                            f"got {layers!r:.60}")  # fmt: skip
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n, _ in candidates):
            names = ", ".join(n for n, _ in candidates[:6]) + (", ..." if len(candidates) > 6 else "")
            raise ArgumentError.about("layers", f": {p!r} matches no layer (layers: {names or 'none'})")
    return [(n, m) for n, m in candidates if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def check_same_run(path: Path, meta: dict) -> None:
    """Refuse to append to (and so cut back) a trace that another run recorded: the run id (else
    the run config: a run's config changes when it is extended), run directory (as a real path),
    rank and world stored in its trace.json must be this run's where both say."""
    import json

    from fp8sim.input_files import read_json
    from fp8sim.trace import layout

    try:
        old = read_json(path / "trace.json", layout.MAX_TRACE_JSON_BYTES, what="trace.json").get("config", {})
    except (OSError, ValueError, AttributeError):
        return  # no trace yet (or not ours to judge: the writer refuses a damaged one)
    same = {
        "run": lambda a, b: a == json.loads(json.dumps(b)),
        "run_dir": lambda a, b: os.path.realpath(str(a)) == os.path.realpath(str(b)),
        "rank": lambda a, b: a == b,
        "world": lambda a, b: a == b,
        "run_id": lambda a, b: a is None or b is None or a == b,
    }
    ids = isinstance(old, dict) and bool(old.get("run_id")) and bool(meta.get("run_id"))
    for key, eq in same.items():
        if key == "run" and ids:
            continue  # the run's identity says it
        if isinstance(old, dict) and key in old and key in meta and not eq(old[key], meta[key]):
            raise ValueError(f"--record {path}: holds the trace of another run (its {key} differs: "
                             f"{str(old[key])[:80]}); a resumed run appends only to its own trace")  # fmt: skip
