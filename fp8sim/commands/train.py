"""``fp8sim train`` and ``fp8sim compare``.

``fp8sim train --recipe R --backend B --steps N [--record DIR] [--seed S] [--out DIR]``: trains the
tiny byte-level GPT, writes ``metrics.jsonl``, checkpoints and ``run.json`` into ``--out``; a
progress bar on stderr (loss, tokens/s) when stderr is a terminal and ``--json`` is not given.
``--resume`` continues the run in ``--out`` from its last checkpoint (data-parallel runs too:
``torch.distributed.checkpoint``, see :mod:`fp8sim.training.dist_checkpoint`), every option left
out taken from the run's config.json (:data:`CONFIG_FLAGS` and :data:`RUN_OPTIONS`); a finished
run is left as it is, and ``--steps M`` beyond its steps extends it (docs/training.md). One
process at a time writes a run directory (and a trace): a second is refused. ``--device`` puts the
run on a GPU. ``torchrun --nproc-per-node N -m fp8sim train ...`` or ``--nproc N`` (torchrun's
own launcher, started here) trains data-parallel over N ranks, and the FP8-LM recipes
(``fp8lm-o1/o2/o3``) always train through
:func:`fp8sim.training.distributed.train_distributed`; ``run.json`` then adds the bytes each rank
sends per step.

``fp8sim compare RUN_A RUN_B [--plot DIR]``: final loss delta, memory per parameter, FP8
overflow/underflow events; ``--plot`` writes ``loss_curves.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from fp8sim.commands.output import print_json
from fp8sim.output_dir import output_dir

__all__ = ["register", "run_train", "run_compare"]


#: ``fp8sim train`` options that set a TrainConfig field (``model.X``: a GPTConfig field). Their
#: parser default is None, so a ``--resume`` can tell a flag the user gave (checked against the
#: run's config.json) from one left out (taken from it); ``--help`` shows the real default.
CONFIG_FLAGS = {
    "recipe": "recipe", "backend": "backend", "gemm_accumulate": "gemm_accumulate", "steps": "steps",
    "seed": "seed", "data": "data", "batch_size": "batch_size", "lr": "lr", "warmup": "warmup",
    "eval_every": "eval_every", "checkpoint_every": "checkpoint_every", "n_layer": "model.n_layer",
    "n_head": "model.n_head", "n_embd": "model.n_embd", "block_size": "model.block_size",
    "decay_steps": "decay_steps",
}  # fmt: skip
#: ``fp8sim train`` options that are no TrainConfig field but change what the run writes (the
#: trace, the saved tensors, the ranks' checkpoints, FP8-LM's communication), with their defaults:
#: stored in config.json's ``options``; a ``--resume`` takes each one left out from there, and
#: refuses one given that differs (parser default None, as for :data:`CONFIG_FLAGS`)
RUN_OPTIONS = {"record": None, "save_every": 0, "nproc": 1, "grad_scaling": None, "fp8_grads": None}
#: ``fp8sim train`` options that change nothing a run writes: where the run is (``--out`` names
#: it), whether this command starts or continues it, and how the summary is printed; and where it
#: computes (``--device``: a resume may move a run to another device, whose rounding it then has)
TRANSIENT_OPTIONS = ("out", "resume", "json", "device")


def register(subparsers: argparse._SubParsersAction) -> None:
    from fp8sim.training.config import BACKENDS, GPTConfig, TrainConfig, defaults
    from fp8sim.recipes import list_recipes

    d, m = defaults(TrainConfig), defaults(GPTConfig)
    p = subparsers.add_parser(
        "train",
        help="train the tiny byte-level GPT with a precision recipe",
        description="Train the tiny byte-level GPT (default corpus: the Python standard library's .py files). "
                    "With --resume, the run's own config.json supplies every option left out.",
    )  # fmt: skip
    p.add_argument("--recipe", choices=list_recipes(), help=f"precision recipe (default {d['recipe']})")
    p.add_argument("--backend", choices=BACKENDS, help=f"FP8 backend (default {d['backend']})")
    p.add_argument("--gemm-accumulate", choices=("float32", "float64"),
                   help="FP8 GEMM accumulation on the CPU backends: float32 (torch.mm of the exactly decoded "
                        f"operands, fast) or float64 (exact products, one final rounding) (default {d['gemm_accumulate']})")
    p.add_argument("--steps", type=int, metavar="N",
                   help=f"training steps; with --resume, more than the run's extends it, its learning-rate schedule "
                        f"kept (default {d['steps']})")
    p.add_argument("--seed", type=int, metavar="S", help=f"seed of init and batches (default {d['seed']})")
    p.add_argument("--out", default=None, metavar="DIR", help="run directory (default runs/RECIPE-BACKEND-sSEED)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its checkpoint (a finished one is left as it is); options "
                        "left out come from its config.json, options given must match it")  # fmt: skip
    p.add_argument("--record", metavar="DIR", default=None, help="write a trace of every FP8 tensor to DIR")
    p.add_argument("--save-every", type=int, metavar="K",
                   help="with --record: also save full tensors every K steps (default 0: never)")
    p.add_argument("--data", metavar="FILE|DIR",
                   help=f"corpus: a text file or a directory of .py/.txt/.md files, at most {d['max_bytes'] // 2**20} MiB "
                        "used (default: the Python standard library's sources)")  # fmt: skip
    p.add_argument("--batch-size", type=int, metavar="B", help=f"sequences per step (default {d['batch_size']})")
    p.add_argument("--lr", type=float, help=f"peak learning rate; cosine decay to {d['min_lr_ratio']:g}x (default {d['lr']:g})")
    p.add_argument("--warmup", type=int, metavar="N", help=f"linear learning-rate warm-up steps (default {d['warmup']})")
    p.add_argument("--decay-steps", type=int, metavar="N",
                   help=f"the cosine decay ends at step N, then the learning rate stays at {d['min_lr_ratio']:g}x "
                        "(default: --steps; an extended run keeps the one it was trained with)")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help=f"validation loss every N steps and at the last (0: only at the last; default {d['eval_every']})")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help=f"checkpoint every N steps and at the last (0: only at the last; default {d['checkpoint_every']})")
    p.add_argument("--n-layer", type=int, metavar="N", help=f"transformer blocks (default {m['n_layer']})")
    p.add_argument("--n-head", type=int, metavar="N", help=f"attention heads, dividing --n-embd (default {m['n_head']})")
    p.add_argument("--n-embd", type=int, metavar="C",
                   help=f"model width; FP8 GEMMs need a multiple of 16 (32 for MX) (default {m['n_embd']})")
    p.add_argument("--block-size", type=int, metavar="T", help=f"context length in bytes (default {m['block_size']})")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="where the model, batches, optimizer and FP8 state live: cpu, cuda (data-parallel rank r "
                        "on cuda:LOCAL_RANK) or cuda:N (default %(default)s)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="data-parallel ranks, started by torchrun's launcher (torch.distributed.run; gloo on CPU, "
                        f"nccl on CUDA); under torchrun the ranks come from the environment (default {RUN_OPTIONS['nproc']})")
    p.add_argument("--grad-scaling", default=None, choices=("autoscale", "msamp"),
                   help="FP8 gradient all-reduce of the fp8lm recipes: FP8-LM's AutoScale (default) or MS-AMP's "
                        "fixed 1/sqrt(N) pre-scale")
    p.add_argument("--fp8-grads", default=None, choices=("all", "linear"),
                   help="fp8lm recipes: which gradients travel (and are stored) in E4M3 -- every parameter's "
                        "(default) or only the FP8 linears' weights' as MS-AMP does")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(func=run_train)

    c = subparsers.add_parser(
        "compare",
        help="compare two training runs (loss, memory, FP8 events)",
        description="Compare run B against run A: final loss delta, bytes per parameter, overflow/underflow.",
    )
    c.add_argument("run_a", metavar="RUN_A", help="the reference run directory (e.g. the bf16 run)")
    c.add_argument("run_b", metavar="RUN_B", help="the run compared with it")
    c.add_argument("--plot", metavar="DIR", default=None, help="write loss_curves.png into DIR")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    c.set_defaults(func=run_compare)


def config_from_args(args: argparse.Namespace, stored: dict | None = None):
    """The run's TrainConfig: each option given on the command line, else ``stored`` (a resumed
    run's config.json) else the default. An option given that differs from ``stored`` is refused,
    naming the flag; a bad value is refused naming the flag (``--steps must be ...``). With
    ``stored``, ``--steps M`` beyond its steps extends the run, its schedule kept
    (:meth:`~fp8sim.training.config.TrainConfig.extended`); fewer steps are refused."""
    from fp8sim.training.config import ConfigError, TrainConfig

    if stored is not None:
        stored = TrainConfig.from_dict(stored).to_dict()  # a damaged config.json: its own error
    base = dict(stored) if stored is not None else TrainConfig().to_dict()
    model = dict(base.get("model") or {})
    extend_to = None
    for dest, path in CONFIG_FLAGS.items():
        given = getattr(args, dest, None)
        if given is None:
            continue
        key, target = (path[6:], model) if path.startswith("model.") else (path, base)
        if stored is not None and key == "decay_steps" and given == (stored["decay_steps"] or stored["steps"]):
            continue  # the schedule the run has: said, not changed
        if stored is not None and key == "steps" and type(given) is int and given > stored["steps"]:
            extend_to = given
            continue
        if stored is not None and target.get(key) != given:
            if key == "steps":
                raise ValueError(f"--steps {given}: the run in --out was asked for {stored['steps']} steps; "
                                 f"--steps extends it (more than {stored['steps']}), or leave it out")  # fmt: skip
            raise ValueError(f"--{dest.replace('_', '-')} {given}: the run in --out was trained with "
                             f"{target.get(key)!r}; leave the option out to resume it")  # fmt: skip
        target[key] = given
    base["model"] = model
    try:
        cfg = TrainConfig.from_dict(base)
        return cfg if extend_to is None else cfg.extended(extend_to)
    except ConfigError as exc:
        flag = {path: dest for dest, path in CONFIG_FLAGS.items()}.get(exc.field)
        if flag is None:
            raise
        raise ValueError(f"--{flag.replace('_', '-')} {exc.rule}") from None


#: what each run option may hold (stored in config.json, or given)
_OPTION_RULES = {
    "record": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "a directory"),
    "save_every": (lambda v: type(v) is int and 0 <= v <= 2**40, "an integer from 0 to 2**40"),
    "nproc": (lambda v: type(v) is int and 1 <= v <= 4096, "an integer from 1 to 4096"),
    "grad_scaling": (lambda v: v in (None, "autoscale", "msamp"), "autoscale or msamp"),
    "fp8_grads": (lambda v: v in (None, "all", "linear"), "all or linear"),
}  # fmt: skip


def options_from_args(args: argparse.Namespace, stored: dict | None = None) -> dict:
    """The run's :data:`RUN_OPTIONS`: each given on the command line, else ``stored`` (a resumed
    run's config.json ``options``), else the default; ``--record`` as an absolute path (a resume
    from another directory finds the same trace). An option given that differs from the stored
    one, or a bad value, is refused naming the flag."""
    out = {}
    for dest, default in RUN_OPTIONS.items():
        flag = f"--{dest.replace('_', '-')}"
        given = getattr(args, dest, None)
        ok, want = _OPTION_RULES[dest]
        if given is not None and not ok(given):
            raise ValueError(f"{flag} must be {want}, got {given!r}")
        if dest == "record" and given is not None:
            given = os.path.abspath(given)
        if stored is not None and dest in stored:
            if not ok(stored[dest]):
                raise ValueError(f"options.{dest} is {stored[dest]!r:.60}, not {want}")
            if given is not None and given != stored[dest]:
                raise ValueError(f"{flag} {getattr(args, dest)}: the run in --out was trained with "
                                 f"{stored[dest]!r}; leave the option out to resume it")  # fmt: skip
            out[dest] = stored[dest]
        else:
            out[dest] = default if given is None else given
    return out


def _stored_config(args: argparse.Namespace) -> tuple[dict | None, dict | None, str | None]:
    """With ``--resume``, the run's config.json: (its TrainConfig fields, its options, its run
    id); Nones when it has none yet (a run killed before writing it starts again from the
    flags). ValueError naming the file when it is not a run config."""
    from fp8sim.training.run_dir import read_run_config

    if not args.resume:
        return None, None, None
    try:
        cfg, run_id, options = read_run_config(Path(args.out or _default_out(args)))
    except FileNotFoundError:
        return None, None, None
    except ValueError as exc:
        raise ValueError(f"--resume: {exc}") from None
    return cfg.to_dict(), options, run_id


def _default_out(args: argparse.Namespace) -> str:
    from fp8sim.training.config import TrainConfig, defaults

    d = defaults(TrainConfig)
    pick = lambda k: d[k] if getattr(args, k) is None else getattr(args, k)  # noqa: E731
    return f"runs/{pick('recipe')}-{pick('backend')}-s{pick('seed')}"


def _run_distributed(args: argparse.Namespace, cfg, out: Path, opts: dict) -> dict | None:
    """Data-parallel and FP8-LM runs (:mod:`fp8sim.training.distributed`); None on ranks > 0."""
    from fp8sim.training.distributed import SharedError, torchrun_env, train_distributed

    env = torchrun_env()
    if not env or env[0] == 0:
        print(f"fp8sim train: {cfg.recipe} on {cfg.backend}, {env[1] if env else opts['nproc']} rank(s) -> {out}",
              file=sys.stderr)
    try:
        summary = train_distributed(cfg, out, nproc=opts["nproc"], grad_scaling=opts["grad_scaling"],
                                    fp8_grads=opts["fp8_grads"], record=opts["record"], save_every=opts["save_every"],
                                    progress=None if not args.json else False, resume=args.resume,
                                    run_options=opts, device=args.device)  # fmt: skip
    except SharedError:
        if env and env[0] != 0:  # rank 0 says it, once
            raise SystemExit(2) from None
        raise
    return None if env and env[0] != 0 else summary


def _check_outside_data(data: str | None, outputs: dict) -> None:
    """Refuse an output directory at or inside a ``--data`` directory: the run's files would
    become training data (and change the corpus a --resume checks)."""
    if data is None or not os.path.isdir(data):
        return
    root = os.path.realpath(data)
    for opt, path in outputs.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            raise ValueError(f"{opt} {path}: inside the --data directory {data}; its files would "
                             "become training data (write it elsewhere)")  # fmt: skip


def run_train(args: argparse.Namespace) -> int:
    from fp8sim.output_dir import check_output_path
    from fp8sim.training.distributed import check_device, torchrun_env
    from fp8sim.recipes import get_recipe
    from fp8sim.training.run_dir import new_run_id, run_begun

    check_device(args.device)  # before anything is written

    for opt in ("out", "record"):
        if getattr(args, opt) is not None:
            check_output_path(getattr(args, opt), f"--{opt}")
    stored, stored_options, run_id = _stored_config(args)
    try:
        cfg = config_from_args(args, stored)
        opts = options_from_args(args, stored_options)
    except ValueError as exc:
        if stored is None or str(exc).startswith("--"):
            raise
        raise ValueError(f"--resume: {Path(args.out or _default_out(args)) / 'config.json'} is not an fp8sim "
                         f"run config ({exc})") from None
    out = Path(args.out or _default_out(args))
    env = torchrun_env()
    if env:  # the ranks come from the environment
        opts["nproc"] = env[1]
    _check_outside_data(cfg.data, {"--out": out, "--record": opts["record"]})
    if opts["record"] is not None and not args.resume and not run_begun(out):  # before config.json
        rec = Path(opts["record"])
        if (rec / "trace.json").exists() or (rec / "rank0" / "trace.json").exists():
            raise ValueError(f"--record {args.record}: already holds a trace; record a new run into a new "
                             "directory (a resumed run, --resume, continues its own)")  # fmt: skip
    with contextlib.ExitStack() as held:  # one process at a time writes the run (and its trace)
        if not env or env[0] == 0:
            held.enter_context(output_dir(out, "--out"))
            if opts["record"] is not None:
                held.enter_context(output_dir(opts["record"], "--record"))
        summary = _train(args, cfg, out, opts, get_recipe(cfg.recipe), env, run_id or new_run_id())
    if summary is not None:
        _print_summary(args, summary, out)
    return 0


def _train(args: argparse.Namespace, cfg, out: Path, opts: dict, r, env, run_id: str) -> dict | None:
    """Train (or resume) the run (``run_id``: its identity, config.json's when it has begun);
    its summary (None on the ranks > 0 of a torchrun job)."""
    from fp8sim.training.trainer import Trainer

    if opts["nproc"] != 1 or env or opts["grad_scaling"] or opts["fp8_grads"] or (
            r.optimizer, r.grad_comm, r.weight_storage) != ("adamw", "none", "fp32"):  # fmt: skip
        return _run_distributed(args, cfg, out, opts)

    def recorder_for(model):
        from fp8sim.training.recorder import record

        return record(
            model, opts["record"], save_every=opts["save_every"], chunk_steps=max(1, cfg.checkpoint_every),
            config={"run": cfg.to_dict(), "run_dir": str(out), "run_id": run_id}, append=args.resume,
        )

    trainer = Trainer(cfg, out, resume=args.resume, recorder_factory=recorder_for if opts["record"] else None,
                      run_options=opts, run_id=run_id, device=args.device)  # fmt: skip
    if not trainer.finished:
        print(f"fp8sim train: {cfg.recipe} on {cfg.backend}, {trainer.model.num_params():,} parameters, "
              f"corpus {trainer.corpus.source} ({trainer.corpus.num_bytes:,} bytes) -> {out}", file=sys.stderr)
    return trainer.run(progress=None if not args.json else False)


def _print_summary(args: argparse.Namespace, summary: dict, out: Path) -> None:
    if args.json:
        print_json(summary)
    else:
        mem = summary["memory_bytes_per_param"]
        print(f"run            {out}")
        print(f"final loss     {summary['final_loss']:.4f}")
        print(f"final val loss {summary['final_val_loss']:.4f}")
        print(f"overflow       {summary['overflow']}   underflow {summary['underflow']}")
        master = f", master {mem['master']:.2f}" if mem.get("master") else ""
        count = f"; FP8-LM count {mem['fp8lm']:.2f}" if "fp8lm" in mem else ""
        print(f"bytes/param    {mem['total']:.2f} (weights {mem['weights']:.2f}{master}, grads {mem['grads']:.2f}, "
              f"optimizer {mem['optimizer']:.2f}{count})")
        print(f"median step    {summary['median_step_time_s'] * 1e3:.1f} ms")
        comm = summary.get("comm_bytes_per_step")
        if comm and summary.get("nproc", 1) > 1:
            sent = sum(comm[k] for k in ("wgrad_fp8", "scales", "grads_other", "weights"))
            ratio = comm.get("wgrad_fp8_vs_bf16")
            print(f"comm/step      {sent:,.0f} bytes per rank" + (f" (weight grads {ratio:.1%} of BF16)" if ratio else ""))


def run_compare(args: argparse.Namespace) -> int:
    from fp8sim.training.compare import compare_runs, format_comparison, plot_loss_curves

    result = compare_runs(args.run_a, args.run_b)
    if args.plot:
        with output_dir(args.plot, "--plot") as plot:  # one writer at a time
            png = plot_loss_curves([args.run_a, args.run_b], plot / "loss_curves.png")
        result["plot"] = str(png)
        print(f"fp8sim compare: wrote {png}", file=sys.stderr)
    if args.json:
        print_json(result)
    else:
        print(format_comparison(result))
    return 0
