"""``fp8sim train --nproc N``: the ranks started by torchrun's own machinery.

``--nproc N`` runs ``torch.distributed.run``'s elastic launcher in this process (a c10d
rendezvous on a free local port, as ``torchrun --standalone``), which starts N worker processes
``python -m fp8sim.training.launch PAYLOAD`` with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` ...). Each worker is then exactly a rank of ``torchrun
--nproc-per-node N -m fp8sim train ...``: it joins the process group from the environment and
runs :func:`fp8sim.training.distributed.run_rank`.

Errors come back in one line: a rank's bad-input error (the CLI's exit 2) is raised here as a
ValueError with the rank's own message (written to torchelastic's per-worker error file); a rank
killed from outside (SIGKILL: the out-of-memory killer) as :class:`RankDied`, naming the rank,
its signal and the step ``--resume`` continues from; any other failure as a RuntimeError naming
the rank and its exception (a bug).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["RankDied", "launch_ranks", "exit_rank", "INPUT_ERRORS"]


class RankDied(ChildProcessError):
    """A rank ended from outside the run -- killed by a signal (SIGKILL: the out-of-memory killer
    or a kill; SIGSEGV...) or exited without a word. Not a bug of fp8sim and not bad input: the CLI
    says it in one line (an OSError: exit 2), with how to continue."""


#: exception types of a rank that mean bad input (the CLI's exit 2)
INPUT_ERRORS = ("ValueError", "TypeError", "FileNotFoundError", "FileExistsError", "NotADirectoryError",
                "IsADirectoryError", "PermissionError", "OSError", "ArithmeticError", "NotImplementedError",
                "UsageError")


def launch_ranks(nproc: int, payload: dict, out: str) -> None:
    """Run ``nproc`` ranks of ``payload`` (:func:`fp8sim.training.distributed.run_rank`'s
    arguments: ``world``, ``cfg``, ``out``, ``opts``) under torch's elastic launcher and wait;
    a rank's failure is raised as the module docstring says."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"fp8sim-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    with tempfile.TemporaryDirectory(prefix="fp8sim-launch-") as d:
        path = os.path.join(d, "payload.json")
        with open(path, "w") as f:
            json.dump({**payload, "launcher_pid": os.getpid()}, f)
        try:
            with _quiet_elastic():
                elastic_launch(config, sys.executable)("-m", "fp8sim.training.launch", path)
        except ChildFailedError as exc:
            raise _rank_failure(exc, out) from None


def _rank_failure(exc: Any, out: str) -> Exception:
    """The one-line exception for a ChildFailedError, from the rank that says most about the
    cause: one killed from outside by a signal (the others then fail on their broken connections
    to it), else one with bad input, else one with another error, else one the launcher stopped
    (SIGTERM) or that exited without a word; the lowest rank among equals."""
    rank, failure = min(exc.failures.items(), key=lambda kv: (_cause_rank(kv[1]), kv[0]))
    if failure.exitcode < 0:  # killed by a signal
        return _rank_died(rank, f"died of signal {failure.signal_name()}", failure.signal_name(), out)
    msg = _message(failure)
    name, _, text = msg.partition(": ")
    if not text:  # no error file: the rank exited without a word
        return _rank_died(rank, f"exited with code {failure.exitcode}", "", out)
    if name.rsplit(".", 1)[-1] in INPUT_ERRORS:
        return ValueError(text)
    return RuntimeError(f"rank {rank}: {msg}")


def _message(failure: Any) -> str:
    msg = failure.message
    return str(msg.get("message", "") if isinstance(msg, dict) else msg)


def _cause_rank(failure: Any) -> int:
    """How much a failure says about the cause (0: most; see :func:`_rank_failure`)."""
    if failure.exitcode < 0:
        return 3 if failure.signal_name() == "SIGTERM" else 0
    name, _, text = _message(failure).partition(": ")
    if not text:
        return 3
    return 1 if name.rsplit(".", 1)[-1] in INPUT_ERRORS else 2


def _rank_died(rank: int, how: str, signal_name: str, out: str) -> RankDied:
    from fp8sim.training.dist_checkpoint import latest_checkpoint

    why = {"SIGKILL": " (killed from outside the run: the out-of-memory killer, or a kill)"}.get(signal_name, "")
    try:
        info = latest_checkpoint(out)
    except ValueError:
        info = None
    since = f"its last checkpoint (step {info['step']})" if info else "step 0 (no checkpoint yet)"
    return RankDied(f"rank {rank} {how}{why}; the other ranks were stopped. "
                    f"'fp8sim train ... --resume' continues the run in {out} from {since}")


@contextmanager
def _quiet_elastic() -> Iterator[None]:
    """torch's elastic agent logs every start and stop at INFO/WARNING; a run's launcher says
    only what went wrong (raised by :func:`launch_ranks`)."""
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.launcher")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def exit_rank(code: int = 0) -> None:
    """End this worker with ``code``, its work done and its process group destroyed: stdio
    flushed, then ``os._exit``, without interpreter shutdown.

    gloo's worker threads can outlive ``destroy_process_group`` and still be finishing a
    collective the rank has seen complete -- releasing its tensors, which are Python's, takes the
    GIL. When the main thread is meanwhile finalizing the interpreter, Python ends such a thread by
    force; the forced unwinding through gloo's C++ frames aborts the rank (``terminate called
    without an active exception``, SIGABRT) now and then under load. With no interpreter shutdown
    there is nothing to race. Everything a rank writes is closed by then (checkpoints, metrics and
    traces are written whole, temp file + rename)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_with_launcher(launcher_pid: int) -> None:
    """Have the kernel kill this worker when its launcher dies (Linux ``PR_SET_PDEATHSIG``): a
    launcher killed outright (SIGKILL) cannot stop its ranks, and they would train on with no
    one to report to. The launcher already gone by now: end at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher_pid:
        os._exit(1)


def _worker(path: str) -> None:
    """A worker of :func:`launch_ranks`: run the rank from torchrun's environment; a failure is
    written to torchelastic's error file (read by the launcher) instead of a traceback."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from fp8sim.training.distributed import run_rank, torchrun_env

    with open(path) as f:
        payload = json.load(f)
    _end_with_launcher(payload["launcher_pid"])
    try:
        rank, world = torchrun_env()
        run_rank(rank, world, payload["cfg"], payload["out"], payload["opts"])
    except BaseException as exc:  # noqa: BLE001 -- every failure goes back to the launcher
        if os.environ.get("FP8SIM_DEBUG") == "1":
            import traceback

            traceback.print_exc()
        get_error_handler().record_exception(exc)
        exit_rank(2 if type(exc).__name__ in INPUT_ERRORS else 1)
    exit_rank(0)


if __name__ == "__main__":
    _worker(sys.argv[1])
