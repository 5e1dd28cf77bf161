"""One launch of N gloo ranks per test module: process start-up is paid once.

``run_ranks(fn, world, tmp, *args)`` starts ``world`` processes (``torch.multiprocessing``, a
``file://`` store in ``tmp``: no ports), runs ``fn(rank, world, tmp, *args)`` in each with the
default process group joined, and returns each rank's result (saved by the rank, read back
here). ``fn`` is a module-level function of the test module (the processes import it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch


def run_ranks(fn: Callable[..., Any], world: int, tmp: Path, *args: Any) -> list[Any]:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, str(tmp), fn, args), nprocs=world, join=True)
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _rank_main(rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple) -> None:
    import numba
    import torch.distributed as dist

    from fp8sim.training.launch import exit_rank

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=world)
    try:
        torch.save(_plain(fn(rank, world, Path(tmp), *args)), os.path.join(tmp, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()  # no interpreter shutdown with gloo's threads alive (an exception instead goes to mp.spawn)


def _plain(obj: Any) -> Any:
    """``obj`` with collective results waited for (DTensor ops hand back AsyncCollectiveTensors,
    which ``torch.load(weights_only=True)`` refuses)."""
    if isinstance(obj, torch.Tensor):
        return obj.wait() if type(obj) is not torch.Tensor and hasattr(obj, "wait") else obj
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj
