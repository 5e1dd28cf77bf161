"""Helpers for the ranks ``fp8sim train --nproc N`` spawns (:func:`fp8sim.training.distributed.
train_distributed`): the rank's own error in the launcher, and ranks that end with it."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["rank_error", "spawned_rank"]

#: exceptions of a rank that mean bad input (the CLI's exit 2), as named in its traceback
_INPUT_ERRORS = ("ValueError", "TypeError", "FileNotFoundError", "FileExistsError", "NotADirectoryError",
                 "IsADirectoryError", "PermissionError", "OSError", "ArithmeticError", "NotImplementedError",
                 "UsageError")


def rank_error(exc: Exception) -> Exception:
    """The exception a spawned rank raised, from the traceback text torch hands back: a ValueError
    with the rank's own message for bad input, else a RuntimeError naming it (a bug)."""
    text = str(exc).strip().splitlines()
    rank = next((ln.split()[2] for ln in text if ln.startswith("-- Process ")), "?")
    last = text[-1] if text else type(exc).__name__
    name, _, msg = last.partition(": ")
    if name.rsplit(".", 1)[-1] in _INPUT_ERRORS:
        return ValueError(msg or name)
    return RuntimeError(f"rank {rank}: {last}")


def _die_with_parent(parent_pid: int) -> None:
    """Make this spawned rank end when the launcher does (killed, it cannot stop its ranks): Linux's
    parent-death signal, and an exit if the launcher is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def spawned_rank(rank: int, parent_pid: int, *args: Any) -> None:
    _die_with_parent(parent_pid)
    from fp8sim.training.distributed import _run_rank

    _run_rank(rank, *args)
