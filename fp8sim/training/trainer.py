"""The training loop: one recipe, one backend, a run directory.

A run directory (:mod:`fp8sim.training.run_dir`) holds ``config.json`` (the :class:`TrainConfig`,
the run's identity and the command line's options), ``metrics.jsonl`` (one JSON
object per step: ``step`` (1-based), ``loss`` (training cross-entropy of that step's batch, nats
per byte, before the update), ``lr``, ``grad_norm`` (before clipping), ``step_time_s``,
``tokens_per_s``, ``overflow``/``underflow`` (FP8 cast events of the step), and ``val_loss`` on
evaluation steps), ``checkpoint.pt`` (see :mod:`fp8sim.training.checkpoint`) and, at the end,
``run.json`` (summary: final losses, memory per parameter measured from the live tensors,
event totals).

Determinism: on CPU a run is a pure function of its config. Batches depend only on (seed, step),
the model is initialised from the seed, and resuming restores model, optimizer, policies and RNG,
so a killed-and-resumed run writes the same losses, bit for bit, as the uninterrupted one.
Resuming a finished run changes nothing; resuming it with more ``steps`` extends it, its
learning-rate schedule kept (:meth:`TrainConfig.continues`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from fp8sim.atomic_file import append_line, remove_own_file
from fp8sim.training.checkpoint import CHECKPOINT_NAME, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from fp8sim.training.data import ByteCorpus, get_batch, load_corpus
from fp8sim.training.convert import convert_to_fp8, get_fp8_state
from fp8sim.training.config import BACKENDS, ConfigError, TrainConfig
from fp8sim.training.model import GPT
from fp8sim.recipes import get_recipe
from fp8sim.training.run_dir import (  # noqa: F401  (check_summary, run_begun, start_mode: also importable here)
    check_metrics_cover,
    check_summary,
    new_run_id,
    read_metrics,
    read_run_identity,
    read_summary,
    run_begun,
    say_finished,
    start_mode,
    stored_config,
    write_json,
    write_metrics,
    write_run_config,
)

__all__ = ["TrainConfig", "Trainer", "mean_val_loss", "memory_per_parameter", "read_metrics", "BACKENDS"]

def memory_per_parameter(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes per parameter of weights, gradients and optimizer states, from the live tensors.

    Counts each distinct tensor once (tied weights once). Gradients that do not exist (before
    the first backward) count zero.
    """
    params = list({id(p): p for p in model.parameters()}.values())
    n = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    opt = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                opt += v.numel() * v.element_size()
    return {
        "parameters": n,
        "weights": weights / n,
        "grads": grads / n,
        "optimizer": opt / n,
        "total": (weights + grads + opt) / n,
    }


@torch.no_grad()
def mean_val_loss(model, corpus, cfg, fp8, autocast, device: str | torch.device = "cpu") -> float:
    """Mean validation loss of ``model`` over ``cfg.eval_batches`` fixed batches of ``corpus``.

    ``fp8`` (the converted model's FP8 state, or None) stops observing meanwhile, so evaluation
    never updates scaling policies; ``autocast()`` gives the recipe's autocast context. In a
    data-parallel run every rank evaluates (FSDP2's all-gathers and the amax reductions are
    collectives); the batches go to ``device``.
    """
    model.eval()
    if fp8 is not None:
        fp8.observing = False
    try:
        losses = []
        for i in range(cfg.eval_batches):
            x, y = get_batch(corpus, "val", i, cfg.batch_size, cfg.model.block_size, cfg.seed)
            x, y = x.to(device), y.to(device)
            with autocast():
                losses.append(float(model(x, y)[1]))
    finally:
        if fp8 is not None:
            fp8.observing = True
        model.train()
        _reshard(model)
    return sum(losses) / len(losses)


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2 keeps the root's parameters gathered after a forward without backward (evaluation):
    shard them again, so the model's parameters are the optimizer's and memory counts shards."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def needs_data_parallel(recipe) -> bool:
    """Whether ``recipe`` trains only through :class:`~fp8sim.training.distributed.DataParallel`
    (FP8-LM's FP8 all-reduce, FP8 Adam or FP8 weights), even on one rank."""
    return not recipe.single_process


class Trainer:
    """Builds model, optimizer and data for a :class:`TrainConfig` and trains in ``out_dir``.

    The one training loop, for one process and for every rank of a data-parallel run. Without
    ``data_parallel`` it trains in this process and checkpoints to ``out_dir/checkpoint.pt``. With
    a :class:`~fp8sim.training.distributed.DataParallel` it is one rank of ``world``: it trains on
    its rows of every batch, the object does the gradient communication (DDP with FP8-LM's FP8
    all-reduce, FSDP2 for O3) and the loop checkpoints with DCP; rank 0 writes the metrics.

    ``resume=True`` continues from the run's last checkpoint; its config must equal ``cfg``
    exactly (the learning-rate schedule depends on ``steps``, batches on ``seed``, ...), or be
    the run extended (more steps, the schedule kept: :meth:`TrainConfig.continues`), and the
    checkpoint must be this run's (its ``run_id`` the one in config.json; metrics.jsonl holding
    every step up to it). A finished run (``finished``: its checkpoint is after the last step)
    changes nothing: no file is written, :meth:`run` says so and returns its summary.
    ``start`` (``"fresh"``, ``"resume"`` or ``"restart"``, see :func:`start_mode`) is the
    launcher's decision for the ranks of a data-parallel run; None: decided here from ``resume``.
    ``recorder_factory(model)`` (optional) gives a recorder that gets
    ``begin_step(step)``/``end_step(step)``/``close()`` calls; see :func:`fp8sim.training.record`.
    ``run_options`` (optional): what config.json stores besides the config (the command line's
    options, :data:`fp8sim.commands.train.RUN_OPTIONS`); None keeps those stored there.
    ``run_id``: a fresh run's identity (default: a new one); a run that has begun keeps its own.
    ``device``: where the model, the batches, the optimizer state and the FP8 state live (``cpu``,
    ``cuda``, ``cuda:N``; a data-parallel rank's ``cuda`` is its ``cuda:LOCAL_RANK``).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        out_dir: str | os.PathLike,
        *,
        resume: bool = False,
        corpus: ByteCorpus | None = None,
        recorder_factory: Callable[[torch.nn.Module], Any] | None = None,
        data_parallel: Any = None,
        start: str | None = None,
        run_options: dict | None = None,
        run_id: str | None = None,
        device: str = "cpu",
    ) -> None:
        from fp8sim.training.distributed import check_device, rank_device

        check_device(device)
        self.device = rank_device(device)
        self.cfg = cfg
        self.out = Path(out_dir)
        self.dp = dp = data_parallel
        self.rank = dp.rank if dp is not None else 0
        self.recipe = get_recipe(cfg.recipe)  # a name, or the Recipe object itself
        if dp is None and needs_data_parallel(self.recipe):
            raise NotImplementedError(
                f"recipe {cfg.recipe_name}: optimizer={self.recipe.optimizer}, grad_comm={self.recipe.grad_comm}, "
                f"weight_storage={self.recipe.weight_storage} need the distributed FP8-LM trainer"
            )
        self.corpus = corpus if corpus is not None else load_corpus(cfg.data, max_bytes=cfg.max_bytes)
        self.corpus.check_block_size(cfg.model.block_size)
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.model).to(self.device)  # initialised on the CPU (the seed's numbers), then moved
        if self.recipe.is_fp8:
            # the linear level; the FP8-LM levels are the data-parallel trainer's (dp.attach)
            # the amaxes MAX-reduced over the run's ranks (TE's amax reduction group); one rank: none,
            # even inside a larger process group (a test's single-process reference)
            group = torch.distributed.group.WORLD if dp is not None and dp.world > 1 else None
            convert_to_fp8(self.model, self.recipe.linear, cfg.backend, gemm_accumulate=cfg.gemm_accumulate,
                           amax_reduction=group)
        self.fp8 = get_fp8_state(self.model)
        hp = {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": cfg.weight_decay}
        if dp is None:
            self.module: torch.nn.Module = self.model  # what the training forward goes through
            self.optimizer: Any = torch.optim.AdamW(self.model.parameters(), **hp, foreach=False)
        else:  # DDP (with the FP8 all-reduce hook) or, under FP8-LM O3, FSDP2; FP8-LM's optimizer
            self.module, self.optimizer = dp.attach(self.model, self.recipe, cfg, hp)
        self.params = list(self.model.parameters())  # FSDP2's sharded parameters when it shards
        if start is None:
            start = start_mode(self.out, resume, data_parallel=dp is not None, config=cfg,
                               own=(run_options or {}).get("record"))  # fmt: skip
        self.start_step = 0
        stored = _stored_identity(self.out, fresh=start == "fresh" and dp is None)
        self.run_id = stored[0] or run_id or new_run_id()
        ck = self._resume() if start == "resume" else None
        #: a resumed run with no step left: nothing is written (see run())
        self.finished = ck is not None and self.start_step == cfg.steps
        if self.rank == 0 and not self.finished:
            self.out.mkdir(parents=True, exist_ok=True)
            options = run_options if run_options is not None else stored[1]
            write_run_config(self.out, cfg, self.run_id, options)  # whole or absent
            if ck is None:  # fresh, or a restart of a run killed before its first checkpoint
                write_metrics(self.out, [])
            else:  # a run.json there is the summary of a shorter run: the run is extended now
                remove_own_file(self.out / "run.json")
        self.recorder = recorder_factory(self.model) if recorder_factory and not self.finished else None
        if start != "fresh" and self.recorder is not None:
            self.recorder.truncate_after(self.start_step)  # the steps after it are recorded again
            rec = None if ck is None else ck.get("recorder" if self.dp is None else f"recorder_rank{self.rank}")
            if rec:
                self.recorder.load_state_dict(rec)

    # -- checkpoints ------------------------------------------------------------------------
    def _resume(self) -> dict:
        """Restore the last checkpoint (a data-parallel run's: DCP's, into this rank's model and
        optimizer); returns its payload. A checkpoint whose contents do not fit the run (a missing
        key, a tensor of another shape, a step outside ``0..steps``) raises ValueError naming its
        file: damaged input, never a crash."""
        if self.dp is None:
            ck = load_checkpoint(self.out)
            where = self.out / CHECKPOINT_NAME
        else:
            from fp8sim.training.dist_checkpoint import CHECKPOINT_DIR, latest_checkpoint

            where = self.out / CHECKPOINT_DIR / f"step{latest_checkpoint(self.out)['step']:08d}"
            ck = self.dp.read_checkpoint(self.out)  # its plain entries, checked before anything is restored
        try:
            written_by = stored_config(ck["config"], like=self.cfg)
        except (ConfigError, TypeError) as exc:
            if isinstance(ck["config"].get("recipe"), dict):  # another custom recipe than this run's
                raise ValueError(f"--resume: {self.out}: checkpoint was written by a different config "
                                 f"(differs in ['recipe'])") from None  # fmt: skip
            raise ValueError(f"{where}: damaged checkpoint: its config is not a run config ({exc})") from None
        if not self.cfg.continues(written_by):
            diff = sorted(k for k, v in self.cfg.to_dict().items() if written_by.to_dict().get(k) != v)
            raise ValueError(f"--resume: {self.out}: checkpoint was written by a different config (differs in {diff})")
        if ck.get("run_id") is not None and ck["run_id"] != self.run_id:  # rank 0's says for the run
            raise ValueError(f"--resume: {where} is a checkpoint of another run (run id {ck['run_id']}) than "
                             f"the one in {self.out} (run id {self.run_id}, config.json); refused (nothing changed)")
        if not 0 <= ck["step"] <= self.cfg.steps:  # an int (load_payload): -4 would train at lr <= 0
            raise ValueError(f"{where}: corrupt checkpoint: step {ck['step']} is outside 0..{self.cfg.steps}")
        _check_corpus(self.out, ck, self.corpus)
        try:
            if self.dp is None:
                with torch.no_grad():
                    self.model.load_state_dict(ck["model"])
                self.optimizer.load_state_dict(ck["optimizer"])
                if self.fp8 is not None:
                    self.fp8.load_state_dict(ck["policies"])
            else:  # model, optimizer, FP8 state, reducer (DCP reshards them)
                self.dp.restore_checkpoint(self.out)
            restore_rng(ck["rng"])
            _check_restored(self.optimizer)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError,
                RecursionError, OverflowError) as exc:  # fmt: skip
            text = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ValueError(f"{where}: damaged checkpoint: it does not fit the run "
                             f"({type(exc).__name__}: {text})") from None  # fmt: skip
        self.start_step = ck["step"]
        if self.rank == 0:  # the steps after the checkpoint are run (and logged) again
            rows = read_metrics(self.out)
            kept = [r for r in rows if r["step"] <= self.start_step]
            check_metrics_cover(self.out, kept, self.start_step, where)
            if len(kept) < len(rows):
                write_metrics(self.out, kept)
        return ck

    def save(self, step: int) -> None:
        """Checkpoint after ``step`` (in a data-parallel run every rank calls it: a collective).
        The trace is flushed first, so a checkpoint never points past the steps the trace holds
        (steps after it are re-run, and re-recorded, on resume)."""
        if self.recorder is not None:
            self.recorder.flush()
        recorder = {"recorder": self.recorder.state_dict()} if self.recorder is not None else {}
        policies = self.fp8.state_dict() if self.fp8 is not None else None
        if self.dp is None:
            save_checkpoint(self.out, step=step, model=self.model, optimizer=self.optimizer, policies=policies,
                            config=self.cfg.to_dict(),
                            extra={"corpus": self.corpus.fingerprint, "run_id": self.run_id, **recorder})
            return
        recorder = {f"recorder_rank{self.rank}": recorder["recorder"]} if recorder else {}  # one trace per rank
        self.dp.save_checkpoint(self.out, step, {
            "config": self.cfg.to_dict(), "rng": capture_rng(), "corpus": self.corpus.fingerprint,
            "run_id": self.run_id, **recorder})  # fmt: skip

    # -- steps ------------------------------------------------------------------------------
    def _autocast(self):
        if self.recipe.autocast == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, step: int) -> torch.Tensor:
        """Forward and backward of 1-based ``step``'s batch (this rank's rows of it); returns the
        loss. Afterwards the gradients are reduced over the ranks (``p.grad``, or the FP8 ones in
        the reducer's stash)."""
        cfg = self.cfg
        x, y = get_batch(self.corpus, "train", step - 1, cfg.batch_size, cfg.model.block_size, cfg.seed)  # (B, T)
        x, y = x.to(self.device), y.to(self.device)
        if self.dp is not None:
            x, y = self.dp.local_rows(x), self.dp.local_rows(y)  # (B / world, T)
            self.dp.begin_step()
        if self.fp8 is not None:
            self.fp8.step = step
        if self.recorder is not None:
            self.recorder.begin_step(step)
        self.model.train()
        for p in self.params:
            p.grad = None
        with self._autocast():
            _, loss = self.module(x, y)
        loss.backward()  # DDP / FSDP2: the gradients are reduced (FP8: the hook, the reduce-scatter) here
        if self.recorder is not None:
            self.recorder.end_step(step)
        return loss

    def train_step(self, step: int) -> dict:
        """Run 1-based training ``step``; returns its metrics row (over every rank)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = cfg.lr_at(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss = self.forward_backward(step)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        if self.dp is not None:  # FP8-LM: the gradients in the reducer's stash, clipping in their scales
            grad_norm = self.dp.step(self.params, max_norm)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            self.optimizer.step()
        loss_value, stats = float(loss.detach()), self.fp8.pop_events() if self.fp8 is not None else {}
        if self.dp is not None:  # the mean loss and summed events over the ranks, bytes sent
            loss_value, stats = self.dp.step_metrics(loss_value, stats)
        dt = time.perf_counter() - t0
        return {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "step_time_s": dt,
                "tokens_per_s": cfg.batch_size * cfg.model.block_size / dt, **stats}

    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` fixed batches (policies not updated)."""
        return mean_val_loss(self.model, self.corpus, self.cfg, self.fp8, self._autocast, self.device)

    def run(self, *, progress: bool | None = None, stop_after: int | None = None) -> dict:
        """Train from the current step to ``cfg.steps`` (or through ``stop_after``, as if killed
        then); returns the summary (``{}`` on ranks > 0).

        ``progress`` on stderr, rank 0 only: ``True`` a tqdm bar with loss and tokens/s, ``False``
        nothing, ``None`` (default) the bar on a terminal and otherwise a line every
        :data:`PROGRESS_LINE_S` seconds (and at the last step) -- a log file shows the run is alive.
        A finished run (:attr:`finished`) says so on stderr and returns its run.json, unchanged.
        """
        cfg = self.cfg
        if self.finished and (self.out / "run.json").is_file():
            if self.rank != 0:
                return {}
            say_finished(self.out, cfg.steps)
            return read_summary(self.out / "run.json")
        last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        desc = f"{cfg.recipe_name}/{cfg.backend}" + (f" x{self.dp.world}" if self.dp is not None else "")
        bar = _progress(progress and self.rank == 0 if progress is not None else (None if self.rank == 0 else False),
                        total=cfg.steps, initial=self.start_step, desc=desc)  # fmt: skip
        t_start = time.perf_counter()
        summary = None
        done = self.start_step  # the last step whose records are whole
        try:
            for step in range(self.start_step + 1, last + 1):
                row = self.train_step(step)
                done = step
                final = step == cfg.steps
                if final or (cfg.eval_every and step % cfg.eval_every == 0):
                    row["val_loss"] = self.evaluate()  # every rank: the casts' amax reductions are collectives
                if self.rank == 0:
                    append_line(self.out / "metrics.jsonl", json.dumps(row) + "\n")  # whole or absent
                if final:  # run.json before the final checkpoint: a run killed in between
                    # resumes before the final step and writes it again; one resumed after it
                    # has run no step and keeps it (its gradients, part of the memory, are gone)
                    summary = self.write_summary(time.perf_counter() - t_start)
                if final or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                    self.save(step)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
        finally:
            bar.close()
            if self.recorder is not None and last == cfg.steps:
                if sys.exc_info()[0] is not None:  # interrupted: a step cut short is not written
                    self.recorder.discard_after(done)
                self.recorder.close()
        if last < cfg.steps:
            return self.summary(wall_s=time.perf_counter() - t_start)
        if summary is not None:  # the final step ran here: run.json is written
            return summary
        if (self.out / "run.json").is_file():
            return read_summary(self.out / "run.json") if self.rank == 0 else {}
        return self.write_summary(time.perf_counter() - t_start)  # a finished run of an older version

    def write_summary(self, wall_s: float) -> dict:
        """Write run.json (rank 0) and return the summary (collective: every rank calls it)."""
        summary = self.summary(wall_s=wall_s)
        if self.rank == 0:
            write_json(self.out / "run.json", summary)
        return summary

    def summary(self, wall_s: float | None = None) -> dict:
        """The run's summary from its metrics; in a data-parallel run a collective (the ranks'
        memory figures are gathered) whose result is rank 0's, ``{}`` elsewhere."""
        if self.dp is None:
            memory = memory_per_parameter(self.model, self.optimizer)
        else:
            ranks = self.dp.memory()  # every rank's figures (memory_breakdown)
            memory = ranks[0]
        if self.rank != 0:
            return {}
        rows = read_metrics(self.out)
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        out = {
            "config": self.cfg.to_dict(),
            "recipe": self.recipe.to_dict(),
            "parameters": self.model.num_params(),
            "steps_done": rows[-1]["step"] if rows else 0,
            "final_loss": rows[-1]["loss"] if rows else None,
            "final_val_loss": vals[-1] if vals else None,
            "overflow": sum(r.get("overflow", 0) for r in rows),
            "underflow": sum(r.get("underflow", 0) for r in rows),
            "memory_bytes_per_param": memory,
            "median_step_time_s": _median([r["step_time_s"] for r in rows]),
            "wall_s": wall_s,
            "corpus": {"source": self.corpus.source, "bytes": self.corpus.num_bytes, "files": self.corpus.num_files},
        }
        if self.dp is not None:  # options, ranks, bytes sent, FP8 all-reduce events
            out.update(self.dp.summary(rows), memory_bytes_per_param_ranks=ranks)
        return out


def _check_restored(optimizer: Any) -> None:
    """ValueError unless every number a checkpoint restored into the optimizer's state is one a
    run can hold: finite hyperparameters, ``lr`` > 0 and finite (it is set again every step, but a
    NaN there would otherwise be the first thing trained with), step counts >= 0."""
    groups = getattr(optimizer, "param_groups", [])
    for g in groups:
        lr = float(g.get("lr", 0.0))
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate {lr!r} restored")
        for key in ("weight_decay", "eps"):
            if key in g and not math.isfinite(float(g[key])):
                raise ValueError(f"{key} {g[key]!r} restored")
    for st in getattr(optimizer, "state", {}).values():
        step = st.get("step") if isinstance(st, dict) else None
        if step is not None and not (0 <= float(step) < 2**53):
            raise ValueError(f"optimizer step {float(step)} restored")


def _stored_identity(out: Path, *, fresh: bool) -> tuple[str | None, dict | None]:
    """(run id, options) stored in ``out``'s config.json: a resumed or restarted run keeps its
    identity, and so do the ranks of a data-parallel run whose launcher wrote it. (None, None)
    for a fresh single-process run, or where no config.json is (an older run's has neither)."""
    if fresh:
        return None, None
    try:
        _, run_id, options = read_run_identity(out)
    except FileNotFoundError:
        return None, None
    return run_id, options


def _check_corpus(out: Path, ck: dict, corpus) -> None:
    """ValueError if the checkpoint names another corpus than ``corpus`` (older ones name none)."""
    if ck.get("corpus") is not None and ck["corpus"] != corpus.fingerprint:
        raise ValueError(f"--resume: {out}: the corpus changed since the checkpoint (bytes:crc32 "
                         f"{ck['corpus']}, now {corpus.fingerprint}); resuming would train on other data")


#: seconds between progress lines when stderr is not a terminal
PROGRESS_LINE_S = 5.0


class _ProgressLines:
    """tqdm's ``update``/``set_postfix``/``close`` as a plain line on stderr every
    :data:`PROGRESS_LINE_S` seconds and at the last step (for logs and pipes)."""

    def __init__(self, total: int, initial: int, desc: str) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.t0 = self.last_print = time.monotonic()
        self.postfix: dict = {}

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **kw: Any) -> None:
        self.postfix = kw
        now = time.monotonic()
        if now - self.last_print >= PROGRESS_LINE_S or self.n >= self.total:
            self.last_print = now
            extra = "".join(f", {k.replace('tok_s', 'tokens/s')} {v}" for k, v in kw.items())
            print(f"{self.desc}: step {self.n}/{self.total}{extra} ({now - self.t0:.0f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(mode: bool | None, *, total: int, initial: int, desc: str):
    """A tqdm bar (``True``, or ``None`` on a terminal), progress lines (``None`` otherwise), or
    a silent bar (``False``)."""
    from tqdm import tqdm

    if mode is None and not sys.stderr.isatty():
        return _ProgressLines(total, initial, desc)
    return tqdm(total=total, initial=initial, disable=not mode and mode is not None, desc=desc, unit="step",
                file=sys.stderr, dynamic_ncols=True)  # fmt: skip


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])
