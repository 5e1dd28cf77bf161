"""Spawning the ranks of ``fp8sim train --nproc N`` (:func:`fp8sim.training.distributed.
train_distributed`): the ranks, the rank's own error in the launcher, and ranks that end with it."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["exit_rank", "rank_error", "spawn_ranks", "spawned_rank", "RankDied"]


class RankDied(ChildProcessError):
    """A rank ended from outside the run -- killed by a signal (SIGKILL: the out-of-memory killer
    or a kill; SIGSEGV...) or exited without an exception of its own. Not a bug of fp8sim and not
    bad input: the CLI says it in one line (an OSError: exit 2), with how to continue."""

#: exceptions of a rank that mean bad input (the CLI's exit 2), as named in its traceback
_INPUT_ERRORS = ("ValueError", "TypeError", "FileNotFoundError", "FileExistsError", "NotADirectoryError",
                 "IsADirectoryError", "PermissionError", "OSError", "ArithmeticError", "NotImplementedError",
                 "UsageError")


def spawn_ranks(world: int, cfg_dict: dict, out: str, opts: dict) -> None:
    """Run :func:`~fp8sim.training.distributed.run_rank` in ``world`` new processes (joined
    through a ``file://`` store in a temporary directory) and wait for them. A rank's exception
    is raised here as :func:`rank_error` gives it (its traceback with ``FP8SIM_DEBUG=1``)."""
    import logging
    import tempfile

    import torch.multiprocessing as mp

    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..."
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="fp8sim-pg-") as d:
            mp.spawn(spawned_rank, args=(os.getpid(), world, cfg_dict, out, os.path.join(d, "store"), opts),
                     nprocs=world, join=True)  # fmt: skip
    except mp.ProcessRaisedException as exc:
        if os.environ.get("FP8SIM_DEBUG") == "1":
            raise  # the rank's traceback
        raise rank_error(exc) from None
    except mp.ProcessExitedException as exc:  # killed from outside, or gone without a word
        raise rank_died(exc, out) from None
    finally:
        spawn_log.setLevel(level)


def rank_died(exc: Any, out: str) -> RankDied:
    """The one line for a rank that ended from outside (torch's ProcessExitedException: which
    rank, its signal or exit code): which rank died of what, and that ``--resume`` continues."""
    from fp8sim.training.dist_checkpoint import latest_checkpoint

    how = f"died of signal {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
    why = {"SIGKILL": " (killed from outside the run: the out-of-memory killer, or a kill)"}.get(
        exc.signal_name or "", "")
    try:
        info = latest_checkpoint(out)
    except ValueError:
        info = None
    since = f"its last checkpoint (step {info['step']})" if info else "step 0 (no checkpoint yet)"
    return RankDied(f"rank {exc.error_index} {how}{why}; the other ranks were stopped. "
                    f"'fp8sim train ... --resume' continues the run in {out} from {since}")


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


def exit_rank() -> None:
    """End this spawned rank, its work done and its process group destroyed: stdio flushed,
    then ``os._exit(0)``, without interpreter shutdown.

    gloo's worker threads outlive ``destroy_process_group`` (a DDP module keeps the group) and
    can still be finishing a collective that the rank has already seen complete -- releasing its
    tensors, which are Python's, takes the GIL. When the main thread is meanwhile finalizing the
    interpreter, Python ends such a thread by force (``pthread_exit``); the forced unwinding
    through gloo's C++ frames aborts the rank: ``terminate called without an active exception``,
    SIGABRT, now and then under load. With no interpreter shutdown there is nothing to race.
    Everything the rank writes is closed by then (checkpoints, metrics and traces are written
    whole, temp file + rename)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawned_rank(rank: int, parent_pid: int, *args: Any) -> None:
    _die_with_parent(parent_pid)
    import threading

    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing RLock: a named semaphore that a rank killed from
    # outside (SIGKILL) cannot release, which multiprocessing's resource tracker then reports as
    # "leaked" at exit. A rank's bars live in its own process: a thread lock serves as well.
    tqdm.set_lock(threading.RLock())
    from fp8sim.training.distributed import run_rank

    run_rank(rank, *args)
    exit_rank()  # an exception instead goes back to the launcher (torch's spawn wrapper)
