"""Checkpoints of data-parallel runs: one file per rank, committed together.

Layout in the run directory::

    checkpoint/step00000040/rank0.pt   rank 0's state after 40 steps
    checkpoint/step00000040/rank1.pt   ...
    checkpoint/LATEST                  {"step": 40, "world": 2}

Every rank writes its own file (temp file + rename); after a barrier -- every file of the step is
complete -- rank 0 moves ``LATEST`` to the new step (temp file + rename) and only then removes the
older step directories. A kill at any moment therefore leaves ``LATEST`` naming a complete set.
Files are read back with ``torch.load(weights_only=True)`` (untrusted input); numpy arrays in
policy states are stored as tensors (see :mod:`fp8sim.training.checkpoint`).

What a rank file holds (see :meth:`fp8sim.training.trainer.Trainer.save`): the
step, world size, run config and options; the rank's RNG states; its FP8 linears' scaling-policy
states (each rank's casts observe their own activations, so these differ between ranks); the
gradient reducer's AutoScale state; the optimizer (rank 0 only for replicated optimizers, every
rank its own shard under ZeRO); the model (rank 0 only: the weights are identical on every rank);
the trace recorder's state.
"""

from __future__ import annotations

import json
import re
import os
from pathlib import Path
from typing import Callable

from fp8sim.atomic_file import atomic_write
from fp8sim.input_files import read_json
from fp8sim.training.checkpoint import load_payload, restored, save_whole, to_storable

__all__ = ["CHECKPOINT_DIR", "save_rank_checkpoint", "latest_checkpoint", "load_rank_checkpoint"]

CHECKPOINT_DIR = "checkpoint"
_VERSION = 1


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step{step:08d}"


def save_rank_checkpoint(
    run_dir: str | os.PathLike,
    *,
    step: int,
    rank: int,
    world: int,
    payload: dict,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Write this rank's ``payload`` for ``step``; every rank calls it (collectively: ``barrier``
    is the process group's barrier, None for one rank). Returns the rank's file."""
    run = Path(run_dir)
    path = _step_dir(run, step) / f"rank{rank}.pt"  # its directories made without following links
    body = {"version": _VERSION, "step": int(step), "rank": int(rank), "world": int(world), **payload}
    save_whole(to_storable(body), path, root=run)
    if barrier is not None:
        barrier()  # every rank's file of this step is complete
    if rank == 0:
        latest = run / CHECKPOINT_DIR / "LATEST"
        text = json.dumps({"step": int(step), "world": int(world)}) + "\n"
        atomic_write(latest, lambda f: f.write(text.encode()), root=run)
        for old in (run / CHECKPOINT_DIR).glob("step*"):
            # only older steps: a later step's directory may already be in the making
            if re.fullmatch(r"step\d{8,}", old.name) and int(old.name[4:]) < step:
                _remove_step_dir(old)
    return path


def _remove_step_dir(d: Path) -> None:
    """Remove an old step directory's rank files (and temporary files of their writes), then the
    directory if that left it empty: only what the checkpoint wrote. A link is never entered,
    anything else in it is kept (and so is the directory)."""
    if d.is_symlink() or not d.is_dir():
        return
    for f in d.iterdir():
        if re.fullmatch(r"rank\d+\.pt|\.rank\d+\.pt\.\d+-[A-Za-z0-9_]+\.tmp", f.name) and not f.is_dir():
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


def load_rank_checkpoint(run_dir: str | os.PathLike, rank: int, *, step: int | None = None) -> dict:
    """Rank ``rank``'s payload of the last complete checkpoint (or of ``step``)."""
    run = Path(run_dir)
    if step is None:
        info = latest_checkpoint(run)
        if info is None:
            raise FileNotFoundError(f"{run}: no data-parallel checkpoint ({CHECKPOINT_DIR}/LATEST missing)")
        step = info["step"]
    path = _step_dir(run, step) / f"rank{rank}.pt"
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: missing (the checkpoint was written by fewer ranks?)")
    body = load_payload(path, _VERSION, ("step", "rank", "world", "config", "options", "rng", "policies",
                                          "reducer", "optimizer", "model", "recorder"))
    if (body["step"], body["rank"]) != (step, rank):
        raise ValueError(f"{path}: corrupt checkpoint: it says step {body['step']}, rank {body['rank']}, "
                         f"not step {step}, rank {rank}")  # fmt: skip
    return restored(path, body)
