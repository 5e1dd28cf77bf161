"""FP8-LM on torch.distributed: process groups, the FP8 gradient all-reduce (a DDP communication
hook) and communication accounting.

Process groups: gloo on CPU, nccl on CUDA; started by ``torchrun`` (``env://``) or spawned by
:func:`train_distributed` through ``torch.multiprocessing`` (a ``file://`` store in a temporary
directory: no ports). :func:`train_distributed` runs every recipe -- ``bf16``, the TE recipes and
FP8-LM's O1/O2/O3 -- data-parallel over N ranks (one rank: the same code without collectives).

The FP8 all-reduce (FP8-LM section 2.1) of the FP8 linears' weight gradients, per DDP bucket:

1. every rank computes its scale per tensor, ``mu * fmt.max / amax_local`` with AutoScale's
   ``mu`` (:class:`fp8sim.policies.AutoScale`; or MS-AMP's fixed ``2**floor(log2(fmt.max /
   amax)) / sqrt(N)`` with ``scaling="msamp"``);
2. one ``all_reduce(MIN)`` of the scales gives the shared scale ``s`` (the paper's global minimum);
3. every rank encodes ``encode(float32(g) * s)`` (E4M3, nearest even, saturating) to uint8 codes;
4. reduce-scatter as ``all_to_all`` of the uint8 payload (padded to a multiple of N): each rank
   decodes the N copies of its chunk, sums them in float32 (exact: see
   :func:`fp8sim.training.allreduce_sim.sum_codes`) and re-encodes the sum once;
5. ``all_gather`` of the uint8 chunks; the average gradient is ``decode(codes) * scale_inv`` with
   ``scale_inv = float32(float32(1 / s) / N)``.

AutoScale observes the share of summed codes at ``fmt.max`` (identical on every rank, so the
policies stay in step without communication). The other gradients are averaged by an
``all_reduce`` in bfloat16 (or float32). The reduced gradients are kept in :attr:`Fp8GradReducer.stash`
as they were communicated (codes + scale_inv, or bfloat16 values) for the FP8 optimizer.

Bytes are counted per rank with the ring algorithms' volumes (:func:`ring_bytes`).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from fp8sim.formats import get_format
from fp8sim.training.allreduce_sim import decode_codes, sum_codes

__all__ = [
    "GRAD_SCALINGS",
    "COMM_CATEGORIES",
    "ring_bytes",
    "CommCounter",
    "Fp8GradReducer",
    "init_process_group",
    "torchrun_env",
    "memory_breakdown",
    "train_distributed",
]

#: how the shared gradient scale is chosen: FP8-LM's AutoScale or MS-AMP's fixed 1/sqrt(N)
GRAD_SCALINGS = ("autoscale", "msamp")
#: categories of the bytes a rank sends
COMM_CATEGORIES = ("wgrad_fp8", "scales", "grads_other", "weights")


def ring_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends in a collective over ``world`` ranks on a ring, for a payload of
    ``nbytes`` (the whole tensor): ``all_reduce`` ``2 (N-1)/N B``; ``all_to_all``,
    ``reduce_scatter``, ``all_gather`` and (pipelined, averaged over ranks) ``broadcast``
    ``(N-1)/N B``. Rounded up to whole bytes; 0 for one rank."""
    factor = {"all_reduce": 2, "all_to_all": 1, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}
    if op not in factor:
        raise ValueError(f"ring_bytes: unknown collective {op!r}; valid: {', '.join(factor)}")
    return -(-factor[op] * (world - 1) * int(nbytes) // world)


class CommCounter:
    """Bytes this rank sends, per category, since the last :meth:`pop`; also what BF16 would
    send for the FP8 payloads (``wgrad_bf16_equiv``)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.counts: Counter = Counter()

    def add(self, category: str, op: str, nbytes: int) -> None:
        self.counts[category] += ring_bytes(op, nbytes, self.world)

    def pop(self) -> dict[str, int]:
        out = {k: int(self.counts.get(k, 0)) for k in (*COMM_CATEGORIES, "wgrad_bf16_equiv")}
        self.counts.clear()
        return out


def torchrun_env() -> tuple[int, int] | None:
    """``(rank, world_size)`` when started by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_process_group(rank: int, world: int, init_file: str | None = None) -> str:
    """Join the default process group: nccl when CUDA is available, else gloo; ``env://`` under
    torchrun, else the ``file://`` store ``init_file``. Returns the backend name."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    method = "env://" if init_file is None else f"file://{init_file}"
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=world)
    return backend


class Fp8GradReducer:
    """Averages gradients across ranks: FP8 for the FP8 linears' weights, bf16/fp32 for the rest.

    Use as a DDP communication hook (``ddp.register_comm_hook(None, reducer.hook)``) or call
    :meth:`reduce` on ``(parameter, gradient)`` pairs directly (one process: no communication).

    Args:
        named_params: ``(name, parameter)`` of the model (names key the AutoScale states).
        fp8_names: parameters whose gradients travel in FP8.
        world: number of ranks; group: the process group (None: default).
        fmt: gradient format (``e4m3``, FP8-LM's choice).
        scaling: ``"autoscale"`` (or an ``autoscale:...`` spec) or ``"msamp"``.
        other_dtype: dtype of the other gradients' all-reduce (torch.bfloat16 or torch.float32).
        backend: FP8 backend name or object (quantize / amax).
        counter: a :class:`CommCounter` (created if None).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        fp8_names: set[str],
        *,
        world: int,
        group: Any = None,
        fmt: str = "e4m3",
        scaling: str = "autoscale",
        other_dtype: torch.dtype = torch.bfloat16,
        backend: str | Any = "emulator",
        counter: CommCounter | None = None,
    ) -> None:
        from fp8sim import backends
        from fp8sim.policies import parse_policy

        if scaling.split(":")[0] not in GRAD_SCALINGS:
            raise ValueError(f"gradient scaling must be one of {GRAD_SCALINGS}, got {scaling!r}")
        if other_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"other_dtype must be torch.bfloat16 or torch.float32, got {other_dtype}")
        self.names = {id(p): n for n, p in named_params}
        self.fp8_names = set(fp8_names)
        self.world, self.group = world, group
        self.fmt = get_format(fmt)
        self.scaling = scaling
        self.policy = parse_policy(scaling) if scaling.startswith("autoscale") else None
        self.other_dtype = other_dtype
        self.backend = backends.get(backend) if isinstance(backend, str) else backend
        self.counter = counter if counter is not None else CommCounter(world)
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.stats: Counter = Counter()

    # -- DDP hook -------------------------------------------------------------------------------
    def hook(self, state, bucket):  # no annotations: DDP checks them against its own types
        """DDP communication hook: reduce the bucket's gradients in place, return a done future."""
        buf = bucket.buffer()  # the flat concatenation of the bucket's gradients, in order
        outs = self.reduce(list(zip(bucket.parameters(), bucket.gradients())))
        buf.copy_(torch.cat([o.reshape(-1) for o in outs]).to(buf.dtype))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def reduce(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Average the gradients of ``(parameter, gradient)`` pairs over ranks; float32 results
        in the same order. Every rank must call it with the same parameters in the same order."""
        fp8 = [i for i, (p, _) in enumerate(items) if self.names.get(id(p)) in self.fp8_names]
        fp8_set = set(fp8)
        other = [i for i in range(len(items)) if i not in fp8_set]
        out: list[torch.Tensor | None] = [None] * len(items)
        if fp8:
            for i, r in zip(fp8, self._reduce_fp8([items[i] for i in fp8])):
                out[i] = r
        if other:
            for i, r in zip(other, self._reduce_other([items[i] for i in other])):
                out[i] = r
        return out  # type: ignore[return-value]

    def grad_for(self, p: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """The reduced gradient of ``p`` as the optimizer consumes it: ``(values, scale_inv)``
        (decoded codes and their scale_inv, or the bf16/fp32 average and 1)."""
        got = self.stash.get(id(p))
        if got is None:
            return None
        t, sinv = got
        if sinv is None:
            return t, 1.0
        return decode_codes(t, self.fmt), float(sinv)

    def stash_bytes(self, p: torch.Tensor) -> int:
        """Bytes of ``p``'s stored reduced gradient (codes + 4-byte scale_inv, or the values)."""
        t, sinv = self.stash[id(p)]
        return t.numel() * t.element_size() + (4 if sinv is not None else 0)

    # -- FP8 path -------------------------------------------------------------------------------
    def _local_scale(self, name: str, amax: float) -> float:
        from fp8sim.scaling import scale_from_amax

        if self.policy is not None:
            return float(self.policy.scale_for(name, self.fmt, current_amax=amax))
        base = float(scale_from_amax(np.float32(amax), self.fmt, pow2=True))  # MS-AMP: pow2, then 1/sqrt(N)
        return float(np.float32(base / math.sqrt(self.world)))

    def _reduce_fp8(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        import torch.distributed as dist

        n, fmt = self.world, self.fmt
        names = [self.names[id(p)] for p, _ in items]
        grads = [g.detach().to(torch.float32) for _, g in items]
        amaxes = [float(self.backend.amax(g)) for g in grads]
        scales = torch.tensor([self._local_scale(nm, a) for nm, a in zip(names, amaxes)], dtype=torch.float32)
        if n > 1:
            dist.all_reduce(scales, op=dist.ReduceOp.MIN, group=self.group)  # the shared scale
        self.counter.add("scales", "all_reduce", scales.numel() * 4)
        codes = []
        for g, s in zip(grads, scales):
            c, _ = self.backend.quantize(g, fmt, s)
            mag = c & (fmt.sign_mask - 1)
            nz = g != 0
            self.stats["underflow"] += int((nz & (mag == 0)).sum())
            self.stats["nonzero"] += int(nz.sum())
            codes.append(c.reshape(-1))
        flat = torch.cat(codes)
        numel = flat.numel()
        pad = (-numel) % n
        if pad:
            flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8, device=flat.device)])
        if n > 1:
            mine = torch.empty_like(flat)
            dist.all_to_all_single(mine, flat, group=self.group)  # chunk r of every rank -> rank r
            summed, over = sum_codes(list(mine.chunk(n)), fmt, self.backend)
            full = torch.empty_like(flat)
            dist.all_gather(list(full.chunk(n)), summed, group=self.group)
        else:
            full, over = sum_codes([flat], fmt, self.backend)
        self.stats["overflow"] += over  # of this rank's chunk
        self.counter.add("wgrad_fp8", "all_to_all", flat.numel())
        self.counter.add("wgrad_fp8", "all_gather", flat.numel())
        self.counter.add("wgrad_bf16_equiv", "all_reduce", 2 * numel)
        out, off = [], 0
        for (p, g), nm, s, a in zip(items, names, scales, amaxes):
            c = full[off : off + g.numel()].view(g.shape)
            off += g.numel()
            sinv = (torch.reciprocal(s) / n).to(torch.float32)
            self.stash[id(p)] = (c, sinv)
            out.append(decode_codes(c, fmt) * sinv)
            if self.policy is not None:
                at_max = int(((c & (fmt.sign_mask - 1)) == fmt.max_code).sum())
                self.policy.observe(nm, a, fmt, numel=c.numel(), n_at_max=at_max)
        return out

    # -- the other gradients --------------------------------------------------------------------
    def _reduce_other(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        import torch.distributed as dist

        flat = torch.cat([g.detach().reshape(-1).to(self.other_dtype) for _, g in items])
        if self.world > 1:
            dist.all_reduce(flat, group=self.group)
        self.counter.add("grads_other", "all_reduce", flat.numel() * flat.element_size())
        avg = (flat.float() / self.world).to(self.other_dtype)  # exact for a power-of-two N
        out, off = [], 0
        for p, g in items:
            v = avg[off : off + g.numel()].view(g.shape)
            off += g.numel()
            self.stash[id(p)] = (v, None)
            out.append(v.float())
        return out

    def mu_range(self) -> tuple[float, float] | None:
        """Smallest and largest AutoScale mu over the tensors seen (None for MS-AMP scaling)."""
        if self.policy is None:
            return None
        mus = [self.policy.mu(n) for n in sorted(self.fp8_names)]
        return (min(mus), max(mus)) if mus else None

    def pop_stats(self) -> dict[str, int]:
        out = {k: int(self.stats.get(k, 0)) for k in ("overflow", "underflow", "nonzero")}
        self.stats.clear()
        return out


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
    record: str | os.PathLike | None = None,
    save_every: int = 0,
    progress: bool | None = None,
) -> dict:
    """Train ``cfg`` (a :class:`~fp8sim.training.trainer.TrainConfig`) data-parallel over
    ``nproc`` ranks into ``out_dir``; returns the run summary (``run.json``).

    Rank ``r`` takes rows ``[r B/N, (r+1) B/N)`` of the global batch ``B = cfg.batch_size`` (the
    same batches as a one-process run). Started under torchrun, the ranks come from the
    environment and ``nproc`` is ignored. ``grad_scaling``: ``autoscale`` (default, the recipe's)
    or ``msamp`` for the FP8 all-reduce. ``record``: a trace per rank in ``record/rank{r}``
    (local weight gradients before the all-reduce). ``metrics.jsonl`` rows carry, besides the
    single-process keys, ``comm_bytes`` (mean bytes a rank sent that step, per category,
    plus what BF16 would send for the FP8 payloads) and ``allreduce`` (FP8 sums that saturated,
    inputs that underflowed, AutoScale's mu range).
    """
    from pathlib import Path

    env = torchrun_env()
    world = env[1] if env else nproc
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc!r}")
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} is not divisible by {world} ranks")
    if grad_scaling is not None and grad_scaling.split(":")[0] not in GRAD_SCALINGS:
        raise ValueError(f"gradient scaling must be one of {GRAD_SCALINGS}, got {grad_scaling!r}")
    out = Path(out_dir)
    if (out / "metrics.jsonl").exists():
        raise ValueError(f"{out} already holds a run; choose another output directory")
    opts = {"grad_scaling": grad_scaling, "record": None if record is None else str(record),
            "save_every": int(save_every), "progress": progress}
    if env:
        _run_rank(env[0], world, cfg.to_dict(), str(out), None, opts)
    elif world == 1:
        _run_rank(0, 1, cfg.to_dict(), str(out), None, opts)
    else:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="fp8sim-pg-") as d:
            mp.spawn(_run_rank, args=(world, cfg.to_dict(), str(out), os.path.join(d, "store"), opts),
                     nprocs=world, join=True)
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
            convert_to_fp8(self.model, r, cfg.backend)
        self.fp8 = get_fp8_state(self.model)
        named = list(self.model.named_parameters())
        self.params = [p for _, p in named]
        fp8_comm = r.grad_comm == "fp8"
        self.fp8_names = {f"{m.name}.weight" for m in fp8_linears(self.model)} if fp8_comm else set()
        other = torch.bfloat16 if (fp8_comm or r.grad_comm == "bf16" or r.autocast == "bfloat16") else torch.float32
        scaling = opts.get("grad_scaling") or dict(r.extra).get("grad_scaling", "autoscale")
        self.counter = CommCounter(world)
        self.reducer = Fp8GradReducer(named, self.fp8_names, world=world, scaling=scaling, other_dtype=other,
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
        else:
            self.optimizer = Fp8AdamW(self.params, **hp, backend=cfg.backend, grad_source=self.reducer.grad_for)
        self.counter.pop()  # the initial weight gather is set-up, not a training step
        self.recorder = None
        if opts.get("record"):
            from fp8sim.training.recorder import record

            self.recorder = record(self.model, Path(opts["record"]) / f"rank{rank}", save_every=opts["save_every"],
                                   chunk_steps=max(1, cfg.checkpoint_every),
                                   config={"run": cfg.to_dict(), "rank": rank, "world": world, "run_dir": out})
        if rank == 0:
            import json

            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            (self.out / "metrics.jsonl").write_text("")

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
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None]))
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
        if self.fp8_names:
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

        import torch.distributed as dist
        from tqdm import tqdm

        cfg = self.cfg
        show = self.opts.get("progress")
        show = sys.stderr.isatty() if show is None else show
        bar = tqdm(total=cfg.steps, disable=not (show and self.rank == 0), unit="step", file=sys.stderr,
                   desc=f"{cfg.recipe}/{cfg.backend} x{self.world}", dynamic_ncols=True)
        t_start = time.perf_counter()
        rows = []
        try:
            for step in range(1, cfg.steps + 1):
                row = self.train_step(step)
                if self.rank == 0:
                    if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                        row["val_loss"] = self.evaluate()
                    with open(self.out / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(row) + "\n")
                rows.append(row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}")
        finally:
            bar.close()
            if self.recorder is not None:
                self.recorder.close()
        mems = [self.memory()]
        if self.world > 1:
            mems = [None] * self.world
            dist.all_gather_object(mems, self.memory())
        if self.rank == 0:
            self._finish(rows, mems, time.perf_counter() - t_start)

    def _finish(self, rows: list[dict], mems: list[dict], wall_s: float) -> None:
        import json

        from fp8sim.training.checkpoint import save_checkpoint

        cfg = self.cfg
        save_checkpoint(self.out, step=cfg.steps, model=self.model, optimizer=self.optimizer,
                        policies=self.fp8.state_dict() if self.fp8 is not None else None, config=cfg.to_dict(),
                        extra={"world": self.world, "rank": 0})
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        comm = {k: sum(r["comm_bytes"][k] for r in rows) / len(rows) for k in rows[0]["comm_bytes"]}
        if comm["wgrad_bf16_equiv"]:
            comm["wgrad_fp8_vs_bf16"] = (comm["wgrad_fp8"] + comm["scales"]) / comm["wgrad_bf16_equiv"]
        times = sorted(r["step_time_s"] for r in rows)
        summary = {
            "config": cfg.to_dict(), "recipe": self.recipe.to_dict(), "nproc": self.world,
            "parameters": self.model.num_params(), "steps_done": rows[-1]["step"],
            "final_loss": rows[-1]["loss"], "final_val_loss": vals[-1] if vals else None,
            "overflow": sum(r.get("overflow", 0) for r in rows), "underflow": sum(r.get("underflow", 0) for r in rows),
            "memory_bytes_per_param": mems[0], "memory_bytes_per_param_ranks": mems,
            "comm_bytes_per_step": comm,
            "median_step_time_s": times[len(times) // 2], "wall_s": wall_s,
            "corpus": {"source": self.corpus.source, "bytes": self.corpus.num_bytes, "files": self.corpus.num_files},
        }
        if self.fp8_names:
            summary["allreduce"] = {k: sum(r["allreduce"][k] for r in rows) for k in ("overflow", "underflow", "nonzero")}
            summary["allreduce"]["mu_final"] = rows[-1]["allreduce"]["mu_min"], rows[-1]["allreduce"]["mu_max"]
        if self.zero is not None:
            summary["zero_loads"] = self.zero.loads()
        tmp = self.out / "run.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.out / "run.json")
