"""Data parallelism on torch.distributed: process groups, the data-parallel side of the training
loop, the launcher, and memory accounting.

Ranks start from torchrun (``torchrun --nproc-per-node N -m fp8sim train ...``) or from
``fp8sim train --nproc N``, which runs torchrun's own elastic launcher
(:mod:`fp8sim.training.launch`); either way every rank joins the default process group from the
environment (``env://``): gloo for CPU tensors, nccl for CUDA ones. Every rank runs the one
training loop, :class:`~fp8sim.training.trainer.Trainer`, with a :class:`DataParallel` that does
the gradient communication: DDP for ``bf16``, the TE recipes and FP8-LM O1/O2 (with the FP8
all-reduce as its communication hook, :mod:`fp8sim.training.fp8_allreduce`), FSDP2 for FP8-LM
O3 (E4M3 all-gather and reduce-scatter, :mod:`fp8sim.training.fsdp_fp8`). One rank runs the same
code without a process group. Checkpoints: :mod:`fp8sim.training.dist_checkpoint` (DCP).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from fp8sim.training.fp8_allreduce import (
    COMM_CATEGORIES,
    FP8_GRAD_SCOPES,
    GRAD_SCALINGS,
    CommCounter,
    Fp8GradReducer,
    ring_bytes,
)

__all__ = [
    "GRAD_SCALINGS",
    "FP8_GRAD_SCOPES",
    "COMM_CATEGORIES",
    "ring_bytes",
    "CommCounter",
    "Fp8GradReducer",
    "DataParallel",
    "init_process_group",
    "leave_process_group",
    "torchrun_env",
    "memory_breakdown",
    "run_rank",
    "train_distributed",
    "SharedError",
]


def torchrun_env() -> tuple[int, int] | None:
    """``(rank, world_size)`` when started by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise ValueError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
                             "must be integers (torchrun sets them)") from None
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} and WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
        return rank, world
    return None


def init_process_group(device: str = "cpu") -> str:
    """Join the default process group from torchrun's environment (``env://``): nccl when the
    run's tensors are on CUDA (this rank's GPU: ``cuda:LOCAL_RANK``, unless ``device`` names
    one), else gloo. Returns the backend name."""
    import torch.distributed as dist

    backend = "gloo"
    if torch.device(device).type == "cuda":
        backend = "nccl"
        torch.cuda.set_device(rank_device(device))
    dist.init_process_group(backend, init_method="env://")
    return backend


def rank_device(device: str) -> torch.device:
    """This rank's device for the run's ``--device``: ``cuda`` means ``cuda:LOCAL_RANK`` (one
    GPU per rank, as torchrun places them); ``cuda:N`` and ``cpu`` are themselves."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return d


def leave_process_group() -> None:
    """Destroy the default process group (if joined)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# -- memory accounting --------------------------------------------------------------------------


def memory_breakdown(
    model: torch.nn.Module,
    optimizer: Any,
    *,
    reducer: Fp8GradReducer | None = None,
    fp8_names: set[str] | None = None,
) -> dict:
    """Bytes per parameter of this rank's training state, measured from the live tensors: what
    this rank holds (a sharded parameter's, state's or gradient's local shard) divided by the
    model's parameter count (tied weights once), so under FSDP2 the ranks' figures add up.

    ``weights``: the parameters as stored between steps; ``master``: separate master copies
    (Fp8AdamW's FP16 masters + scales; 0 for torch AdamW, whose masters are the weights);
    ``grads``: ``p.grad`` where it is set, else the reducer's stored gradient (FP8 codes + scale,
    bf16 values); ``optimizer``: the moment tensors and per-tensor scalars. ``fp8lm``: FP8-LM's
    count (its Eq. 7/8: master weights + gradients + both moments; the weights themselves where
    they are the masters). ``fp8_weights``: the same for the FP8 linears' weights only.
    """
    from fp8sim.training.fsdp_fp8 import local_data

    def nbytes(t: torch.Tensor) -> int:
        t = local_data(t)
        return t.numel() * t.element_size()

    params = list(dict.fromkeys(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    fp8_names = fp8_names or set()
    rows = []
    for p in params:
        name = names[id(p)]
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        tensors = {k: v for k, v in st.items() if torch.is_tensor(v)}
        master = sum(nbytes(v) for k, v in tensors.items() if k.startswith("master"))
        moments = sum(nbytes(v) for k, v in tensors.items() if not k.startswith("master"))
        if p.grad is not None:
            g = nbytes(p.grad)
        elif reducer is not None and id(p) in reducer.stash:
            g = reducer.stash_bytes(p)
        else:
            g = 0
        rows.append((name in fp8_names, p.numel(), nbytes(p), master, g, moments))

    def summarize(sel: list[tuple]) -> dict:
        n = sum(r[1] for r in sel) or 1
        w, m, g, o = (sum(r[i] for r in sel) / n for i in (2, 3, 4, 5))
        has_master = any(r[3] for r in sel)
        return {"parameters": sum(r[1] for r in sel), "weights": w, "master": m, "grads": g, "optimizer": o,
                "total": w + m + g + o, "fp8lm": (m if has_master else w) + g + o}

    out = summarize(rows)
    if fp8_names:
        out["fp8_weights"] = summarize([r for r in rows if r[0]])
    return out


# -- the data-parallel side of the training loop -------------------------------------------------


class DataParallel:
    """What makes :class:`~fp8sim.training.trainer.Trainer` one rank of a data-parallel run.

    ``rank`` of ``world`` (the default process group is joined beforehand when ``world > 1``);
    ``device``: the run's ``--device``. :meth:`attach` sets up the gradient communication for a
    recipe -- DDP whose communication hook is the :class:`Fp8GradReducer` (FP8-LM's FP8
    all-reduce for fp8lm-o1/o2, a bf16/fp32 all-reduce for the rest), FP8-LM's Adam (O2), FSDP2
    with FP8 all-gather and reduce-scatter (O3) -- and the loop calls the rest: its rows of a
    batch, the optimizer step with clipping, the metrics over ranks, the checkpoints, the
    summary's communication figures. One rank (``world == 1``) runs the same code without
    collectives.

    ``grad_scaling``: ``autoscale`` (default, the recipe's) or ``msamp`` for the FP8 all-reduce;
    ``fp8_grads``: ``all`` or ``linear`` (default: the recipe's), which gradients travel in FP8.
    """

    def __init__(self, rank: int = 0, world: int = 1, *, grad_scaling: str | None = None,
                 fp8_grads: str | None = None, device: str = "cpu") -> None:  # fmt: skip
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world")
        if grad_scaling is not None and grad_scaling.split(":")[0] not in GRAD_SCALINGS:
            raise ValueError(f"gradient scaling must be one of {GRAD_SCALINGS}, got {grad_scaling!r}")
        if fp8_grads is not None and fp8_grads not in FP8_GRAD_SCOPES:
            raise ValueError(f"fp8_grads must be one of {FP8_GRAD_SCOPES}, got {fp8_grads!r}")
        self.rank, self.world = rank, world
        self.device = rank_device(device)
        self._grad_scaling, self._fp8_grads = grad_scaling, fp8_grads

    def attach(self, model: torch.nn.Module, recipe: Any, cfg: Any, hp: dict) -> tuple[torch.nn.Module, Any]:
        """Set up the gradient communication and the optimizer (hyperparameters ``hp``) for
        ``model`` under ``recipe``; returns the module the forward goes through (DDP or the
        FSDP2-sharded model when ``world > 1``) and the optimizer whose ``param_groups`` and
        state the loop sets and saves."""
        from fp8sim.training.convert import fp8_linears
        from fp8sim.training.fp8lm import build_levels

        world = self.world
        group = None
        if world > 1:
            import torch.distributed as dist

            group = dist.group.WORLD
        self.model = model
        fp8_comm = recipe.grad_comm == "fp8"
        self.grad_scope = self._fp8_grads or recipe.fp8_grads.value
        self.grad_scaling = self._grad_scaling or recipe.grad_scaling.value
        # fp8_names: the FP8 linears' weights (the accounting's "fp8_weights")
        self.fp8_names = {f"{m.name}.weight" for m in fp8_linears(model)} if fp8_comm else set()
        self.fp8lm = None
        hook = None
        if fp8_comm:  # FP8-LM: the FP8 all-reduce or reduce-scatter, its optimizer, O3's FSDP2
            self.fp8lm, hook = build_levels(model, recipe, list(model.named_parameters()), world=world, group=group,
                                            backend=cfg.backend, hp=hp, grad_scaling=self.grad_scaling,
                                            fp8_grads=self.grad_scope)
            self.reducer, self.counter = self.fp8lm.reducer, self.fp8lm.counter
            optimizer: Any = self.fp8lm.optimizer
        else:  # a bf16/fp32 all-reduce as DDP's hook (counted), torch's AdamW
            named = list(model.named_parameters())
            other = torch.bfloat16 if (recipe.grad_comm == "bf16" or recipe.autocast == "bfloat16") else torch.float32
            self.counter = CommCounter(world)
            self.reducer = Fp8GradReducer(named, set(), world=world, group=group, other_dtype=other,
                                          backend=cfg.backend, counter=self.counter)
            optimizer = torch.optim.AdamW([p for _, p in named], **hp, foreach=False)
            hook = self.reducer.hook if world > 1 else None
        self.grad_fp8_names = self.reducer.fp8_names
        module: torch.nn.Module = model
        if hook is not None:
            ids = [self.device.index] if self.device.type == "cuda" else None
            module = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            module.register_comm_hook(None, hook)
        self.optimizer = optimizer
        self.counter.pop()  # set-up, not a training step
        return module, optimizer

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2 (FP8-LM O3 over more than one rank)."""
        from fp8sim.training.tensor_parallel import is_dtensor

        return any(is_dtensor(p) for p in self.model.parameters())

    def options(self) -> dict:
        """The options that change a run's numbers besides its config (checked on resume)."""
        return {"grad_scaling": self.grad_scaling, "fp8_grads": self.grad_scope}

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    # -- a step ---------------------------------------------------------------------------------
    def local_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[r B/N, (r+1) B/N)`` of a global batch ``t`` (B, ...)."""
        b = t.shape[0] // self.world
        return t[self.rank * b : (self.rank + 1) * b]

    def begin_step(self) -> None:
        self.reducer.stash.clear()

    def step(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Clip to ``max_norm`` and update (FP8-LM: the reduced FP8 gradients, clipping in their
        scale_inv; one rank reduces them here); returns the global gradient norm before clipping."""
        if self.fp8lm is not None:
            return self.fp8lm.step(max_norm=max_norm)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        return grad_norm

    def step_metrics(self, loss: float, events: dict) -> tuple[float, dict]:
        """The step's mean loss over the ranks and its metrics: FP8 cast ``events`` summed over
        the ranks, ``comm_bytes`` (mean bytes a rank sent, per category, plus what BF16 would send
        for the FP8 payloads) and ``allreduce`` (FP8 sums that saturated, inputs that underflowed,
        AutoScale's mu range). A collective (not counted in the bytes)."""
        import torch.distributed as dist

        comm, ar = self.counter.pop(), self.reducer.pop_stats()
        keys = list(comm)
        vec = torch.tensor([loss, events.get("overflow", 0), events.get("underflow", 0), ar["overflow"],
                            ar["underflow"], ar["nonzero"], *comm.values()], dtype=torch.float64)  # fmt: skip
        if self.world > 1:
            vec = vec.to(self.device)
            dist.all_reduce(vec)
            vec = vec.cpu()
        row: dict = {}
        if events:
            row.update(overflow=int(vec[1]), underflow=int(vec[2]))
        row["comm_bytes"] = {k: float(v) / self.world for k, v in zip(keys, vec[6:].tolist())}
        if self.grad_fp8_names:
            mu = self.reducer.mu_range()
            row["allreduce"] = {"overflow": int(vec[3]), "underflow": int(vec[4]), "nonzero": int(vec[5]),
                                "mu_min": mu and mu[0], "mu_max": mu and mu[1]}
        return float(vec[0]) / self.world, row

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, out: os.PathLike, step: int, extra: dict) -> None:
        """Write the checkpoint after ``step`` (a collective; see
        :mod:`fp8sim.training.dist_checkpoint`): model, optimizer and FP8 state, plus ``extra``,
        the options and the reducer's AutoScale state."""
        from fp8sim.training.dist_checkpoint import save_dcp_checkpoint

        extra = {**extra, "options": self.options(), "reducer": self.reducer.state_dict()}
        save_dcp_checkpoint(out, step=step, rank=self.rank, world=self.world, model=self.model,
                            optimizer=self.optimizer, extra=extra, barrier=self.barrier if self.world > 1 else None)

    def read_checkpoint(self, out: os.PathLike) -> dict:
        """The plain entries (``step``, ``world``, ``config``, ``run_id``, ``corpus``, ``rng``, ...)
        of the last complete checkpoint in ``out``, its options checked; nothing restored."""
        from fp8sim.training.dist_checkpoint import read_dcp_checkpoint

        ck = read_dcp_checkpoint(out)
        if ck.get("options") != self.options():
            raise ValueError(f"--resume: {out} was trained with {ck.get('options')}, not {self.options()}")
        return ck

    def restore_checkpoint(self, out: os.PathLike) -> None:
        """Restore the last complete checkpoint in ``out`` into the model, the optimizer, the FP8
        state and the reducer (a collective)."""
        from fp8sim.training.dist_checkpoint import load_dcp_checkpoint

        ck = load_dcp_checkpoint(out, self.model, self.optimizer)
        self.reducer.load_state_dict(ck["reducer"])

    # -- the summary ------------------------------------------------------------------------------
    def memory(self) -> list[dict]:
        """Every rank's :func:`memory_breakdown` (a collective)."""
        import torch.distributed as dist

        mine = memory_breakdown(self.model, self.optimizer, reducer=self.reducer, fp8_names=self.fp8_names)
        if self.world == 1:
            return [mine]
        mems: list = [None] * self.world
        dist.all_gather_object(mems, mine)
        return mems

    def summary(self, rows: list[dict]) -> dict:
        """The run summary's data-parallel part, from the metrics ``rows``."""
        out: dict = {"options": self.options(), "nproc": self.world, "engine": "fsdp2" if self.sharded else "ddp"}
        if rows:
            comm = {k: sum(r["comm_bytes"][k] for r in rows) / len(rows) for k in rows[0]["comm_bytes"]}
            if comm["wgrad_bf16_equiv"]:
                comm["wgrad_fp8_vs_bf16"] = (comm["wgrad_fp8"] + comm["scales"]) / comm["wgrad_bf16_equiv"]
            out["comm_bytes_per_step"] = comm
            if self.grad_fp8_names:
                ar = {k: sum(r["allreduce"][k] for r in rows) for k in ("overflow", "underflow", "nonzero")}
                out["allreduce"] = {**ar, "mu_final": (rows[-1]["allreduce"]["mu_min"], rows[-1]["allreduce"]["mu_max"])}
        return out


# -- the launcher -------------------------------------------------------------------------------


class SharedError(Exception):
    """Mixin of an error rank 0 found and every rank raises (the start of a run: ``--out``,
    ``--resume``): the command line says it once, on rank 0."""


def train_distributed(
    cfg: Any,
    out_dir: str | os.PathLike,
    *,
    nproc: int = 1,
    device: str = "cpu",
    grad_scaling: str | None = None,
    fp8_grads: str | None = None,
    record: str | os.PathLike | None = None,
    save_every: int = 0,
    progress: bool | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    run_options: dict | None = None,
) -> dict:
    """Train ``cfg`` (a :class:`~fp8sim.training.trainer.TrainConfig`) data-parallel over
    ``nproc`` ranks into ``out_dir``; returns the run summary (``run.json``; ``{}`` on a torchrun
    rank other than 0).

    Rank ``r`` takes rows ``[r B/N, (r+1) B/N)`` of the global batch ``B = cfg.batch_size`` (the
    same batches as a one-process run). Started under torchrun, this process is one rank (the
    ranks come from the environment and ``nproc`` is ignored); else ``nproc > 1`` ranks are
    started by torchrun's elastic launcher (:mod:`fp8sim.training.launch`). Rank 0 alone creates
    the run directory and writes its files, after the process group exists; every rank then
    trains the same config. ``device``: ``cpu``, ``cuda`` (rank r on ``cuda:LOCAL_RANK``) or
    ``cuda:N``. ``grad_scaling``, ``fp8_grads``: see :class:`DataParallel`. ``record``: a trace
    per rank in ``record/rank{r}`` (local weight gradients before the reduction).

    Checkpoints (:mod:`fp8sim.training.dist_checkpoint`: DCP) after every ``cfg.checkpoint_every``
    steps and the last; ``resume=True`` continues the run in ``out_dir`` from its last complete
    checkpoint (same config and options; any number of ranks that divides the batch -- DCP
    reshards -- except for a recorded run, whose traces are per rank), reproducing the
    uninterrupted run's losses bit for bit on CPU with the same number of ranks. ``stop_after``:
    stop after that step as if killed (no summary), for tests. ``metrics.jsonl`` rows carry,
    besides the single-process keys, ``comm_bytes`` and ``allreduce`` (see
    :meth:`DataParallel.step_metrics`).
    ``run_options``: stored in config.json (see :class:`~fp8sim.training.trainer.Trainer`).
    """
    from pathlib import Path

    from fp8sim.recipes import get_recipe

    env = torchrun_env()
    world = env[1] if env else nproc
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc!r}")
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} is not divisible by {world} ranks")
    check_device(device)
    DataParallel(0, world, grad_scaling=grad_scaling, fp8_grads=fp8_grads)  # checks the options
    if (grad_scaling or fp8_grads) and get_recipe(cfg.recipe).grad_comm != "fp8":
        raise ValueError(f"--grad-scaling/--fp8-grads apply to the FP8 all-reduce of the fp8lm recipes, "
                         f"not to {cfg.recipe_name!r}")
    out = Path(out_dir)
    opts = {"resume": bool(resume), "device": str(device), "run_options": run_options,
            "grad_scaling": grad_scaling, "fp8_grads": fp8_grads,
            "record": None if record is None else str(record), "save_every": int(save_every), "progress": progress,
            "stop_after": stop_after}  # fmt: skip
    if env:
        run_rank(env[0], world, cfg.to_dict(), str(out), opts)
        if env[0] != 0:
            return {}
    elif world == 1:
        run_rank(0, 1, cfg.to_dict(), str(out), opts)
    else:
        from fp8sim.training.launch import launch_ranks

        # this process is the run's one writer: it decides how the run starts (and says it, e.g.
        # a restart) before the ranks exist, and they take its decision
        opts["decided"] = list(_start_run(out, cfg.to_dict(), opts, world))
        launch_ranks(world, {"cfg": cfg.to_dict(), "out": str(out), "opts": opts}, str(out))
    from fp8sim.training.run_dir import read_summary

    return read_summary(out / "run.json") if (out / "run.json").is_file() else {}


def check_device(device: str) -> torch.device:
    """``device`` (``cpu``, ``cuda``, ``cuda:N``) as a torch device, or ValueError in the
    ``--device`` flag's words: an unknown spelling, no CUDA GPU, a GPU index out of range."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r}: not a device (cpu, cuda or cuda:N)") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: training runs on cpu or cuda, not {d.type}")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU is available to torch here "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return d


def run_rank(rank: int, world: int, cfg_dict: dict, out: str, opts: dict) -> None:
    """Rank ``rank`` of ``world``: join the process group from the environment (``world > 1``),
    agree on how the run starts (rank 0 decides and writes the run's first files), train, leave
    the group. ``opts``: :func:`train_distributed`'s options."""
    import gc

    import numba
    import torch.distributed as dist

    threads = max(1, (os.cpu_count() or 1) // world)
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    # one core per rank; numba kernels single-threaded: on the tiny model's tensors a parallel
    # launch costs more than the work (bit-exact either way: the kernels write disjoint outputs)
    torch.set_num_threads(min(torch_threads, threads))
    numba.set_num_threads(1)
    if world > 1:
        init_process_group(opts.get("device", "cpu"))
    try:
        start, run_id = _agree_on_start(rank, world, cfg_dict, out, opts)
        _train_rank(rank, world, cfg_dict, out, start, run_id, opts)
        gc.collect()  # DDP / FSDP objects gone before their process group
        if world > 1:
            dist.barrier()  # run.json is written before any rank returns
    finally:
        if world > 1:
            leave_process_group()
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)


def _agree_on_start(rank: int, world: int, cfg_dict: dict, out: str, opts: dict) -> tuple[str, str | None]:
    """How the run starts (:func:`~fp8sim.training.run_dir.start_mode`) and its identity (run
    id), decided by rank 0 -- which also creates ``out`` and writes its config.json for a new run
    -- and sent to every rank (a collective). An error of that decision is raised on every rank, as a :class:`SharedError`
    of its own type."""
    from pathlib import Path

    if opts.get("decided"):  # decided by the launcher (``--nproc``) before the ranks started
        start, run_id = opts["decided"]
        return start, run_id
    decision: list = [None]
    if rank == 0:
        try:
            decision[0] = ("ok", _start_run(Path(out), cfg_dict, opts, world))
        except (ValueError, OSError) as exc:
            kind = next(k for k in (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
                                    OSError, ValueError) if isinstance(exc, k))  # fmt: skip
            decision[0] = ("error", kind.__name__, str(exc))
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(decision, src=0)
    if decision[0][0] == "error":
        _, name, msg = decision[0]
        kind = {k.__name__: k for k in (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
                                        OSError, ValueError)}[name]  # fmt: skip
        raise type(name, (kind, SharedError), {})(msg)
    return decision[0][1]


def _start_run(out: Any, cfg_dict: dict, opts: dict, world: int) -> tuple[str, str | None]:
    """Rank 0's part of :func:`_agree_on_start`: (start, run id)."""
    from fp8sim.training.config import TrainConfig
    from fp8sim.training.run_dir import new_run_id, read_run_identity, start_mode, write_run_config

    cfg = TrainConfig.from_dict(cfg_dict)
    start = start_mode(out, opts["resume"], data_parallel=True, config=cfg, own=opts.get("record"))
    try:  # a resumed or restarted run keeps its identity
        run_id = read_run_identity(out)[1] if start != "fresh" else None
    except FileNotFoundError:
        run_id = None
    if start == "resume":
        _check_resume_world(out, opts, world)
        return start, run_id
    # a run here from now on (before any rank starts a trace): see Trainer
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create directory ({exc.strerror or exc})") from None
    run_id = run_id or new_run_id()
    write_run_config(out, cfg, run_id, opts.get("run_options"))  # whole or absent
    return start, run_id


def _check_resume_world(out: Any, opts: dict, world: int) -> None:
    """A checkpoint resumes on any number of ranks (DCP reshards), except a recorded run's: its
    traces are one per rank."""
    from fp8sim.training.dist_checkpoint import latest_checkpoint

    info = latest_checkpoint(out)
    if info is not None and opts.get("record") and info["world"] != world:
        raise ValueError(f"--resume: {out} was recorded by {info['world']} ranks (one trace per rank in --record); "
                         f"resume it with {info['world']} ranks")


def _train_rank(rank: int, world: int, cfg_dict: dict, out: str, start: str, run_id: str | None, opts: dict) -> None:
    """The rank's training run."""
    from pathlib import Path

    from fp8sim.training.trainer import Trainer, TrainConfig

    cfg = TrainConfig.from_dict(cfg_dict)
    recorder_factory = None
    if opts.get("record"):
        from fp8sim.training.recorder import record

        def recorder_factory(model: torch.nn.Module):
            return record(model, Path(opts["record"]) / f"rank{rank}", save_every=opts["save_every"],
                          chunk_steps=max(1, cfg.checkpoint_every), append=start != "fresh",
                          config={"run": cfg.to_dict(), "rank": rank, "world": world, "run_dir": out,
                                  "run_id": run_id})  # fmt: skip

    dp = DataParallel(rank, world, grad_scaling=opts.get("grad_scaling"), fp8_grads=opts.get("fp8_grads"),
                      device=opts.get("device", "cpu"))
    trainer = Trainer(cfg, out, data_parallel=dp, start=start, recorder_factory=recorder_factory,
                      run_options=opts.get("run_options"), run_id=run_id, device=opts.get("device", "cpu"))
    trainer.run(progress=opts.get("progress"), stop_after=opts.get("stop_after"))
