"""FP8-LM on torch.distributed: process groups, the data-parallel run and memory accounting.

Process groups: gloo on CPU, nccl on CUDA; started by ``torchrun`` (``env://``) or spawned by
:func:`train_distributed` through ``torch.multiprocessing`` (a ``file://`` store in a temporary
directory: no ports). :func:`train_distributed` runs every recipe -- ``bf16``, the TE recipes and
FP8-LM's O1/O2/O3 -- data-parallel over N ranks (one rank: the same code without collectives).
The FP8 gradient all-reduce itself (a DDP communication hook) and its byte accounting live in
:mod:`fp8sim.training.fp8_allreduce`.
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
    "init_process_group",
    "torchrun_env",
    "memory_breakdown",
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


# -- the data-parallel run ----------------------------------------------------------------------


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
) -> dict:
    """Train ``cfg`` (a :class:`~fp8sim.training.trainer.TrainConfig`) data-parallel over
    ``nproc`` ranks into ``out_dir``; returns the run summary (``run.json``).

    Rank ``r`` takes rows ``[r B/N, (r+1) B/N)`` of the global batch ``B = cfg.batch_size`` (the
    same batches as a one-process run). Started under torchrun, the ranks come from the
    environment and ``nproc`` is ignored. ``grad_scaling``: ``autoscale`` (default, the recipe's)
    or ``msamp`` for the FP8 all-reduce; ``fp8_grads``: ``all`` or ``linear`` (default: the
    recipe's), which gradients travel in FP8. ``record``: a trace per rank in ``record/rank{r}``
    (local weight gradients before the all-reduce).

    Checkpoints (:mod:`fp8sim.training.dist_checkpoint`: one file per rank, committed together)
    after every ``cfg.checkpoint_every`` steps and the last; ``resume=True`` continues the run in
    ``out_dir`` from its last complete checkpoint (same config, options and number of ranks),
    reproducing the uninterrupted run's losses bit for bit on CPU. ``stop_after``: stop after
    that step as if killed (no summary), for tests. ``metrics.jsonl`` rows carry, besides the
    single-process keys, ``comm_bytes`` (mean bytes a rank sent that step, per category,
    plus what BF16 would send for the FP8 payloads) and ``allreduce`` (FP8 sums that saturated,
    inputs that underflowed, AutoScale's mu range).
    """
    from pathlib import Path

    from fp8sim.training.recipes import get_recipe

    env = torchrun_env()
    world = env[1] if env else nproc
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc!r}")
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} is not divisible by {world} ranks")
    if grad_scaling is not None and grad_scaling.split(":")[0] not in GRAD_SCALINGS:
        raise ValueError(f"gradient scaling must be one of {GRAD_SCALINGS}, got {grad_scaling!r}")
    if fp8_grads is not None and fp8_grads not in FP8_GRAD_SCOPES:
        raise ValueError(f"fp8_grads must be one of {FP8_GRAD_SCOPES}, got {fp8_grads!r}")
    if (grad_scaling or fp8_grads) and get_recipe(cfg.recipe).grad_comm != "fp8":
        raise ValueError(f"--grad-scaling/--fp8-grads apply to the FP8 all-reduce of the fp8lm recipes, "
                         f"not to {cfg.recipe!r}")
    out = Path(out_dir)
    from fp8sim.training.trainer import start_mode

    mode = start_mode(out, resume, data_parallel=True, config=cfg.to_dict())
    restart, resume = mode == "restart", mode == "resume"
    if resume:
        from fp8sim.training.dist_checkpoint import latest_checkpoint

        info = latest_checkpoint(out)
        if info["world"] != world:
            raise ValueError(f"--resume: {out} was checkpointed by {info['world']} ranks, not {world}")
    if not resume:  # a run here from now on (before any rank starts a trace): see Trainer
        import json

        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    opts = {"restart": restart, "grad_scaling": grad_scaling, "fp8_grads": fp8_grads, "record": None if record is None else str(record),
            "save_every": int(save_every), "progress": progress, "resume": bool(resume), "stop_after": stop_after}
    if env:
        _run_rank(env[0], world, cfg.to_dict(), str(out), None, opts)
    elif world == 1:
        _run_rank(0, 1, cfg.to_dict(), str(out), None, opts)
    else:
        import tempfile

        import torch.multiprocessing as mp

        from fp8sim.training.spawn import rank_error, spawned_rank

        import logging

        spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..."
        level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)
        try:
            with tempfile.TemporaryDirectory(prefix="fp8sim-pg-") as d:
                mp.spawn(spawned_rank, args=(os.getpid(), world, cfg.to_dict(), str(out), os.path.join(d, "store"),
                                              opts), nprocs=world, join=True)  # fmt: skip
        except mp.ProcessRaisedException as exc:
            if os.environ.get("FP8SIM_DEBUG") == "1":
                raise  # the rank's traceback
            raise rank_error(exc) from None
        finally:
            spawn_log.setLevel(level)
    import json

    return json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}


def _run_rank(rank: int, world: int, cfg_dict: dict, out: str, init_file: str | None, opts: dict) -> None:
    import torch.distributed as dist

    from fp8sim.training.trainer import TrainConfig

    import numba

    threads = max(1, (os.cpu_count() or 1) // world)
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    # one core per rank; numba kernels single-threaded: on the tiny model's tensors a parallel
    # launch costs more than the work (bit-exact either way: the kernels write disjoint outputs)
    torch.set_num_threads(min(torch_threads, threads))
    numba.set_num_threads(1)
    if world > 1:
        init_process_group(rank, world, init_file)
    try:
        _RankRun(rank, world, TrainConfig.from_dict(cfg_dict), out, opts).run()
        if world > 1:
            dist.barrier()  # run.json is written before any rank returns
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)


class _RankRun:
    """One rank of a data-parallel run (see :func:`train_distributed`)."""

    def __init__(self, rank: int, world: int, cfg: Any, out: str, opts: dict) -> None:
        from pathlib import Path

        from fp8sim.training.data import load_corpus
        from fp8sim.training.fp8_linear import convert_to_fp8, fp8_linears, get_fp8_state
        from fp8sim.training.model import GPT
        from fp8sim.training.optim import Fp8AdamW
        from fp8sim.training.recipes import get_recipe
        from fp8sim.training.zero import ZeroFp8Weights

        self.rank, self.world, self.cfg, self.opts = rank, world, cfg, opts
        self.out = Path(out)
        self.recipe = r = get_recipe(cfg.recipe)
        self.corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes)
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.model)
        if r.is_fp8:
            convert_to_fp8(self.model, r, cfg.backend, gemm_accumulate=cfg.gemm_accumulate)
        self.fp8 = get_fp8_state(self.model)
        self.named = named = list(self.model.named_parameters())
        self.params = [p for _, p in named]
        fp8_comm = r.grad_comm == "fp8"
        # fp8_names: the FP8 linears' weights (E4M3-stored under O3, the accounting's "fp8_weights");
        # grad_fp8_names: the parameters whose gradients travel (and are kept) in FP8
        self.fp8_names = {f"{m.name}.weight" for m in fp8_linears(self.model)} if fp8_comm else set()
        self.grad_scope = opts.get("fp8_grads") or dict(r.extra).get("fp8_grads", "linear")
        self.grad_fp8_names = ({n for n, _ in named} if fp8_comm and self.grad_scope == "all" else self.fp8_names)
        other = torch.bfloat16 if (fp8_comm or r.grad_comm == "bf16" or r.autocast == "bfloat16") else torch.float32
        self.grad_scaling = scaling = opts.get("grad_scaling") or dict(r.extra).get("grad_scaling", "autoscale")
        self.counter = CommCounter(world)
        self.reducer = Fp8GradReducer(named, self.grad_fp8_names, world=world, scaling=scaling, other_dtype=other,
                                      backend=cfg.backend, counter=self.counter)
        self.reduce_inline = world == 1 and fp8_comm  # one rank: FP8 gradients all the same, no collectives
        self.ddp: torch.nn.Module = self.model
        if world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
            self.ddp.register_comm_hook(None, self.reducer.hook)
        hp = {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": cfg.weight_decay}
        self.zero = None
        if r.optimizer == "adamw":
            self.optimizer: Any = torch.optim.AdamW(self.params, **hp, foreach=False)
        elif r.weight_storage == "fp8":
            self.zero = ZeroFp8Weights(named, self.fp8_names, rank=rank, world=world, count_bytes=self.counter.add,
                                       optimizer_kwargs={**hp, "backend": cfg.backend, "grad_source": self.reducer.grad_for})
            self.optimizer = self.zero.optimizer
            if world > 1:  # each FP8 gradient is reduced onto its owner only (reduce-scatter, no all-gather)
                self.reducer.owners = {n: o for (n, _), o in zip(self.zero.params, self.zero.owner)}
        else:
            self.optimizer = Fp8AdamW(self.params, **hp, backend=cfg.backend, grad_source=self.reducer.grad_for)
        self.counter.pop()  # the initial weight gather is set-up, not a training step
        self.start_step = 0
        ck = self._resume() if opts.get("resume") else None
        self.recorder = None
        if opts.get("record"):
            from fp8sim.training.recorder import record

            self.recorder = record(self.model, Path(opts["record"]) / f"rank{rank}", save_every=opts["save_every"],
                                   chunk_steps=max(1, cfg.checkpoint_every),
                                   append=ck is not None or bool(opts.get("restart")),
                                   config={"run": cfg.to_dict(), "rank": rank, "world": world, "run_dir": out})
            if ck is not None or opts.get("restart"):
                self.recorder.truncate_after(self.start_step)  # the steps after it are recorded again
                if ck is not None and ck.get("recorder"):
                    self.recorder.load_state_dict(ck["recorder"])
        if rank == 0 and ck is None:
            import json

            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            (self.out / "metrics.jsonl").write_text("")

    # -- checkpoints ------------------------------------------------------------------------------
    def _run_options(self) -> dict:
        """The options that change a run's numbers besides its config (checked on resume)."""
        return {"grad_scaling": self.grad_scaling, "fp8_grads": self.grad_scope}

    def checkpoint_payload(self) -> dict:
        """This rank's part of a checkpoint (see :mod:`fp8sim.training.dist_checkpoint`)."""
        from fp8sim.training.checkpoint import capture_rng

        sharded = self.zero is not None
        return {
            "config": self.cfg.to_dict(), "options": self._run_options(), "rng": capture_rng(),
            "policies": self.fp8.state_dict() if self.fp8 is not None else None,
            "reducer": self.reducer.state_dict(),
            "optimizer": self.optimizer.state_dict() if (sharded or self.rank == 0) else None,
            "model": self.model.state_dict() if self.rank == 0 else None,
            "recorder": self.recorder.state_dict() if self.recorder is not None else None,
            "corpus": self.corpus.fingerprint,
        }

    def save(self, step: int) -> None:
        """Checkpoint after ``step`` (collective: every rank calls it). The trace is flushed first,
        so a checkpoint never points past the steps the trace holds."""
        import torch.distributed as dist

        from fp8sim.training.dist_checkpoint import save_rank_checkpoint

        if self.recorder is not None:
            self.recorder.flush()
        save_rank_checkpoint(self.out, step=step, rank=self.rank, world=self.world, payload=self.checkpoint_payload(),
                             barrier=dist.barrier if self.world > 1 else None)

    def _resume(self) -> dict:
        """Restore the last complete checkpoint; returns this rank's payload."""
        from fp8sim.training.checkpoint import restore_rng
        from fp8sim.training.dist_checkpoint import load_rank_checkpoint, latest_checkpoint
        from fp8sim.training.trainer import _check_corpus, read_metrics

        info = latest_checkpoint(self.out)
        if info is None:
            raise ValueError(f"--resume: {self.out} holds no data-parallel checkpoint")
        ck = load_rank_checkpoint(self.out, self.rank, step=info["step"])
        first = ck if self.rank == 0 else load_rank_checkpoint(self.out, 0, step=info["step"])
        if ck["world"] != self.world:
            raise ValueError(f"--resume: {self.out} was checkpointed by {ck['world']} ranks, not {self.world}")
        if ck["config"] != self.cfg.to_dict():
            diff = sorted(k for k, v in self.cfg.to_dict().items() if ck["config"].get(k) != v)
            raise ValueError(f"--resume: {self.out} was written by a different config (differs in {diff})")
        _check_corpus(self.out, ck, self.corpus)
        if ck["options"] != self._run_options():
            raise ValueError(f"--resume: {self.out} was trained with {ck['options']}, not {self._run_options()}")
        with torch.no_grad():
            self.model.load_state_dict(first["model"])
        if self.zero is not None:
            self.zero.optimizer.load_state_dict(ck["optimizer"])
            self.zero.gather()  # the E4M3 codes of the owners' masters, as after the last step
            self.counter.pop()
        else:
            self.optimizer.load_state_dict(first["optimizer"])
        if self.fp8 is not None:
            self.fp8.load_state_dict(ck["policies"])
        self.reducer.load_state_dict(ck["reducer"])
        restore_rng(ck["rng"])
        self.start_step = int(ck["step"])
        if self.rank == 0:  # the steps after the checkpoint are run (and logged) again
            from fp8sim.training.trainer import write_metrics

            write_metrics(self.out, [r for r in read_metrics(self.out) if r["step"] <= self.start_step])
        return ck

    def _autocast(self):
        import contextlib

        if self.recipe.autocast == "bfloat16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, step: int) -> dict:
        import time

        import torch.distributed as dist

        from fp8sim.training.data import get_batch

        cfg, world = self.cfg, self.world
        t0 = time.perf_counter()
        x, y = get_batch(self.corpus, "train", step - 1, cfg.batch_size, cfg.model.block_size, cfg.seed)
        b = cfg.batch_size // world
        x, y = x[self.rank * b : (self.rank + 1) * b], y[self.rank * b : (self.rank + 1) * b]
        lr = cfg.lr_at(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.fp8 is not None:
            self.fp8.step = step
        if self.recorder is not None:
            self.recorder.begin_step(step)
        self.model.train()
        for p in self.params:
            p.grad = None
        self.reducer.stash.clear()
        with self._autocast():
            _, loss = self.ddp(x, y)
        loss.backward()
        if self.reduce_inline:
            items = [(p, p.grad) for p in self.params if p.grad is not None]
            for (p, _), g in zip(items, self.reducer.reduce(items)):
                p.grad = g
        if self.recorder is not None:
            self.recorder.end_step(step)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        if isinstance(self.optimizer, torch.optim.AdamW):
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            self.optimizer.step()
        else:  # FP8-LM Adam: clipping goes into the gradients' scale_inv; the grads live in the stash
            if self.reducer.owners is None:
                grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]))
            else:  # ZeRO: each rank adds the squares of the gradients it owns (FP8 ones exist only there)
                mine = [p.grad for n, p in self.named if p.grad is not None and self.reducer.owners[n] == self.rank]
                grad_norm = float(torch.nn.utils.get_total_norm(mine)) if mine else 0.0
                sq = torch.tensor([grad_norm * grad_norm], dtype=torch.float64)
                dist.all_reduce(sq)
                self.counter.add("scales", "all_reduce", 8)
                grad_norm = float(sq.sqrt())
            coef = min(1.0, max_norm / (grad_norm + 1e-6))
            for p in self.params:
                p.grad = None
            (self.zero or self.optimizer).step(grad_scale=coef)
        events = self.fp8.pop_events() if self.fp8 is not None else {}
        comm, ar = self.counter.pop(), self.reducer.pop_stats()
        keys = list(comm)
        vec = torch.tensor([float(loss.detach()), events.get("overflow", 0), events.get("underflow", 0),
                            ar["overflow"], ar["underflow"], ar["nonzero"], *comm.values()], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(vec)  # logging only (not counted)
        dt = time.perf_counter() - t0
        row = {"step": step, "loss": float(vec[0]) / world, "lr": lr, "grad_norm": grad_norm, "step_time_s": dt,
               "tokens_per_s": cfg.batch_size * cfg.model.block_size / dt}
        if self.fp8 is not None:
            row.update(overflow=int(vec[1]), underflow=int(vec[2]))
        row["comm_bytes"] = {k: float(v) / world for k, v in zip(keys, vec[6:].tolist())}
        if self.grad_fp8_names:
            mu = self.reducer.mu_range()
            row["allreduce"] = {"overflow": int(vec[3]), "underflow": int(vec[4]), "nonzero": int(vec[5]),
                                "mu_min": mu and mu[0], "mu_max": mu and mu[1]}
        return row

    def evaluate(self) -> float:
        from fp8sim.training.trainer import mean_val_loss

        return mean_val_loss(self.model, self.corpus, self.cfg, self.fp8, self._autocast)

    def memory(self) -> dict:
        return memory_breakdown(self.model, None if self.zero else self.optimizer, reducer=self.reducer,
                                zero=self.zero, fp8_names=self.fp8_names)

    def run(self) -> None:
        import json
        import sys
        import time

        from tqdm import tqdm

        cfg = self.cfg
        show = self.opts.get("progress")
        show = sys.stderr.isatty() if show is None else show
        bar = tqdm(total=cfg.steps, disable=not (show and self.rank == 0), unit="step", file=sys.stderr,
                   desc=f"{cfg.recipe}/{cfg.backend} x{self.world}", dynamic_ncols=True)
        t_start = time.perf_counter()
        last = cfg.steps if self.opts.get("stop_after") is None else min(cfg.steps, int(self.opts["stop_after"]))
        bar.update(self.start_step)
        done = self.start_step  # the last step whose records are whole
        try:
            for step in range(self.start_step + 1, last + 1):
                row = self.train_step(step)
                done = step
                if self.rank == 0:
                    if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                        row["val_loss"] = self.evaluate()
                    with open(self.out / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(row) + "\n")
                if step == cfg.steps:  # run.json before the final checkpoint: see Trainer.run
                    self._summarize(t_start)
                if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                    self.save(step)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}")
        finally:
            bar.close()
            if self.recorder is not None:
                if sys.exc_info()[0] is not None:  # interrupted: a step cut short is not written
                    self.recorder.discard_after(done)
                if last == cfg.steps:
                    self.recorder.close()
                else:
                    self.recorder.flush()
        if self.start_step >= cfg.steps and not (self.out / "run.json").is_file():
            self._summarize(t_start)  # a finished run of an older version, without its run.json

    def _summarize(self, t_start: float) -> None:
        """Write run.json (collective: the ranks' memory figures are gathered)."""
        import time

        import torch.distributed as dist

        mems = [self.memory()]
        if self.world > 1:
            mems = [None] * self.world
            dist.all_gather_object(mems, self.memory())
        if self.rank == 0:
            from fp8sim.training.trainer import read_metrics

            self._finish(read_metrics(self.out), mems, time.perf_counter() - t_start)

    def _finish(self, rows: list[dict], mems: list[dict], wall_s: float) -> None:
        cfg = self.cfg
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        comm = {k: sum(r["comm_bytes"][k] for r in rows) / len(rows) for k in rows[0]["comm_bytes"]}
        if comm["wgrad_bf16_equiv"]:
            comm["wgrad_fp8_vs_bf16"] = (comm["wgrad_fp8"] + comm["scales"]) / comm["wgrad_bf16_equiv"]
        times = sorted(r["step_time_s"] for r in rows)
        summary = {
            "config": cfg.to_dict(), "recipe": self.recipe.to_dict(), "options": self._run_options(),
            "nproc": self.world,
            "parameters": self.model.num_params(), "steps_done": rows[-1]["step"],
            "final_loss": rows[-1]["loss"], "final_val_loss": vals[-1] if vals else None,
            "overflow": sum(r.get("overflow", 0) for r in rows), "underflow": sum(r.get("underflow", 0) for r in rows),
            "memory_bytes_per_param": mems[0], "memory_bytes_per_param_ranks": mems,
            "comm_bytes_per_step": comm,
            "median_step_time_s": times[len(times) // 2], "wall_s": wall_s,
            "corpus": {"source": self.corpus.source, "bytes": self.corpus.num_bytes, "files": self.corpus.num_files},
        }
        if self.grad_fp8_names:
            summary["allreduce"] = {k: sum(r["allreduce"][k] for r in rows) for k in ("overflow", "underflow", "nonzero")}
            summary["allreduce"]["mu_final"] = rows[-1]["allreduce"]["mu_min"], rows[-1]["allreduce"]["mu_max"]
        if self.zero is not None:
            summary["zero_loads"] = self.zero.loads()
        from fp8sim.training.trainer import write_json

        write_json(self.out / "run.json", summary)
