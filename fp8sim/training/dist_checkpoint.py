"""Checkpoints of data-parallel runs with ``torch.distributed.checkpoint`` (DCP).

Layout in the run directory::

    checkpoint/step00000040/.metadata, __0_0.distcp, ...   DCP's files after 40 steps
    checkpoint/LATEST                                       {"step": 40, "world": 2}

Every rank writes its share collectively (``dcp.save``: sharded tensors -- FSDP2's parameters
and optimizer states -- once per shard, replicated ones once); after a barrier -- the step's
checkpoint is complete -- rank 0 moves ``LATEST`` to it (temp file + rename) and only then removes
the older step directories. A kill at any moment leaves ``LATEST`` naming a complete checkpoint.

What it holds (:func:`checkpoint_state`): the model's and the optimizer's state dicts as
``torch.distributed.checkpoint.state_dict`` gives them (keyed by parameter name, DTensors for
sharded ones), the FP8 state as tensors (:attr:`Fp8State.state_dict` through
:func:`~fp8sim.training.checkpoint.to_storable`: scaling-policy histories and scales, the step),
and the run's plain data (config, RNG, the FP8-LM gradient reducer's AutoScale state, ...). The
FP8 state and everything else but the sharded tensors is the same on every rank (the amaxes are
MAX-reduced across ranks), so DCP keeps one copy; per-rank entries carry their rank in the key.
DCP reshards on load, so a checkpoint resumes on another number of ranks.

Trust: DCP's ``.metadata`` and its non-tensor entries are pickles, so a resume trusts its own run
directory (as a training framework does); what fp8sim reads as untrusted input -- dumps and
traces given to ``analyze`` -- is never a DCP checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from fp8sim.atomic_file import atomic_write, owned_dir
from fp8sim.input_files import read_json

__all__ = ["CHECKPOINT_DIR", "checkpoint_state", "load_state", "save_state", "latest_checkpoint",
           "save_dcp_checkpoint", "load_dcp_checkpoint", "read_dcp_checkpoint", "read_extra"]

CHECKPOINT_DIR = "checkpoint"
_EXTRA_STATE = "._extra_state"


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step{step:08d}"


def checkpoint_state(model: torch.nn.Module, optimizer: Any, extra: dict | None = None) -> dict:
    """What :func:`save_state` writes: ``{"model", "optim", "fp8", "extra"}``.

    ``model``: its state dict by parameter name (DTensors under FSDP2), without the FP8 layers'
    ``_extra_state`` -- the FP8 state is ``fp8``, as tensors; ``optim``: the optimizer's, keyed
    by parameter name (``get_optimizer_state_dict``); ``extra``: plain data (nested dicts of
    tensors, numbers, strings)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from fp8sim.training.checkpoint import to_storable
    from fp8sim.training.convert import get_fp8_state

    fp8 = get_fp8_state(model)
    msd = {k: v for k, v in get_model_state_dict(model).items() if not k.endswith(_EXTRA_STATE)}
    return {"model": msd, "optim": get_optimizer_state_dict(model, optimizer) if optimizer is not None else {},
            "fp8": _keep_empty(to_storable(fp8.state_dict())) if fp8 is not None else {},
            "extra": _keep_empty(to_storable(extra or {}))}


#: what stands for an empty dict / list in a checkpoint: DCP's flattening drops empty containers
#: (a scaling policy's ``tensors`` before its first cast, a recorder without hypothetical casts)
_EMPTY = {"dict": "__fp8sim_empty_dict__", "list": "__fp8sim_empty_list__"}


def _keep_empty(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _keep_empty(v) for k, v in obj.items()} if obj else _EMPTY["dict"]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_keep_empty(v) for v in obj) if obj else _EMPTY["list"]
    return obj


def _restore_empty(obj: Any) -> Any:
    if isinstance(obj, str) and obj in _EMPTY.values():
        return {} if obj == _EMPTY["dict"] else []
    if isinstance(obj, dict):
        return {k: _restore_empty(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_restore_empty(v) for v in obj)
    return obj


def save_state(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any, extra: dict | None = None) -> None:
    """``dcp.save`` of :func:`checkpoint_state` into the directory ``path`` (collective when a
    process group exists: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    with _one_process_is_meant():
        dcp.save(checkpoint_state(model, optimizer, extra), checkpoint_id=str(path))


def load_state(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any) -> dict:
    """Restore a :func:`save_state` checkpoint into ``model`` and ``optimizer`` (resharded to
    their current layout) and its FP8 state; returns its ``extra`` part. ValueError naming
    ``path`` for a checkpoint that does not fit the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from fp8sim.training.checkpoint import from_storable
    from fp8sim.training.convert import get_fp8_state

    full = checkpoint_state(model, optimizer)
    state = {"model": full["model"], "optim": full["optim"]}  # loaded into the current layout
    try:
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=str(path))
            # the FP8 state and the plain data, whole on every rank, under the keys they were saved with
            plain = _load_state_dict_from_keys({"fp8", "extra"}, checkpoint_id=str(path))
    except Exception as exc:  # DCP's CheckpointException lists every rank's error
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ValueError(f"{path}: the checkpoint does not fit this run ({text})") from None
    set_model_state_dict(model, state["model"], options=_non_strict())
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    fp8 = get_fp8_state(model)
    if fp8 is not None:
        fp8.load_state_dict(from_storable(_restore_empty(plain.get("fp8", {}))))
    return from_storable(_restore_empty(plain.get("extra", {})))


def read_extra(path: str | os.PathLike) -> dict:
    """The ``extra`` part of a :func:`save_state` checkpoint alone (nothing restored): what a
    resume checks (config, run id, corpus) before it touches the model. ValueError naming
    ``path`` for a checkpoint that cannot be read."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from fp8sim.training.checkpoint import from_storable

    try:
        with _one_process_is_meant():
            plain = _load_state_dict_from_keys({"extra"}, checkpoint_id=str(path))
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ValueError(f"{path}: damaged checkpoint ({text})") from None
    return from_storable(_restore_empty(plain.get("extra", {})))


@contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _non_strict() -> Any:
    """The FP8 layers' ``_extra_state`` is restored from ``fp8``, not from the model's entries."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)


def save_dcp_checkpoint(run_dir: str | os.PathLike, *, step: int, rank: int, world: int, model: torch.nn.Module,
                        optimizer: Any, extra: dict, barrier: Callable[[], None] | None = None) -> Path:
    """Write the run's checkpoint after ``step`` (every rank calls it; ``barrier``: the process
    group's, None for one process) and move ``LATEST`` to it. Returns the step's directory."""
    run = Path(run_dir)
    d = _step_dir(run, step)
    if rank == 0:  # a checkpoint of this step left by a killed run: written again
        _remove_step_dir(d)
        owned_dir(run, d.relative_to(run))  # made without following links (a link there: WriteError)
    if barrier is not None:
        barrier()
    save_state(d, model, optimizer, extra)
    if barrier is not None:
        barrier()  # every rank's share of this step is complete
    if rank == 0:
        latest = run / CHECKPOINT_DIR / "LATEST"
        text = json.dumps({"step": int(step), "world": int(world)}) + "\n"
        atomic_write(latest, lambda f: f.write(text.encode()), root=run)
        for old in (run / CHECKPOINT_DIR).glob("step*"):
            # only older steps: a later step's directory may already be in the making
            if re.fullmatch(r"step\d{8,}", old.name) and int(old.name[4:]) < step:
                _remove_step_dir(old)
    return d


def _latest_dir(run: Path) -> tuple[Path, dict]:
    info = latest_checkpoint(run)
    if info is None:
        raise FileNotFoundError(f"{run}: no data-parallel checkpoint ({CHECKPOINT_DIR}/LATEST missing)")
    d = _step_dir(run, info["step"])
    if not (d / ".metadata").is_file():
        old = sorted(p.name for p in d.glob("rank*.pt")) if d.is_dir() else []
        why = ("written by an older fp8sim (one file per rank); resume it with that version" if old
               else "missing or incomplete")
        raise ValueError(f"{d}: the checkpoint LATEST names is {why}")
    return d, info


def read_dcp_checkpoint(run_dir: str | os.PathLike) -> dict:
    """The plain entries of the last complete checkpoint of ``run_dir`` (config, run id, corpus,
    RNG, options, ...) with ``step`` and ``world`` from ``LATEST``; nothing is restored."""
    d, info = _latest_dir(Path(run_dir))
    out = read_extra(d)
    out.update(step=info["step"], world=info["world"])
    return out


def load_dcp_checkpoint(run_dir: str | os.PathLike, model: torch.nn.Module, optimizer: Any) -> dict:
    """Restore the last complete checkpoint of ``run_dir`` (see :func:`load_state`); returns its
    ``extra`` entries with ``step`` and ``world`` from ``LATEST``."""
    d, info = _latest_dir(Path(run_dir))
    out = load_state(d, model, optimizer)
    out.update(step=info["step"], world=info["world"])
    return out


#: the names of the files a checkpoint writes into its step directory
_OWN_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp"
                       r"|rank\d+\.pt|\.rank\d+\.pt\.\d+-[A-Za-z0-9_]+\.tmp")


def _remove_step_dir(d: Path) -> None:
    """Remove a step directory's checkpoint files -- DCP's (``.metadata``, ``__R_N.distcp``, their
    temporary ``.metadata.tmp``) and an older fp8sim's rank files -- then the directory if that left
    it empty: only what a checkpoint writes. A link is never entered, anything else in it is kept
    (and so is the directory)."""
    if d.is_symlink() or not d.is_dir():
        return
    for f in d.iterdir():
        if _OWN_FILE.fullmatch(f.name) and not f.is_symlink() and not f.is_dir():
            f.unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:  # something of somebody else's in it: left as it is
        pass


def latest_checkpoint(run_dir: str | os.PathLike) -> dict | None:
    """``{"step", "world"}`` of the last complete checkpoint in ``run_dir``, or None."""
    latest = Path(run_dir) / CHECKPOINT_DIR / "LATEST"
    if not os.path.lexists(latest):
        return None
    info = read_json(latest, 1 << 16, what="checkpoint index")
    if not isinstance(info, dict) or not all(
        type(info.get(k)) is int and least <= info[k] < 2**62 for k, least in (("step", 0), ("world", 1))
    ):
        raise ValueError(f"{latest}: not a checkpoint index (needs an int step >= 0 and world >= 1: "
                         f"{json.dumps(info)[:80]})")  # fmt: skip
    return {"step": info["step"], "world": info["world"]}
