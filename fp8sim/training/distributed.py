"""Data parallelism on torch.distributed: process groups, the data-parallel side of the training
loop, the launcher, and memory accounting.

Process groups: gloo on CPU, nccl on CUDA; started by ``torchrun`` (``env://``) or spawned by
:func:`train_distributed` through :mod:`fp8sim.training.spawn` (a ``file://`` store in a temporary
directory: no ports). Every rank runs the one training loop,
:class:`~fp8sim.training.trainer.Trainer`, with a :class:`DataParallel` that does the gradient
communication: :func:`train_distributed` trains every recipe -- ``bf16``, the TE recipes and
FP8-LM's O1/O2/O3 -- data-parallel over N ranks (one rank: the same code without collectives).
The FP8 gradient all-reduce itself (a DDP communication hook) and its byte accounting live in
:mod:`fp8sim.training.fp8_allreduce`, ZeRO's sharding in :mod:`fp8sim.training.zero`.
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


def init_process_group(rank: int, world: int, init_file: str | None = None) -> str:
    """Join the default process group: nccl when CUDA is available, else gloo; ``env://`` under
    torchrun, else the ``file://`` store ``init_file``. Returns the backend name."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    method = "env://" if init_file is None else f"file://{init_file}"
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=world)
    return backend


def leave_process_group() -> None:
    """Destroy the default process group (if joined). gloo's worker threads may outlive it (a
    DDP module keeps the group): a spawned rank then ends without interpreter shutdown, see
    :func:`fp8sim.training.spawn.exit_rank`."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# -- memory accounting --------------------------------------------------------------------------


def memory_breakdown(
    model: torch.nn.Module,
    optimizer: Any,
    *,
    reducer: Fp8GradReducer | None = None,
    zero: Any = None,
    fp8_names: set[str] | None = None,
) -> dict:
    """Bytes per parameter of this rank's training state, measured from the live tensors.

    ``weights``: the model's parameters as stored between steps (the E4M3 codes + scale_inv of
    ZeRO-stored FP8 weights, else the float32 parameters); ``master``: separate master copies
    (Fp8AdamW's FP16 masters + scales; 0 for torch AdamW, whose masters are the weights);
    ``grads``: ``p.grad`` where it is set, else the reducer's stored gradient (FP8 codes + scale,
    bf16 values); ``optimizer``: the moment tensors and per-tensor scalars. ``fp8lm``: FP8-LM's
    count (its Eq. 7/8: master weights + gradients + both moments; the weights themselves where
    they are the masters). ``fp8_weights``: the same for the FP8 linears' weights only.
    Divided by the model's parameter count (tied weights once).
    """
    params = list(dict.fromkeys(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    fp8_names = fp8_names or set()
    opt = zero.optimizer if zero is not None else optimizer
    rows = []
    for p in params:
        name = names[id(p)]
        st = opt.state.get(p, {}) if opt is not None else {}
        tensors = {k: v for k, v in st.items() if torch.is_tensor(v)}
        if zero is not None and name in fp8_names:
            w = zero.codes[name].numel() + 4
        else:
            w = p.numel() * p.element_size()
        master = sum(v.numel() * v.element_size() for k, v in tensors.items() if k.startswith("master"))
        moments = sum(v.numel() * v.element_size() for k, v in tensors.items() if not k.startswith("master"))
        if p.grad is not None:
            g = p.grad.numel() * p.grad.element_size()
        elif reducer is not None and id(p) in reducer.stash:
            g = reducer.stash_bytes(p)
        else:
            g = 0
        rows.append((name in fp8_names, p.numel(), w, master, g, moments))

    def summarize(sel: list[tuple]) -> dict:
        n = sum(r[1] for r in sel) or 1
        w, m, g, o = (sum(r[i] for r in sel) / n for i in (2, 3, 4, 5))
        has_master = any(r[3] for r in sel) or zero is not None
        return {"parameters": sum(r[1] for r in sel), "weights": w, "master": m, "grads": g, "optimizer": o,
                "total": w + m + g + o, "fp8lm": (m if has_master else w) + g + o}

    out = summarize(rows)
    if fp8_names:
        out["fp8_weights"] = summarize([r for r in rows if r[0]])
    return out


# -- the data-parallel side of the training loop -------------------------------------------------


class DataParallel:
    """What makes :class:`~fp8sim.training.trainer.Trainer` one rank of a data-parallel run.

    ``rank`` of ``world`` (the default process group is joined beforehand when ``world > 1``).
    :meth:`attach` sets up the gradient communication for a recipe -- DDP whose communication
    hook is the :class:`Fp8GradReducer` (FP8-LM's FP8 all-reduce for the fp8lm recipes, a
    bf16/fp32 all-reduce for the rest), FP8-LM's Adam (O2) or ZeRO-sharded FP8 weights (O3) --
    and the loop calls the rest: its rows of a batch, the reduced gradients, clipping and the
    FP8 optimizer step, the metrics over ranks, the per-rank checkpoint files, the summary's
    communication figures. One rank (``world == 1``) runs the same code without collectives.

    ``grad_scaling``: ``autoscale`` (default, the recipe's) or ``msamp`` for the FP8 all-reduce;
    ``fp8_grads``: ``all`` or ``linear`` (default: the recipe's), which gradients travel in FP8.
    """

    def __init__(self, rank: int = 0, world: int = 1, *, grad_scaling: str | None = None,
                 fp8_grads: str | None = None) -> None:  # fmt: skip
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world")
        if grad_scaling is not None and grad_scaling.split(":")[0] not in GRAD_SCALINGS:
            raise ValueError(f"gradient scaling must be one of {GRAD_SCALINGS}, got {grad_scaling!r}")
        if fp8_grads is not None and fp8_grads not in FP8_GRAD_SCOPES:
            raise ValueError(f"fp8_grads must be one of {FP8_GRAD_SCOPES}, got {fp8_grads!r}")
        self.rank, self.world = rank, world
        self._grad_scaling, self._fp8_grads = grad_scaling, fp8_grads

    def attach(self, model: torch.nn.Module, recipe: Any, cfg: Any, hp: dict) -> tuple[torch.nn.Module, Any]:
        """Set up the gradient communication and the optimizer (hyperparameters ``hp``) for
        ``model`` under ``recipe``; returns the module the forward goes through (DDP when
        ``world > 1``) and the optimizer."""
        from fp8sim.training.convert import fp8_linears
        from fp8sim.training.optim import Fp8AdamW
        from fp8sim.training.zero import ZeroFp8Weights

        rank, world = self.rank, self.world
        self.model = model
        self.named = named = list(model.named_parameters())
        fp8_comm = recipe.grad_comm == "fp8"
        # fp8_names: the FP8 linears' weights (E4M3-stored under O3, the accounting's "fp8_weights");
        # grad_fp8_names: the parameters whose gradients travel (and are kept) in FP8
        self.fp8_names = {f"{m.name}.weight" for m in fp8_linears(model)} if fp8_comm else set()
        self.grad_scope = self._fp8_grads or recipe.fp8_grads.value
        self.grad_fp8_names = {n for n, _ in named} if fp8_comm and self.grad_scope == "all" else self.fp8_names
        other = torch.bfloat16 if (fp8_comm or recipe.grad_comm == "bf16" or recipe.autocast == "bfloat16") else torch.float32
        self.grad_scaling = self._grad_scaling or recipe.grad_scaling.value
        self.counter = CommCounter(world)
        self.reducer = Fp8GradReducer(named, self.grad_fp8_names, world=world, scaling=self.grad_scaling,
                                      other_dtype=other, backend=cfg.backend, counter=self.counter)
        self.reduce_inline = world == 1 and fp8_comm  # one rank: FP8 gradients all the same, no collectives
        module: torch.nn.Module = model
        if world > 1:
            module = torch.nn.parallel.DistributedDataParallel(model)
            module.register_comm_hook(None, self.reducer.hook)
        params = [p for _, p in named]
        self.zero = None
        self.fp8_optimizer = recipe.optimizer != "adamw"  # FP8-LM Adam: gradients from the reducer's stash
        if not self.fp8_optimizer:
            optimizer: Any = torch.optim.AdamW(params, **hp, foreach=False)
        elif recipe.weight_storage == "fp8":
            self.zero = ZeroFp8Weights(named, self.fp8_names, rank=rank, world=world, count_bytes=self.counter.add,
                                       optimizer_kwargs={**hp, "backend": cfg.backend, "grad_source": self.reducer.grad_for})
            optimizer = self.zero.optimizer
            if world > 1:  # each FP8 gradient is reduced onto its owner only (reduce-scatter, no all-gather)
                self.reducer.owners = {n: o for (n, _), o in zip(self.zero.params, self.zero.owner)}
        else:
            optimizer = Fp8AdamW(params, **hp, backend=cfg.backend, grad_source=self.reducer.grad_for)
        self.optimizer = optimizer
        self.counter.pop()  # the initial weight gather is set-up, not a training step
        return module, optimizer

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

    def end_backward(self, params: list[torch.Tensor]) -> None:
        """After the backward: one rank reduces its FP8 gradients here (no DDP, no collectives)."""
        if self.reduce_inline:
            items = [(p, p.grad) for p in params if p.grad is not None]
            for (p, _), g in zip(items, self.reducer.reduce(items)):
                p.grad = g

    def clip_and_step(self, max_norm: float) -> float:
        """FP8-LM Adam's step: clipping goes into the gradients' scale_inv (the gradients live in
        the reducer's stash); returns the global gradient norm before clipping."""
        import torch.distributed as dist

        if self.reducer.owners is None:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for _, p in self.named if p.grad is not None]))
        else:  # ZeRO: each rank adds the squares of the gradients it owns (FP8 ones exist only there)
            mine = [p.grad for n, p in self.named if p.grad is not None and self.reducer.owners[n] == self.rank]
            grad_norm = float(torch.nn.utils.get_total_norm(mine)) if mine else 0.0
            sq = torch.tensor([grad_norm * grad_norm], dtype=torch.float64)
            dist.all_reduce(sq)
            self.counter.add("scales", "all_reduce", 8)
            grad_norm = float(sq.sqrt())
        coef = min(1.0, max_norm / (grad_norm + 1e-6))
        for _, p in self.named:
            p.grad = None
        (self.zero or self.optimizer).step(grad_scale=coef)
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
            dist.all_reduce(vec)
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
    def save_checkpoint(self, out: os.PathLike, step: int, payload: dict) -> None:
        """Write this rank's part of the checkpoint after ``step`` (a collective; see
        :mod:`fp8sim.training.dist_checkpoint`): ``payload`` plus the options and the reducer's
        AutoScale state; the model only on rank 0 (identical on every rank), the optimizer on
        rank 0 or, under ZeRO, every rank its shard."""
        from fp8sim.training.dist_checkpoint import save_rank_checkpoint

        payload = {**payload, "options": self.options(), "reducer": self.reducer.state_dict()}
        if self.rank != 0:
            payload["model"] = None
            if self.zero is None:
                payload["optimizer"] = None
        save_rank_checkpoint(out, step=step, rank=self.rank, world=self.world, payload=payload,
                             barrier=self.barrier if self.world > 1 else None)

    def load_checkpoint(self, out: os.PathLike) -> tuple[dict, dict]:
        """This rank's payload of the last complete checkpoint in ``out``, and rank 0's."""
        from fp8sim.training.dist_checkpoint import latest_checkpoint, load_rank_checkpoint

        info = latest_checkpoint(out)
        if info is None:
            raise ValueError(f"--resume: {out} holds no data-parallel checkpoint")
        ck = load_rank_checkpoint(out, self.rank, step=info["step"])
        first = ck if self.rank == 0 else load_rank_checkpoint(out, 0, step=info["step"])
        if ck["world"] != self.world:
            raise ValueError(f"--resume: {out} was checkpointed by {ck['world']} ranks, not {self.world}")
        if ck["options"] != self.options():
            raise ValueError(f"--resume: {out} was trained with {ck['options']}, not {self.options()}")
        return ck, first

    def load_state_dict(self, ck: dict, first: dict, optimizer: Any) -> None:
        """Restore the optimizer (rank 0's, or this rank's ZeRO shard, whose E4M3 weights are then
        gathered again as after the last step) and the reducer's AutoScale state."""
        if self.zero is not None:
            self.zero.optimizer.load_state_dict(ck["optimizer"])
            self.zero.gather()  # the E4M3 codes of the owners' masters, as after the last step
            self.counter.pop()
        else:
            optimizer.load_state_dict(first["optimizer"])
        self.reducer.load_state_dict(ck["reducer"])

    # -- the summary ------------------------------------------------------------------------------
    def memory(self) -> list[dict]:
        """Every rank's :func:`memory_breakdown` (a collective)."""
        import torch.distributed as dist

        mine = memory_breakdown(self.model, None if self.zero else self.optimizer, reducer=self.reducer,
                                zero=self.zero, fp8_names=self.fp8_names)
        if self.world == 1:
            return [mine]
        mems: list = [None] * self.world
        dist.all_gather_object(mems, mine)
        return mems

    def summary(self, rows: list[dict]) -> dict:
        """The run summary's data-parallel part, from the metrics ``rows``."""
        out: dict = {"options": self.options(), "nproc": self.world}
        if rows:
            comm = {k: sum(r["comm_bytes"][k] for r in rows) / len(rows) for k in rows[0]["comm_bytes"]}
            if comm["wgrad_bf16_equiv"]:
                comm["wgrad_fp8_vs_bf16"] = (comm["wgrad_fp8"] + comm["scales"]) / comm["wgrad_bf16_equiv"]
            out["comm_bytes_per_step"] = comm
            if self.grad_fp8_names:
                ar = {k: sum(r["allreduce"][k] for r in rows) for k in ("overflow", "underflow", "nonzero")}
                out["allreduce"] = {**ar, "mu_final": (rows[-1]["allreduce"]["mu_min"], rows[-1]["allreduce"]["mu_max"])}
        if self.zero is not None:
            out["zero_loads"] = self.zero.loads()
        return out


# -- the launcher -------------------------------------------------------------------------------


def train_distributed(
    cfg: Any,
    out_dir: str | os.PathLike,
    *,
    nproc: int = 1,
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
    ``nproc`` ranks into ``out_dir``; returns the run summary (``run.json``).

    Rank ``r`` takes rows ``[r B/N, (r+1) B/N)`` of the global batch ``B = cfg.batch_size`` (the
    same batches as a one-process run). Started under torchrun, the ranks come from the
    environment and ``nproc`` is ignored; else ``nproc > 1`` ranks are spawned (:mod:`fp8sim.
    training.spawn`). ``grad_scaling``, ``fp8_grads``: see :class:`DataParallel`. ``record``: a
    trace per rank in ``record/rank{r}`` (local weight gradients before the all-reduce).

    Checkpoints (:mod:`fp8sim.training.dist_checkpoint`: one file per rank, committed together)
    after every ``cfg.checkpoint_every`` steps and the last; ``resume=True`` continues the run in
    ``out_dir`` from its last complete checkpoint (same config, options and number of ranks),
    reproducing the uninterrupted run's losses bit for bit on CPU. ``stop_after``: stop after
    that step as if killed (no summary), for tests. ``metrics.jsonl`` rows carry, besides the
    single-process keys, ``comm_bytes`` and ``allreduce`` (see :meth:`DataParallel.step_metrics`).
    ``run_options``: stored in config.json (see :class:`~fp8sim.training.trainer.Trainer`).
    """
    from pathlib import Path

    from fp8sim.recipes import get_recipe
    from fp8sim.training.run_dir import start_mode

    env = torchrun_env()
    world = env[1] if env else nproc
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc!r}")
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} is not divisible by {world} ranks")
    DataParallel(0, world, grad_scaling=grad_scaling, fp8_grads=fp8_grads)  # checks the options
    if (grad_scaling or fp8_grads) and get_recipe(cfg.recipe).grad_comm != "fp8":
        raise ValueError(f"--grad-scaling/--fp8-grads apply to the FP8 all-reduce of the fp8lm recipes, "
                         f"not to {cfg.recipe_name!r}")
    out = Path(out_dir)
    start = start_mode(out, resume, data_parallel=True, config=cfg)
    if start == "resume":
        from fp8sim.training.dist_checkpoint import latest_checkpoint
        from fp8sim.training.run_dir import read_run_identity

        try:
            run_id = read_run_identity(out)[1]
        except FileNotFoundError:
            run_id = None
        info = latest_checkpoint(out)
        if info["world"] != world:
            raise ValueError(f"--resume: {out} was checkpointed by {info['world']} ranks, not {world}")
    else:  # a run here from now on (before any rank starts a trace): see Trainer
        from fp8sim.training.run_dir import new_run_id, read_run_identity, write_run_config

        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {out}: cannot create directory ({exc.strerror or exc})") from None
        try:  # a restart keeps the run's identity
            run_id = read_run_identity(out)[1] if start == "restart" else None
        except FileNotFoundError:
            run_id = None
        run_id = run_id or new_run_id()
        write_run_config(out, cfg, run_id, run_options)  # whole or absent
    opts = {"start": start, "grad_scaling": grad_scaling, "fp8_grads": fp8_grads,
            "record": None if record is None else str(record), "save_every": int(save_every), "progress": progress,
            "stop_after": stop_after, "run_options": run_options, "run_id": run_id}  # fmt: skip
    if env:
        run_rank(env[0], world, cfg.to_dict(), str(out), None, opts)
    elif world == 1:
        run_rank(0, 1, cfg.to_dict(), str(out), None, opts)
    else:
        from fp8sim.training.spawn import spawn_ranks

        spawn_ranks(world, cfg.to_dict(), str(out), opts)
    from fp8sim.training.run_dir import read_summary

    return read_summary(out / "run.json") if (out / "run.json").is_file() else {}


def run_rank(rank: int, world: int, cfg_dict: dict, out: str, init_file: str | None, opts: dict) -> None:
    """Rank ``rank`` of ``world``: join the process group (``world > 1``; ``init_file``: a
    ``file://`` store, None: ``env://``), train, leave the group. ``opts``: the launcher's
    ``start`` (see :func:`~fp8sim.training.trainer.start_mode`) and :func:`train_distributed`'s
    options."""
    import numba
    import torch.distributed as dist

    threads = max(1, (os.cpu_count() or 1) // world)
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    # one core per rank; numba kernels single-threaded: on the tiny model's tensors a parallel
    # launch costs more than the work (bit-exact either way: the kernels write disjoint outputs)
    torch.set_num_threads(min(torch_threads, threads))
    numba.set_num_threads(1)
    if world > 1:
        init_process_group(rank, world, init_file)
    try:
        _train_rank(rank, world, cfg_dict, out, opts)
        if world > 1:
            dist.barrier()  # run.json is written before any rank returns
    finally:
        if world > 1:
            leave_process_group()
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)


def _train_rank(rank: int, world: int, cfg_dict: dict, out: str, opts: dict) -> None:
    """The rank's training run."""
    from pathlib import Path

    from fp8sim.training.trainer import Trainer, TrainConfig

    cfg = TrainConfig.from_dict(cfg_dict)
    recorder_factory = None
    if opts.get("record"):
        from fp8sim.training.recorder import record

        def recorder_factory(model: torch.nn.Module):
            return record(model, Path(opts["record"]) / f"rank{rank}", save_every=opts["save_every"],
                          chunk_steps=max(1, cfg.checkpoint_every), append=opts["start"] != "fresh",
                          config={"run": cfg.to_dict(), "rank": rank, "world": world, "run_dir": out,
                                  "run_id": opts.get("run_id")})  # fmt: skip

    dp = DataParallel(rank, world, grad_scaling=opts.get("grad_scaling"), fp8_grads=opts.get("fp8_grads"))
    trainer = Trainer(cfg, out, data_parallel=dp, start=opts["start"], recorder_factory=recorder_factory,
                      run_options=opts.get("run_options"), run_id=opts.get("run_id"))
    trainer.run(progress=opts.get("progress"), stop_after=opts.get("stop_after"))
